"""Baseline planners the topology-aware planner is compared with, each planning one pipeline
as a :class:`~pipeflow.planning.placement_plan.Plan` scored by the same 1F1B simulation:
:func:`uniform_plan` (an even cut, stage i on device i), :func:`pipedream_plan` (PipeDream's
dynamic program, every device like device 0 and every link the median one, memory ignored)
and :func:`dapple_plan` (DAPPLE's append-first or scatter-first placement over the real
links, within the memory limit). ``**tensor`` goes to :func:`evaluate`."""

from __future__ import annotations

import statistics

from ..topology.topology import Topology
from .placement_plan import Plan, StageModel, _bisect_cut, evaluate, uniform_cut
from .transformer import TransformerSpec


def uniform_layout(spec: TransformerSpec, topology: Topology, num_stages: int | None = None
                   ) -> tuple[list[int], list[int]]:
    """(layers per stage, device of stage) of the uniform-identity baseline."""
    p = num_stages or min(spec.n_layer, topology.num_devices)
    return uniform_cut(spec.n_layer, p), list(range(p))


def _median_bandwidth(topology: Topology) -> float:
    n = topology.num_devices
    bws = [topology.bandwidth(a, b) for a in range(n) for b in range(n) if a != b]
    return statistics.median(bws) if bws else float("inf")


def pipedream_plan_layout(
    spec: TransformerSpec,
    topology: Topology,
    microbatches: int,
    microbatch_size: int = 1,
    efficiency: float = 0.5,
    dtype_bytes: int = 2,
    num_stages: int | None = None,
) -> tuple[list[int], list[int]]:
    """(layers per stage, device of stage) PipeDream's planner picks (no replication)."""
    model = StageModel(spec, microbatch_size, efficiency, dtype_bytes)
    dev0 = topology.devices[0]
    bw = _median_bandwidth(topology)
    comm = 0.0 if topology.num_devices == 1 else model.msg_bytes / bw
    most = min(spec.n_layer, topology.num_devices)
    best = None
    for p in [num_stages] if num_stages else range(1, most + 1):
        def time_of(s, n, p=p):
            return model.fb_time(n, s == p - 1, dev0)

        cut = _bisect_cut(time_of, p, spec.n_layer, reverse=False)
        if cut is None:
            continue
        slowest = max(max(time_of(s, n) for s, n in enumerate(cut)), 2 * comm if p > 1 else 0.0)
        if best is None or slowest < best[0] * (1 - 1e-9):
            best = (slowest, cut)
    return best[1], list(range(len(best[1])))


def _scatter_order(topology: Topology) -> list[int]:
    nodes: dict[int, list[int]] = {}
    for d, dev in enumerate(topology.devices):
        nodes.setdefault(dev.node, []).append(d)
    groups = list(nodes.values())
    out = []
    for i in range(max(len(g) for g in groups)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def dapple_plan_layout(
    spec: TransformerSpec,
    topology: Topology,
    microbatches: int,
    microbatch_size: int = 1,
    efficiency: float = 0.5,
    dtype_bytes: int = 2,
    num_stages: int | None = None,
    memory_limit_bytes: float | None = None,
) -> tuple[list[int], list[int]]:
    """(layers per stage, device of stage) DAPPLE's planner picks (no replication)."""
    model = StageModel(spec, microbatch_size, efficiency, dtype_bytes)
    dev0 = topology.devices[0]
    cap = dev0.memory_bytes if memory_limit_bytes is None else min(memory_limit_bytes, dev0.memory_bytes)
    L, m = spec.n_layer, microbatches
    most = min(L, topology.num_devices)
    best = None
    for order in (list(range(topology.num_devices)), _scatter_order(topology)):
        for p in [num_stages] if num_stages else range(1, most + 1):
            chain = order[:p]

            def time_of(s, n, p=p):
                return model.fb_time(n, s == p - 1, dev0)

            def mem_ok(s, n, p=p):
                return model.memory(n, s == 0, s == p - 1, min(p - s, m)) <= cap

            cut = _bisect_cut(time_of, p, L, reverse=False, extra_cap=mem_ok)
            if cut is None:
                continue
            t = [time_of(s, n) for s, n in enumerate(cut)]
            c = [topology.transfer_time(a, b, model.msg_bytes) for a, b in zip(chain, chain[1:])]
            est = sum(t) + 2 * sum(c) + (m - 1) * max(max(t), max(c, default=0.0))
            if best is None or est < best[0] * (1 - 1e-9):
                best = (est, cut, chain)
    if best is None:  # nothing fits the memory: fall back to the fastest ignoring it
        cut, chain = uniform_layout(spec, topology, num_stages)
        return cut, chain
    return best[1], list(best[2])


def uniform_plan(spec: TransformerSpec, topology: Topology, microbatches: int, microbatch_size: int = 1,
                 memory_limit_bytes: float | None = None, num_stages: int | None = None,
                 efficiency: float = 0.5, dtype_bytes: int = 2, **tensor) -> Plan:
    cut, devs = uniform_layout(spec, topology, num_stages)
    return evaluate(spec, topology, cut, devs, microbatches, microbatch_size, memory_limit_bytes,
                    efficiency, dtype_bytes, method="uniform", **tensor)[0]


def pipedream_plan(spec: TransformerSpec, topology: Topology, microbatches: int, microbatch_size: int = 1,
                   memory_limit_bytes: float | None = None, num_stages: int | None = None,
                   efficiency: float = 0.5, dtype_bytes: int = 2, **tensor) -> Plan:
    cut, devs = pipedream_plan_layout(spec, topology, microbatches, microbatch_size, efficiency, dtype_bytes,
                                      num_stages)
    return evaluate(spec, topology, cut, devs, microbatches, microbatch_size, memory_limit_bytes,
                    efficiency, dtype_bytes, method="pipedream", **tensor)[0]


def dapple_plan(spec: TransformerSpec, topology: Topology, microbatches: int, microbatch_size: int = 1,
                memory_limit_bytes: float | None = None, num_stages: int | None = None,
                efficiency: float = 0.5, dtype_bytes: int = 2, **tensor) -> Plan:
    cut, devs = dapple_plan_layout(spec, topology, microbatches, microbatch_size, efficiency, dtype_bytes,
                                   num_stages, memory_limit_bytes)
    return evaluate(spec, topology, cut, devs, microbatches, microbatch_size, memory_limit_bytes,
                    efficiency, dtype_bytes, method="dapple", **tensor)[0]


BASELINES = {"uniform": uniform_plan, "pipedream": pipedream_plan, "dapple": dapple_plan}
