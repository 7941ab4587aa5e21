"""The analytic cost fitted to this host for searches over local CPU ranks: from calibrations of one model
(``python -m pipeflow.calibrate``), the host's keys, one FLOP rate, the optimizer step's bandwidth and
the all-reduce rate, as ``local_cpu`` topology keys (:func:`fitted_host`; docs/planning.md, "CPU ranks")."""

from __future__ import annotations

import statistics

from ..cost import AnalyticCost
from ..machine_cost import HOST_KEYS, load_calibration
from ..model_state import gradient_bytes, step_bytes
from ..transformer import TransformerSpec, shared_head_params


def fitted_host(paths: str | list[str], spec: TransformerSpec, efficiency: float, dtype_bytes: int) -> dict:
    """``local_cpu`` keys (``cores``, ``contention``, ``latency``, ``bandwidth``, ``message_host``,
    ``peak_flops``, ``memory_bandwidth``, ``collective_bandwidth``) fitted to the calibrations at
    ``paths`` of model ``spec`` (host keys: their medians). ValueError naming ``search.calibration``."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise ValueError("search.calibration=[]: give a calibration.json, or several")
    fits = [_points(p, spec, dtype_bytes) for p in paths]
    flops_time = [x for f in fits for x in f[0]]
    steps = [x for f in fits for x in f[1]]
    hosts = [f[2] for f in fits]
    # least squares of t = f / rate: 1 / rate = sum(f t) / sum(f^2)
    inv = sum(f * t for f, t in flops_time) / sum(f * f for f, _ in flops_time)
    host = {k: statistics.median(h[k] for h in hosts) for k in HOST_KEYS if all(k in h for h in hosts)}
    if "cores" in host:
        host["cores"] = int(round(host["cores"]))
    host["peak_flops"] = 1.0 / inv / efficiency  # the analytic cost divides by peak x efficiency
    if steps:  # the optimizer step: t = params x bytes per param / bandwidth (AnalyticCost's model)
        host["memory_bandwidth"] = sum(b * b for b, _ in steps) / sum(b * t for b, t in steps)
    rates = [f[3] for f in fits if f[3] is not None]
    # (the rate the step's own synchronisation reached at this model's tied embedding, where
    # it has one, over the calibration's all-reduce of 1 and 8 MiB between otherwise idle
    # ranks: 0.18 GB/s for GPT-2 small's 154 MB in its step, 0.5-0.8 GB/s idle at 1-128 MiB)
    if rates:
        host["collective_bandwidth"] = statistics.median(rates)
    return host


def _points(path: str, spec: TransformerSpec, dtype_bytes: int) -> tuple[list, list, dict, float | None]:
    """Of one calibration file: (FLOPs, seconds) of each F, B, I, W; (bytes, seconds) of each step; the host
    keys; the step synchronisation's all-reduce rate (None without a tied embedding). ValueError for
    another model or a segmented calibration."""
    key = "search.calibration"
    data = load_calibration(path, key=key)
    conf = data["config"]
    if conf.get("model") != spec.name:
        raise ValueError(f"{key}={path}: it calibrated model '{conf.get('model')}', the search prices "
                         f"'{spec.name}'; calibrate a configuration of this model")
    layers = [int(n) for n in conf["layers_per_stage"]]
    if sum(layers) != spec.n_layer or int(conf.get("segments", 1)) != 1:
        raise ValueError(f"{key}={path}: calibrate whole sequences of this model ({spec.n_layer} layers, "
                         f"pipeline.segments=1)")
    cost = AnalyticCost(spec, len(layers), microbatch_size=int(conf["microbatch_size"]), efficiency=1.0,
                        dtype_bytes=dtype_bytes, layers_per_stage=layers)
    flops_time = [(cost.flops(kind, stage, 0), float(t)) for k, t in data["times"].items()
                  for kind, stage, _ in [k.split("|")] if kind in "FBIW" for stage in [int(stage)]]
    if not flops_time:
        raise ValueError(f"{key}={path}: it has no forward or backward times")
    steps = [(step_bytes(cost.stage_params(int(k.split("|")[1])), dtype_bytes), float(t))
             for k, t in data["times"].items() if k.startswith("S|") and float(t) > 0]
    # the step's synchronisation: a tied embedding's fp32 gradient all-reduced over the
    # first and the last stage's ranks (a ring of 2), at the collective rate this host reaches
    rate = None
    sync, world = float(data.get("sync_s", 0.0)), int(conf.get("world_size", 1))
    lat = float(data["host"].get("latency", 0.0))
    if spec.tied and len(layers) > 1 and world > 1 and sync > 2 * lat:
        rate = gradient_bytes(shared_head_params(spec)) / (sync - 2 * lat)
    return flops_time, steps, {k: float(data["host"][k]) for k in HOST_KEYS if k in data["host"]}, rate
