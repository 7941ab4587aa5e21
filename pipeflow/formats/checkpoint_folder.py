"""A checkpoint folder's layout and its torch-free reading: the up-front check refuses a
missing, incomplete or mismatched checkpoint before any rank starts, and the runtime
(:mod:`pipeflow.runtime.checkpoint`) reads it the same way."""

from __future__ import annotations

import json
from pathlib import Path

LATEST = "latest"
META = "meta.json"


# what a model's parameters are shaped by: a checkpoint of another shape cannot be loaded
MODEL_SHAPE = ("family", "n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "n_inner", "vocab_size",
               "n_positions", "mlp", "norm", "tied", "positions", "qkv_bias", "o_bias", "mlp_bias",
               "interaction_layers")
BRANCH_SHAPE = ("n_layer", "n_embd", "n_head", "vocab_size", "image_size", "patch_size", "channels")
# what a run may change on resuming (said, not refused): the same weights train on
TRAINING = {"precision": ("precision",), "model.recompute": ("model", "recompute"),
            "model.vocab_multiple": ("model", "vocab_multiple"),
            "pipeline.microbatches": ("pipeline", "microbatches"),
            "pipeline.microbatch_size": ("pipeline", "microbatch_size"), "seed": ("seed",)}
# what shapes a batch and where it comes from: also said, with what it changes
BATCH = {"model.seq_len": ("model", "seq_len"), "model.text.seq_len": ("model", "text", "seq_len"),
         "data.name": ("data", "name"), "data.files": ("data", "files"), "data.tokenizer": ("data", "tokenizer"),
         "data.max_bytes": ("data", "max_bytes"), "model.n_positions": ("model", "n_positions")}


def model_record(model) -> dict:
    """The model a checkpoint holds, as its meta records it: its name and what shapes its
    parameters (a concurrent-branch model's branches too)."""
    out = {"name": model.get("name")}
    for key in MODEL_SHAPE:
        if model.get(key) is not None:
            out[key] = model.get(key)
    for branch in ("text", "vision"):
        if model.get(branch) is not None:
            out[branch] = {k: model[branch].get(k) for k in BRANCH_SHAPE if model[branch].get(k) is not None}
    return out


def training_record(cfg) -> dict:
    """The settings a resumed run may change (:data:`TRAINING`, :data:`BATCH`), as the
    checkpoint records them (plain values: a list of files as a list)."""
    from omegaconf import OmegaConf

    out = {}
    for key, path in {**TRAINING, **BATCH}.items():
        value = cfg
        for part in path:
            value = value.get(part) if hasattr(value, "get") else None
        out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def model_difference(saved: dict, here: dict) -> str | None:
    """None, or what differs between the model a checkpoint holds and this run's."""
    keys = [k for k in (*MODEL_SHAPE, "text", "vision") if saved.get(k) != here.get(k) and (k in saved or k in here)]
    if saved.get("positions") == here.get("positions") == "rotary" and "n_positions" in keys:
        keys.remove("n_positions")  # rotary positions have no table: the longest sequence is no weight's shape
    if not keys:
        return None
    if keys == ["n_positions"]:  # a learned table (GPT, BERT, GPT-2): its rows are the positions
        old = saved.get("n_positions")
        return (f"the checkpoint's position table holds {old} positions (model.n_positions={old}), this run's "
                f"{here.get('n_positions')}, and a table loads only at its own size; resume with "
                f"model.n_positions={old} and a model.seq_len of at most {old}")
    def said(v):
        return "unset" if v is None else v

    shown = ", ".join(f"{k} {said(saved.get(k))} there, {said(here.get(k))} here" for k in keys[:4])
    return (f"the checkpoint holds model {saved.get('name')}, this run builds {here.get('name')} ({shown}); "
            f"resume with model={saved.get('name')} and its shape")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def resolve(resume: str, said: str | None = None) -> tuple[Path, int]:
    """``resume`` is a run directory (its latest checkpoint) or one ``checkpoints/step_N``
    folder; return that step's folder and the step. ``said``: how errors name it
    (``resume=<resume>``)."""
    said = said or f"resume={resume}"
    path = Path(resume)
    if path.name.startswith("step_") and path.is_dir():
        try:
            return path, int(path.name.split("_", 1)[1])
        except ValueError:
            raise ValueError(f"{said}: not a checkpoint folder (step_<N>)") from None
    marker = path / "checkpoints" / LATEST
    if not marker.exists():
        raise FileNotFoundError(
            f"{said}: no finished checkpoint there (checkpoints/{LATEST} is missing); "
            f"give a run directory that saved one, or one of its checkpoints/step_N folders"
        )
    try:
        step = int(marker.read_text().strip())
    except ValueError:
        raise ValueError(f"{said}: checkpoints/{LATEST} is not a step number (cut short?)") from None
    folder = step_dir(str(path), step)
    if not folder.is_dir():  # removed since (by hand, or a disk cleaned up)
        others = sorted(p.name for p in (path / "checkpoints").glob("step_*") if p.is_dir())
        raise FileNotFoundError(
            f"{said}: checkpoints/{LATEST} names step {step}, whose folder {folder} is missing; give one of its "
            + (f"checkpoints/step_N folders ({', '.join(others)})" if others else "checkpoints/step_N folders "
               "(there are none: the run has no checkpoint left)"))
    return folder, step


def read_meta(folder: Path, resume: str, said: str | None = None) -> dict:
    said = said or f"resume={resume}"
    try:
        return json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise ValueError(f"{said}: {folder} is incomplete (no {META}: the run stopped while saving it); "
                         f"give an earlier checkpoints/step_N folder") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{said}: {folder / META} cannot be read ({err})") from None


def whole(checkpoint: str, said: str | None = None) -> tuple[Path, dict]:
    """The folder and meta record of the checkpoint ``checkpoint`` names (:func:`resolve`),
    checked without torch to be whole (its record and every rank's file at the size written).
    ValueError (FileNotFoundError) starting with ``said`` and saying what is wrong."""
    said = said or f"resume={checkpoint}"
    folder, _ = resolve(checkpoint, said)
    record = read_meta(folder, checkpoint, said)
    for name, size in record["files"].items():
        path = folder / name
        if not path.exists():
            raise ValueError(f"{said}: {path} is missing; the checkpoint is incomplete")
        if path.stat().st_size != size:
            raise ValueError(f"{said}: {path} has {path.stat().st_size} bytes where {size} were written "
                             f"(cut short or changed since)")
    return folder, record


def restart_step(record: dict, steps: int) -> int:
    """The step after which a run resumed from the checkpoint ``record`` and trained to ``steps``
    starts its first chunk: the checkpoint's, or the start of the asynchronous chunk it ended
    inside."""
    step = int(record["step"])
    start = int(record.get("chunk_start", step))
    return start if start < step < steps else step


def verify(resume: str, expect: dict) -> tuple[Path, dict]:
    """Check, without torch, that the checkpoint ``resume`` names is whole and holds the model
    ``expect`` describes; return its folder and meta record. ValueError naming ``resume`` and
    what is wrong."""
    folder, record = whole(resume)
    step = int(record["step"])
    saved = record["meta"]
    movable = int(record.get("format", 1)) >= 2  # saved by name, whole: any layout loads it
    for key, value in expect.items():
        if movable and key != "model":
            continue
        if key == "model" and key in saved:
            differs = model_difference(saved[key], value)
            if differs:
                raise ValueError(f"resume={resume}: {differs}")
        elif key in saved and saved[key] != value:
            raise ValueError(f"resume={resume}: the checkpoint (of the earlier format, which holds each rank's "
                             f"stages as its layout cut them) was written with {key}={saved[key]}, this run has "
                             f"{key}={value}; resume it with the same pipeline configuration")
    start = int(record.get("chunk_start", step))
    if 0 < start < step:  # a run that ended inside a chunk: it restarts from the chunk's start
        begin = step_dir(folder.parent.parent, start)
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
