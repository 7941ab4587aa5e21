"""The adaptive interaction coordinator: BAPP's per-device policy chosen with the simulator.
Every policy of :mod:`pipeflow.schedules.bapp`'s space (priority x leading branch x extra
warm-up x head device) is simulated with the cost model's stage times and kept if every
device fits the memory limit; the fastest wins, ties to the earlier, which starts with the
uncoordinated policy, so the result is never slower than it."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from ..sim.device_memory import device_peaks
from ..sim.engine import simulate
from ..schedules.bapp import BRANCHES, HEADS, PRIORITIES, UNCOORDINATED, BappPolicy, bapp, bapp_placement
from ..schedules.common import ScheduleConfigError
from ..schedules.ir import Schedule, StageGraph
from ..schedules.validate import validate


@dataclass
class Coordinated:
    schedule: Schedule
    policy: BappPolicy
    makespan: float
    uncoordinated_makespan: float
    seconds: float  # wall time of the search
    tried: list = field(default_factory=list)  # (policy, makespan or None when over memory, peak bytes)

    @property
    def speedup(self) -> float:
        return self.uncoordinated_makespan / self.makespan if self.makespan > 0 else 1.0


def policies(max_warmup: int = 2) -> list[BappPolicy]:
    out = [UNCOORDINATED]
    for pr, lead, w, head in itertools.product(PRIORITIES, BRANCHES, range(max_warmup + 1), HEADS):
        pol = BappPolicy(pr, lead, w, head)
        if pol != UNCOORDINATED:
            out.append(pol)
    return out


def _peak_bytes(result, schedule: Schedule, cost, topology) -> float:
    """The fullest device's peak, as pipeflow-simulate walks it (:func:`device_peaks`)."""
    return max(device_peaks(schedule, cost, result.per_device, topology), default=0.0)


def coordinate(stages: int, microbatches: int, graph: StageGraph, cost, topology,
               memory_limit: float | None = None, max_warmup: int = 2) -> Coordinated:
    """The fastest BAPP schedule within ``memory_limit`` bytes per device (None: no limit)."""
    t0 = time.perf_counter()
    tried = []
    best = None
    base = None
    for pol in policies(max_warmup):
        placement = bapp_placement(graph, stages, pol.head)

        def dur(kind: str, stage: int, placement=placement) -> float:
            return float(cost.compute_time(kind, stage, 0, topology.devices[placement.device(0, stage)]))

        sched = bapp(stages, microbatches, graph, pol, dur)
        result = simulate(sched, cost, topology, record=False)
        peak = _peak_bytes(result, sched, cost, topology)
        fits = memory_limit is None or peak <= memory_limit
        tried.append((pol, result.makespan if fits else None, peak))
        if pol == UNCOORDINATED:
            base = result.makespan
        if fits and (best is None or result.makespan < best[1] - 1e-12):
            best = (sched, result.makespan, pol)
    if best is None:
        least = min(p for _, _, p in tried)
        raise ScheduleConfigError(
            f"schedule.memory_limit_gb={memory_limit / 1e9:g}: no BAPP policy fits; the least memory any needs is "
            f"{least / 1e9:.2f} GB per device ({(least - memory_limit) / 1e9:.2f} GB over)"
        )
    sched, makespan, pol = best
    validate(sched)
    sched = dataclasses.replace(sched, meta={**sched.meta, "coordinator": {
        "policy": pol._asdict(), "makespan": makespan, "uncoordinated_makespan": base, "candidates": len(tried),
        "seconds": time.perf_counter() - t0}})
    return Coordinated(sched, pol, makespan, base, time.perf_counter() - t0, tried)
