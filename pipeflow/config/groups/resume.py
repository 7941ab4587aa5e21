"""The top-level ``resume``: a checkpoint, whole and written for this pipeline, read without torch.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ..values import ConfigError, naming_key

def check_resume(resume: str | None, expect: dict | None = None) -> None:
    """``resume`` names a whole checkpoint (every rank's file there, at the size written)
    written for this pipeline (``expect``: schedule, stages, world_size, placement)."""
    if resume is None:
        return
    if not Path(resume).expanduser().is_dir():
        raise ConfigError(
            f"resume={resume}: no such directory; give a previous run's folder (outputs/train/<date>/<time>) "
            f"or one of its checkpoints/step_N folders"
        )
    # The runtime's own reading of `resume` (run dir -> latest checkpoint), torch-free
    from pipeflow.formats.checkpoint import verify

    try:
        verify(str(Path(resume).expanduser()), expect or {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise naming_key("resume", resume, err) from None

def resume_expect(cfg: DictConfig, schedule) -> dict:
    """What a checkpoint to resume from must have been written for (as the ranks record it)."""
    return {"schedule": schedule.name, "stages": cfg.pipeline.stages, "world_size": schedule.num_devices,
            "placement": schedule.placement.as_lists()}
