"""Checkpoints: each rank saves its own stages and optimizer state; rank 0 records the
step once every rank has written. A resumed run recomputes the batch of any step from
(seed, step) and the learning rate from the step, so it continues exactly where the
uninterrupted run would have been."""

from __future__ import annotations

import os
from pathlib import Path

# torch is imported where it is used: the trainer's up-front config check calls
# resolve() before any rank exists and must not pay for importing torch
LATEST = "latest"


def _step_dir(run_dir: str, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def save(run_dir: str, step: int, rank: int, stages: dict, meta: dict) -> None:
    import torch
    import torch.distributed as dist

    d = _step_dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "meta": meta,
        "stages": {f"{pipe}:{stage}": st.module.state_dict() for (pipe, stage), st in stages.items()},
        # a replica without optimizer state (a non-owner under schedule.zero) saves none
        "optimizers": {f"{pipe}:{stage}": st.optimizer.state_dict() for (pipe, stage), st in stages.items()
                       if st.optimizer is not None},
    }
    # asynchronous schedules: the weight versions still needed after this flush (2BW's
    # previous version), so a resumed run computes with exactly the same weights
    versions = {f"{pipe}:{stage}": {"live": st.versions.live, "stash": st.versions.stash}
                for (pipe, stage), st in stages.items() if getattr(st, "versions", None) is not None}
    if versions:
        state["versions"] = versions
    tmp = d / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (Path(run_dir) / "checkpoints" / LATEST).write_text(f"{step}\n")


def resolve(resume: str) -> tuple[Path, int]:
    """``resume`` is a run directory (its latest checkpoint) or one ``checkpoints/step_N``
    folder; return that step's folder and the step."""
    path = Path(resume)
    if path.name.startswith("step_") and path.is_dir():
        return path, int(path.name.split("_", 1)[1])
    marker = path / "checkpoints" / LATEST
    if not marker.exists():
        raise FileNotFoundError(
            f"resume={resume}: no finished checkpoint there (checkpoints/{LATEST} is missing); "
            f"give a run directory that saved one, or one of its checkpoints/step_N folders"
        )
    step = int(marker.read_text().strip())
    return _step_dir(str(path), step), step


def load(resume: str, rank: int, stages: dict, meta: dict) -> int:
    """Load this rank's state from the checkpoint ``resume`` names; return its step."""
    import torch

    folder, step = resolve(resume)
    state = torch.load(folder / f"rank{rank}.pt", map_location="cpu", weights_only=False)
    saved = state["meta"]
    for key in ("schedule", "stages", "world_size", "layers_per_stage", "placement"):
        if saved.get(key) != meta.get(key):
            raise ValueError(
                f"resume={resume}: the checkpoint was written with {key}={saved.get(key)}, "
                f"this run has {key}={meta.get(key)}; resume with the same pipeline configuration"
            )
    for (pipe, stage), st in stages.items():
        st.module.load_state_dict(state["stages"][f"{pipe}:{stage}"])
        if st.optimizer is not None:
            st.optimizer.load_state_dict(state["optimizers"][f"{pipe}:{stage}"])
        saved_versions = state.get("versions", {}).get(f"{pipe}:{stage}")
        if saved_versions is not None and getattr(st, "versions", None) is not None:
            st.versions.live = saved_versions["live"]
            st.versions.stash = dict(saved_versions["stash"])
    return step
