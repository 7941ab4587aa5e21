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

:func:`verify` reads a checkpoint without torch, so the trainer refuses a missing,
incomplete, cut-short or mismatched one before any rank starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# torch is imported where it is used: the trainer's up-front config check calls
# resolve() and verify() before any rank exists and must not pay for importing torch
LATEST = "latest"
META = "meta.json"


def _step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


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


def resolve(resume: str) -> tuple[Path, int]:
    """``resume`` is a run directory (its latest checkpoint) or one ``checkpoints/step_N``
    folder; return that step's folder and the step."""
    path = Path(resume)
    if path.name.startswith("step_") and path.is_dir():
        try:
            return path, int(path.name.split("_", 1)[1])
        except ValueError:
            raise ValueError(f"resume={resume}: not a checkpoint folder (step_<N>)") from None
    marker = path / "checkpoints" / LATEST
    if not marker.exists():
        raise FileNotFoundError(
            f"resume={resume}: no finished checkpoint there (checkpoints/{LATEST} is missing); "
            f"give a run directory that saved one, or one of its checkpoints/step_N folders"
        )
    try:
        step = int(marker.read_text().strip())
    except ValueError:
        raise ValueError(f"resume={resume}: checkpoints/{LATEST} is not a step number (cut short?)") from None
    return _step_dir(str(path), step), step


def read_meta(folder: Path, resume: str) -> dict:
    try:
        return json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise ValueError(f"resume={resume}: {folder} is incomplete (no {META}: the run stopped while saving it); "
                         f"give an earlier checkpoints/step_N folder") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"resume={resume}: {folder / META} cannot be read ({err})") from None


def verify(resume: str, expect: dict) -> tuple[Path, dict]:
    """Check, without torch, that the checkpoint ``resume`` names is whole and was
    written for the pipeline ``expect`` describes (any of schedule, stages, world_size,
    placement, layers_per_stage); return its folder and meta record. Raises ValueError
    naming ``resume`` and what is wrong."""
    folder, step = resolve(resume)
    record = read_meta(folder, resume)
    for name, size in record["files"].items():
        path = folder / name
        if not path.exists():
            raise ValueError(f"resume={resume}: {path} is missing; the checkpoint is incomplete")
        if path.stat().st_size != size:
            raise ValueError(f"resume={resume}: {path} has {path.stat().st_size} bytes where {size} were written "
                             f"(cut short or changed since)")
    saved = record["meta"]
    for key, value in expect.items():
        if key in saved and saved[key] != value:
            raise ValueError(f"resume={resume}: the checkpoint was written with {key}={saved[key]}, this run has "
                             f"{key}={value}; resume with the same pipeline configuration")
    start = int(record.get("chunk_start", step))
    if 0 < start < step:  # a run that ended inside a chunk: it restarts from the chunk's start
        begin = _step_dir(folder.parent.parent, start)
        if not begin.is_dir():
            raise ValueError(f"resume={resume}: the run ended inside a chunk of its asynchronous schedule, which "
                             f"a resumed run restarts from the checkpoint where the chunk began, and {begin} "
                             f"is missing")
        try:
            verify(str(begin), expect)
        except ValueError as err:
            raise ValueError(f"resume={resume}: the checkpoint where its last chunk began is not usable: "
                             f"{str(err).split(': ', 1)[-1]}") from None
    return folder, record


def load(resume: str, rank: int, stages: dict, meta: dict, step: int | None = None, scaler=None) -> int:
    """Load this rank's state from the checkpoint ``resume`` names (or, given ``step``,
    from the same run's checkpoint at that step), fp16's loss scale into ``scaler``; return its step."""
    import torch

    folder, found = resolve(resume)
    if step is not None and step != found:
        folder, found = _step_dir(folder.parent.parent, step), step
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
    if scaler is not None and "loss_scaler" in state:
        scaler.load_state_dict(state["loss_scaler"])
    return found
