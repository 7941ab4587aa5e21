"""A device profile from an operator sweep's JSON (:mod:`pipeflow.topology.op_sweep`'s format):
:func:`from_sweep` fits it, :func:`load_profile` reads a file once per process;
:class:`~pipeflow.planning.device_profile.ProfileError` names a file that cannot price a step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..topology.elementwise_kernels import ELEMENTWISE
from .device_profile import DeviceProfile, ProfileError, aligned
from .operators import CLASSES, Attention
from .profile_fits import Table, fit_memory_bound, fit_step

_DTYPES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}
_LONGER = " (a longer --budget-s if its sections were cut short or skipped)"


def _rows(sweep: dict, name: str) -> list[dict]:
    sec = sweep.get("sections", {}).get(name) or {}
    return [r for r in sec.get("rows", []) if isinstance(r, dict) and "error" not in r]


def _products(sweep: dict) -> dict:
    grouped: dict = {}
    for section, default in (("gemm_bf16", 2), ("gemm_fp32_grid", 4)):
        for r in _rows(sweep, section):
            dtype = _DTYPES.get(str(r.get("dtype")), default)
            for phase in ("fwd", "dgrad", "wgrad"):
                if r.get(f"{phase}_s"):
                    key = (dtype, phase, aligned(r["k"], r["n"], dtype))
                    grouped.setdefault(key, []).append((r["m"], r["k"], r["n"], r[f"{phase}_s"]))
    if not any(d == 4 for d, _, _ in grouped):  # a GPU sweep's fp32 products: forward only, every phase alike
        for r in _rows(sweep, "gemm_fp32"):
            if r.get("precision", "highest") == "highest":
                for phase in ("fwd", "dgrad", "wgrad"):
                    key = (4, phase, aligned(r["k"], r["n"], 4))
                    grouped.setdefault(key, []).append((r["m"], r["k"], r["n"], r["s"]))
    out = {}
    for key, rows in grouped.items():
        a = np.array(rows, float)
        out[key] = (Table(np.log(a[:, :3]), 2 * a[:, 0] * a[:, 1] * a[:, 2] / a[:, 3]), int(a[:, 0].min()))
    return out


def _backward(r: dict, serial_call: float) -> float:
    """A row's backward seconds: forward and backward less the forward, and on a CPU less the backward
    pass's start (priced once per action)."""
    return r["fwd_bwd_s"] - r["fwd_s"] - serial_call


def _attention(sweep: dict, serial_call: float) -> dict:
    grouped: dict = {}
    for r in _rows(sweep, "sdpa_bf16"):
        dtype = _DTYPES.get(str(r.get("dtype", "bfloat16")), 2)
        op = Attention("fwd", r["b"] * r["h"], r["s"], r["s"], r["d"], bool(r["causal"]), dtype)
        bwd = _backward(r, serial_call)
        for phase, flops, s in (("fwd", op.flops, r["fwd_s"]), ("bwd", 2.5 * op.flops, bwd)):
            if s > 0:
                grouped.setdefault((dtype, r["d"], bool(r["causal"]), phase), []).append(
                    (math.log(r["s"]), math.log(r["h"]), flops / s))
    return {k: Table(np.array(v)[:, :2], np.array(v)[:, 2]) for k, v in grouped.items()}


def _pointwise(sweep: dict, kernel_s: float | None, serial_call: float) -> dict:
    grouped: dict = {}
    for r in _rows(sweep, "elementwise"):
        dtype = _DTYPES.get(str(r["dtype"]), 4)
        n = r["rows"] * r["hidden"]
        grouped.setdefault((r["op"], dtype, "fwd"), []).append((n, r["fwd_s"]))
        if r.get("fwd_bwd_s") and _backward(r, serial_call) > 0:
            grouped.setdefault((r["op"], dtype, "bwd"), []).append((n, _backward(r, serial_call)))
    out = {}
    for (op, dtype, phase), rows in grouped.items():
        if len(rows) >= 2:
            launches = ELEMENTWISE[op].launches[phase == "bwd"] if op in ELEMENTWISE else 1
            out[(op, dtype, phase)] = fit_memory_bound(rows, None if kernel_s is None else launches * kernel_s)
    return out


def _loss(sweep: dict, kernel_s: float | None, serial_call: float) -> dict:
    grouped: dict = {}
    for r in _rows(sweep, "cross_entropy"):
        dtype = _DTYPES.get(str(r["dtype"]), 4)
        n = r["tokens"] * r["vocab"]
        grouped.setdefault((dtype, "fwd"), []).append((n, r["fwd_s"]))
        if _backward(r, serial_call) > 0:
            grouped.setdefault((dtype, "bwd"), []).append((n, _backward(r, serial_call)))
    # (its forward: a log-softmax and a gather, reduced; its backward about as many)
    return {k: fit_memory_bound(v, None if kernel_s is None else 3 * kernel_s)
            for k, v in grouped.items() if len(v) >= 2}


def _host(sweep: dict, source: str) -> tuple[float, float, float | None]:
    """The host's seconds per launch and per backward pass, the device's per kernel (None on a CPU)."""
    launches = [r["s_per_call_async"] for r in _rows(sweep, "launch")
                if r.get("op") == "add_out_tiny" and "s_per_call_async" in r]
    if not launches:
        raise ProfileError(f"{source}: the sweep has no launch rows (section launch), so the host's cost per kernel "
                           f"is unknown; measure again with python -m pipeflow.measure_device --out FILE{_LONGER}")
    launch = float(np.median(launches))
    adds = [r["fwd_bwd_s"] - r["fwd_s"] for r in _rows(sweep, "elementwise") if r["op"] == "add" and r.get("fwd_bwd_s")]
    backward = max(min(adds), 0.0) if adds else 0.0
    graphs = {r["op"]: r["events"]["s"] for r in _rows(sweep, "launch")
              if str(r.get("op", "")).startswith("cuda_graph_replay") and "events" in r}
    kernel = None
    if sweep.get("device") == "cuda":
        full, empty = graphs.get("cuda_graph_replay_100_kernels"), graphs.get("cuda_graph_replay_0_kernels", 0.0)
        kernel = (full - empty) / 100 if full else launch / 4
    return launch, backward, kernel


def _block_host(sweep: dict, launch: float, backward_call: float) -> dict:
    """Per (family, kind): a block's tiny measured time less its launches and backward start."""
    out: dict = {}
    for r in _rows(sweep, "blocks"):
        for kind in "FBIW":
            t = r[f"{kind}_s"] - r["kernels"][kind] * launch - (backward_call if kind in "BI" else 0.0)
            out[(r["family"], kind)] = max(t, 0.0)
    return out


def _sync_hop(row: dict, host: dict) -> float | None:
    """Fixed seconds per ring hop of the reference step's synchronisation; None where not recorded."""
    coll = row.get("sync_collectives")
    if not coll or row.get("sync_s") is None:
        return None
    rate = float(host.get("collective_bandwidth") or 0.0)
    moved = sum((n - 1) / n * b / rate for b, n in coll if n > 1) if rate > 0 else 0.0
    hops = sum(n - 1 for _, n in coll if n > 1)
    return max(float(row["sync_s"]) - moved, 0.0) / hops if hops else None


def from_sweep(sweep: dict, name: str, source: str = "") -> DeviceProfile:
    """A profile from a sweep's JSON (the format :mod:`pipeflow.topology.op_sweep` writes)."""
    if not isinstance(sweep, dict) or "sections" not in sweep:
        raise ProfileError(f"{source or name}: not an operator sweep (no 'sections'; made by "
                           f"python -m pipeflow.measure_device --out FILE)")
    launch, backward, kernel = _host(sweep, source or name)
    serial = backward if kernel is None else 0.0
    adamw = _rows(sweep, "adamw")
    prof = DeviceProfile(name, source or name, launch, backward, kernel, _products(sweep), _attention(sweep, serial),
                         _pointwise(sweep, kernel, serial), _loss(sweep, kernel, serial),
                         {impl: fit_step([r for r in adamw if r["impl"] == impl]) for impl in {r["impl"] for r in adamw}},
                         {k: sweep[k] for k in ("device", "gpu", "torch", "host", "cpu_isa") if k in sweep})
    prof.block_host = _block_host(sweep, launch, backward)
    pipeline = _rows(sweep, "pipeline")
    if pipeline:
        prof.in_step = {k: float(v) for k, v in pipeline[-1].get("in_step", {}).items()}
        prof.host = dict(pipeline[-1].get("host", {}))
        prof.sync_hop_s = _sync_hop(pipeline[-1], prof.host)
    fixes = (sweep.get("corrections") or {}).get("classes", {})
    bad = {c: f for c, f in fixes.items() if c not in CLASSES or not isinstance(f, (int, float)) or not f > 0}
    if bad:
        raise ProfileError(f"{source or name}: corrections {bad}: each a class of {', '.join(CLASSES)} "
                           f"and a factor > 0 (python -m pipeflow.fold_trace --out writes them)")
    prof.corrections = {c: float(f) for c, f in fixes.items()}
    posting = (sweep.get("corrections") or {}).get("message_host")
    if posting is not None:  # a run's own seconds per message posted (fold_trace), over the reference's
        if not isinstance(posting, (int, float)) or not posting > 0 or not prof.host:
            raise ProfileError(f"{source or name}: corrections message_host={posting!r}: seconds > 0, for a "
                               f"profile whose section pipeline calibrated a host")
        prof.host["message_host"] = float(posting)
    norms = [{**r, "s": r["s"] + r.get("scale_s", 0.0)} for r in _rows(sweep, "grad_norm")]
    prof.grad_norm = fit_step(norms) if len(norms) >= 3 else None
    missing = [what for what, got in (("products", prof.products), ("attention", prof.attention),  # (every model's)
                                      ("pointwise", prof.pointwise), ("cross_entropy", prof.loss),
                                      ("adamw", prof.step)) if not got]
    if missing:
        raise ProfileError(f"{source or name}: the sweep has no rows for {', '.join(missing)}; measure again "
                           f"with python -m pipeflow.measure_device --out FILE{_LONGER}")
    return prof


_LOADED: dict[tuple, DeviceProfile] = {}


def load_profile(path: str | Path, name: str | None = None) -> DeviceProfile:
    """The profile in ``path`` (a sweep's JSON), read once per process."""
    p = Path(path)
    try:  # a file measured again (or written section by section) is read again
        stat = p.stat()
        key = (str(p.resolve()), stat.st_mtime_ns, stat.st_size)
    except OSError:
        key = (str(p.resolve()), 0, 0)
    if key not in _LOADED:
        if not p.is_file():
            raise ProfileError(f"topology.device_profile={path}: no such file (make one with "
                               f"python -m pipeflow.measure_device --out {path})")
        try:
            sweep = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"topology.device_profile={path}: not readable JSON ({e})") from None
        try:
            _LOADED[key] = from_sweep(sweep, name or p.stem, str(path))
        except ProfileError as e:  # (the key as well as the file: from_sweep names the file)
            raise ProfileError(f"topology.device_profile={e}" if str(e).startswith(f"{path}:") else str(e)) from None
    return _LOADED[key]
