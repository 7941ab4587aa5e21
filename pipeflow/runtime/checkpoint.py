"""Checkpoints: each rank saves its own stages and optimizer state; rank 0 then writes
the folder's ``meta.json`` (the step, the pipeline it was written for, and every rank
file's size) and moves ``latest`` to it. A resumed run recomputes the batch of any step
from (seed, step) and the learning rate from the step, so it continues exactly where the
uninterrupted run would have been.

Asynchronous schedules run in chunks of ``schedule.windows`` steps without a flush, on a
fixed grid (steps 1..W, W+1..2W, ...), and checkpoint only where a chunk ends, so
turning checkpoints on does not change the training. A run whose last step falls
inside a chunk flushes there; its checkpoint records where that chunk began
(``chunk_start``), and a run resumed from it restarts the chunk from the checkpoint
written there (or from the initial weights) and replays the steps up to the checkpoint
unlogged, as the uninterrupted run computed them.

:func:`verify` (:mod:`pipeflow.formats.checkpoint`) reads a checkpoint without torch, so
the trainer refuses a missing, incomplete, cut-short or mismatched one before any rank starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# the checkpoint folder's layout and its torch-free reading (the up-front check's)
from ..formats.checkpoint import LATEST, META, read_meta, resolve, verify  # noqa: F401 - re-exported
from ..formats.checkpoint import step_dir as _step_dir
from .sharded import whole_weights

# torch is imported where it is used


class CheckpointError(OSError):
    """A checkpoint that cannot be written or read, in one sentence naming the path."""


def _write(path: Path, write) -> None:
    """Write ``path`` through ``write(file)`` to a temporary name, then rename: a full
    disk or a crash leaves no cut-short file under the real name."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write the checkpoint file {path}: {err.strerror or err}") from None


def save(run_dir: str, step: int, rank: int, stages: dict, meta: dict, chunk_start: int | None = None,
         scaler=None) -> None:
    """Write this rank's checkpoint of ``step`` (fully sharded stages: their weights
    gathered while it is written, so the module's state is whole)."""
    with whole_weights(stages):
        _save(run_dir, step, rank, stages, meta, chunk_start, scaler)


def _save(run_dir: str, step: int, rank: int, stages: dict, meta: dict, chunk_start: int | None = None,
          scaler=None) -> None:
    """Save this rank's state at ``step``; ``chunk_start``: the step the chunk that ended
    here began after, when that is not ``step`` itself (a run that ended inside a chunk);
    ``scaler``: fp16's loss scaler, whose scale a resumed run goes on with."""
    import torch
    import torch.distributed as dist

    d = _step_dir(run_dir, step)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"could not create the checkpoint folder {d}: {err.strerror or err}") from None
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
    if scaler is not None:
        state["loss_scaler"] = scaler.state_dict()
    path = d / f"rank{rank}.pt"
    _write(path, lambda f: torch.save(state, f))
    sizes = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(path.stat().st_size, sizes, dst=0)
    if rank == 0:
        record = {"step": step, "chunk_start": step if chunk_start is None else chunk_start,
                  "world_size": len(sizes), "meta": meta,
                  "files": {f"rank{r}.pt": size for r, size in enumerate(sizes)}}
        _write(d / META, lambda f: f.write((json.dumps(record, indent=2) + "\n").encode()))
        _write(Path(run_dir) / "checkpoints" / LATEST, lambda f: f.write(f"{step}\n".encode()))


def load(resume: str, rank: int, stages: dict, meta: dict, step: int | None = None, scaler=None) -> int:
    """Load this rank's checkpoint into ``stages`` (fully sharded stages: into their
    gathered weights, whose shares the optimizer then takes); returns its step."""
    with whole_weights(stages):
        return _load(resume, rank, stages, meta, step, scaler)


def _load(resume: str, rank: int, stages: dict, meta: dict, step: int | None = None, scaler=None) -> int:
    """Load this rank's state from the checkpoint ``resume`` names (or, given ``step``,
    from the same run's checkpoint at that step), fp16's loss scale into ``scaler``; return its step."""
    import torch

    folder, found = resolve(resume)
    if step is not None and step != found:
        folder, found = _step_dir(folder.parent.parent, step), step
    state = torch.load(folder / f"rank{rank}.pt", map_location="cpu", weights_only=False)
    saved = state["meta"]
    for key in ("schedule", "stages", "world_size", "layers_per_stage", "placement", "shard"):
        if saved.get(key, "none" if key == "shard" else None) != meta.get(key):  # (shard: unsharded before it was recorded)
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
    if scaler is not None and "loss_scaler" in state:
        scaler.load_state_dict(state["loss_scaler"])
    return found
