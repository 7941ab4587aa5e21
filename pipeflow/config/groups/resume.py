"""The top-level ``resume``: a checkpoint, whole and written for this pipeline, read without
torch."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ..values import ConfigError, naming_key

def check_resume(resume: str | None, expect: dict | None = None, steps: int | None = None) -> None:
    """``resume`` names a whole checkpoint (every rank's file there, at the size written)
    of this run's model (``expect``; a checkpoint of the earlier format: of its pipeline
    too), short of ``steps`` (trainer.steps: a run resumed at or past it trains nothing)."""
    if resume is None:
        return
    if not Path(resume).expanduser().is_dir():
        raise ConfigError(
            f"resume={resume}: no such directory; give a previous run's folder (outputs/train/<date>/<time>) "
            f"or one of its checkpoints/step_N folders"
        )
    # The runtime's own reading of `resume` (run dir -> latest checkpoint), torch-free
    from pipeflow.formats.checkpoint_folder import verify

    try:
        _, record = verify(str(Path(resume).expanduser()), expect or {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise naming_key("resume", resume, err) from None
    if steps is not None and int(record["step"]) >= int(steps):
        raise ConfigError(f"trainer.steps={steps}: the checkpoint resume={resume} is at step {record['step']}, so "
                          f"nothing is left to train; give trainer.steps above {record['step']} to go on from it")

def resume_expect(cfg: DictConfig, schedule) -> dict:
    """What a checkpoint to resume from must have been written for (as the ranks record it)."""
    from pipeflow.formats.checkpoint_folder import model_record

    return {"schedule": schedule.name, "stages": cfg.pipeline.stages, "world_size": schedule.num_devices,
            "placement": schedule.placement.as_lists(), "shard": schedule.shard, "model": model_record(cfg.model)}


def resume_changes(cfg: DictConfig) -> list[str]:
    """What a resumed run changes of its checkpoint's settings
    (:data:`~pipeflow.formats.checkpoint_folder.TRAINING` and ``BATCH``), one sentence each and
    what follows from it; none for a checkpoint that does not record them."""
    if cfg.get("resume") is None:
        return []
    from pipeflow.formats.checkpoint_folder import read_meta, resolve, training_record

    folder, _ = resolve(str(Path(cfg.resume).expanduser()))
    saved = read_meta(folder, cfg.resume)["meta"].get("training") or {}
    here = training_record(cfg)
    return [f"resuming with {key}={_said(here[key])}, where the checkpoint was written with {key}={_said(saved[key])}: "
            f"its weights and optimizer state carry over{_then(key, here[key])}"
            for key in here if key in saved and saved[key] != here[key]]


def _said(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return "null" if value is None else str(value)


def _then(key: str, value) -> str:
    """What else a changed batch setting changes from the checkpoint on."""
    if key.endswith("seq_len"):
        return f", and each sequence from here on is {value} tokens"
    if key == "model.n_positions":
        return f" (rotary positions have no table), and sequences may be up to {value} tokens"
    if key.startswith("data."):
        return ", and the batches from here on come from this run's data"
    if key == "model.vocab_multiple":
        return " (the vocabulary's tables are cut or padded to this run's rows: their padding is zero)"
    return ""
