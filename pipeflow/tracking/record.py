"""One summary record for every app: what summary.json holds in common, and the ``run_key``
(:data:`KEY_FIELDS`) that every writer puts in it: the configuration a measured run and its
simulation must share to be compared. pipeflow-compare pairs by it. Torch- and Hydra-free."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeflow.formats.files import write_aside

# The configuration key: a simulated run predicts a measured one when all of these agree.
KEY_FIELDS = ("schedule", "stages", "microbatches", "virtual_stages", "segments", "microbatch_size", "model",
              "attention", "precision", "recompute", "partition", "data_parallel", "shard", "topology")

# How a field reads in a sentence, where its name alone would not say it
_SPOKEN = {"microbatch_size": "microbatch size", "virtual_stages": "virtual stages", "data_parallel":
           "data-parallel replicas", "recompute": "recomputation", "shard": "sharding"}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _tensor(pipe) -> str | int:
    t = _int(_get(pipe, "tensor_parallel", 1))
    return f"{t}+sp" if t and t > 1 and _get(pipe, "sequence_parallel", False) else t


def run_key(cfg: Mapping, *, schedule: str | None = None, stages: int | None = None,
            data_parallel: int | None = None, partition: str | None = None) -> dict:
    """The key of the run a composed config (any app's) describes; keyword arguments: what the
    run decided beyond its config (a plan's stages, replicas, schedule). ``precision`` must be
    resolved already (:func:`pipeflow.config.resolve_precision`)."""
    pipe, model = _get(cfg, "pipeline", {}), _get(cfg, "model", {})
    cut = partition or _get(_get(cfg, "partition", {}), "name", "uniform")
    return {
        "schedule": schedule or _get(_get(cfg, "schedule", {}), "name"),
        "stages": _int(stages if stages is not None else _get(pipe, "stages")),
        "microbatches": _int(_get(pipe, "microbatches")),
        "virtual_stages": _int(_get(pipe, "virtual_stages", 1)),
        "segments": _int(_get(pipe, "segments", 1)),
        "microbatch_size": _int(_get(pipe, "microbatch_size")),
        "model": _get(model, "name"),
        "attention": _get(model, "attention", "sdpa"),
        "precision": _get(cfg, "precision"),
        "recompute": _get(model, "recompute", "none"),
        # the planner's cut is schedule=planned's own: it counts as the uniform one
        "partition": "uniform" if cut == "planner" else cut,
        "data_parallel": _int(data_parallel if data_parallel is not None else _get(pipe, "data_parallel", 1)),
        # what the replicas shard (full: and when they gather, "full/step")
        "shard": _shard(pipe),
        # each device split across tensor-parallel ranks (sequence parallel: "2+sp")
        "tensor_parallel": _tensor(pipe),
        "topology": _get(_get(cfg, "topology", {}), "name"),
    }


def _shard(pipe) -> str:
    shard = _get(pipe, "shard", "none") or "none"
    return f"full/{_get(pipe, 'gather', 'step') or 'step'}" if shard == "full" else shard


def key_tuple(key: Mapping) -> tuple:
    return tuple(key.get(f) for f in KEY_FIELDS)


def differences(a: Mapping, b: Mapping) -> list[str]:
    """The fields on which keys ``a`` and ``b`` differ, in :data:`KEY_FIELDS` order."""
    return [f for f in KEY_FIELDS if a.get(f) != b.get(f)]


def why_unpaired(key: Mapping, others: list[Mapping]) -> str:
    """Why a run with ``key`` has no partner among runs with keys ``others``: the nearest
    one's differing fields, each with both values ("precision bf16, not fp32")."""
    if not others:
        return "no simulated run to pair with"
    nearest = min(others, key=lambda o: len(differences(key, o)))
    parts = [f"{_SPOKEN.get(f, f)} {nearest.get(f)}, not {key.get(f)}" for f in differences(key, nearest)]
    return "the nearest simulation differs in " + "; ".join(parts)


def write_summary(run_dir: str | os.PathLike, summary: Mapping, key: Mapping | None = None,
                  default=str) -> Path:
    """Write run_dir/summary.json whole (every app's summary goes through here), with ``key`` as
    its ``run_key`` when given; ``default``: how a value JSON has no type for is written."""
    record = dict(summary)
    if key is not None:
        record["run_key"] = dict(key)
    return write_whole(Path(run_dir) / "summary.json", record, default)


def strict(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, infinity) as None: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def write_whole(path: Path, record: Mapping, default=str) -> Path:
    """Write ``record`` as JSON whole or not at all (:func:`pipeflow.formats.files.write_aside`:
    a full disk leaves no empty or cut-short file behind; WriteFailed names the file)."""
    return write_aside(path, json.dumps(strict(dict(record)), indent=2, default=default) + "\n")
