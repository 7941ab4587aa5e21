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
    """Each (kind, stage, segment)'s time: the median over a device's T tensor ranks, then
    over the devices that hold the stage (replicas). A device's ranks run each action in
    lockstep (its collectives wait for every rank), so they measure nearly the same time;
    where they differ, the rank that reached the action's first collective early waited
    there for a partner still finishing the previous action, which that partner's previous
    action already counts. The median (at T = 2 the mean) keeps a device's action times
    adding up to its replay; the max would count every such wait twice."""
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
    """How many tensor-parallel devices the host's ``cores`` run at once at full speed:
    the cores of the simulator's TensorTopology (which divides local_cpu's by T).

    A device's T ranks wait for each other at every collective (gloo's waits sleep), so
    alone they keep ``used`` (their CPU seconds over the replay's wall seconds, measured)
    of T cores busy: a device needs ``used`` x T cores, not T, and the host holds
    ``cores / (used x T)`` of them, more than ``cores // T`` (on 2 cores, two 2-rank
    devices at 70%: 1.4 cores each, where // would say one device and halve both). Of
    the whole numbers from ``cores // T`` up to that (rounded up), the smallest whose
    share of the cores (:meth:`~pipeflow.topology.topology.Topology.compute_rate`) is at
    least what the measured ``slowdown`` leaves, so that ``contention`` fits the rest."""
    low = max(1, cores // tensor)
    high = max(low, min(devices, math.ceil(cores / max(used * tensor, 1e-9))))
    for n in range(low, high + 1):
        if min(1.0, n / devices) * slowdown >= 1.0:
            return n
    return high
