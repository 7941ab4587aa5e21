"""The calibration's fits (:mod:`pipeflow.runtime.calibration_run`): the link's latency and
bandwidth, each action's time from its ranks' measurements, and the host's sharing of
its cores (``cores``, ``contention``) in the simulator's rate model."""

from __future__ import annotations

import math
import os
import statistics


def _fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of time = latency + bytes / bandwidth over (bytes, seconds) points."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx if sxx > 0 else 0.0
    slope = max(slope, 1e-15)
    latency = max(0.0, my - slope * mx)
    return latency, 1.0 / slope


def _host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _device_times(per_rank: list[dict], tensor: int) -> dict[str, float]:
    """Each (kind, stage, segment)'s seconds: the median over a device's T tensor ranks, then
    over the stage's replicas. The median, not the max: a rank early at a collective waits
    there for a partner whose previous action already counts that time."""
    times: dict[str, list[float]] = {}
    for d in range(0, len(per_rank), tensor):
        group: dict[str, list[float]] = {}
        for r in per_rank[d:d + tensor]:
            for key, v in r["alone"].items():
                group.setdefault(key, []).append(v)
        for key, v in group.items():
            times.setdefault(key, []).append(statistics.median(v))
    return {k: statistics.median(v) for k, v in times.items()}


def _contention(slowdown: float, devices: int, cores: int) -> float:
    """The ``contention`` at which the topology's rate model
    (:meth:`pipeflow.topology.topology.Topology.compute_rate`) slows ``devices`` devices
    computing at once on ``cores`` cores by ``slowdown``."""
    busy = min(devices, cores)
    share = min(1.0, cores / devices)
    factor = min(1.0, 1.0 / (slowdown * share)) if slowdown > 0 else 1.0
    if busy > 1 and cores > 1:
        contention = 1.0 - (1.0 - factor) * (cores - 1) / (busy - 1)
    else:
        contention = 1.0
    return min(1.0, max(0.05, contention))


def _tensor_cores(slowdown: float, devices: int, cores: int, tensor: int, used: float) -> int:
    """The cores of the simulator's TensorTopology: how many tensor-parallel devices the host's
    ``cores`` run at once at full speed. A device's ranks keep ``used`` x T cores busy, not T;
    of the whole numbers from ``cores // T`` up to ``cores / (used x T)``, the smallest whose
    share (:meth:`~pipeflow.topology.topology.Topology.compute_rate`) covers ``slowdown``."""
    low = max(1, cores // tensor)
    high = max(low, min(devices, math.ceil(cores / max(used * tensor, 1e-9))))
    for n in range(low, high + 1):
        if min(1.0, n / devices) * slowdown >= 1.0:
            return n
    return high
