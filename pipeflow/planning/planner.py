"""Topology-aware synchronous pipeline planning (Luo et al., INFOCOM 2022): :func:`plan`
chooses the stage count, the cut, the data-parallel replicas and each stage's device for a
1F1B run within a per-device memory limit, ranking candidates in closed form and simulating
the best (docs/planning.md, "How the planner searches")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..topology.topology import Topology
from .transformer import TransformerSpec
from .baselines import dapple_plan_layout, pipedream_plan_layout, uniform_layout
from .placement_plan import (  # GB, Plan, StageModel, build_plan_schedule, evaluate, fits: importable from here too
    GB,
    Plan,
    StageModel,
    _bisect_cut,
    _compositions,
    build_plan_schedule,  # noqa: F401 - re-exported
    device_limits,
    estimate,
    evaluate,
    fits,
    overshoot,
    tensor_degree_of,
    uniform_cut,
)


@dataclass
class _Candidate:
    est: float
    est_mem_over: float  # max over stages of (estimated memory - limit)
    layers: tuple[int, ...]
    devices: tuple[int, ...]
    method: str = "planner"
    replicas: tuple[tuple[int, ...], ...] = ()

    @property
    def key(self) -> tuple:
        return (self.layers, self.devices, self.replicas)


def chain_cuts(model: StageModel, topology: Topology, chain: Sequence[int], microbatches: int,
               limits: Sequence[float], exhaustive_budget: int = 0) -> list[list[int]]:
    """Candidate cuts of the layers over the devices of ``chain`` (one stage per device)."""
    p, L, m = len(chain), model.L, microbatches
    if p > L:
        return []
    devs = topology.devices
    if math.comb(L - 1, p - 1) <= exhaustive_budget:
        return [list(c) for c in _compositions(L, p)]

    def time_of(s, n):
        return model.fb_time(n, s == p - 1, devs[chain[s]], s == 0)

    def mem_of(s, n):
        return model.memory(n, s == 0, s == p - 1, min(p - s, m)) / limits[chain[s]]

    def mem_ok(s, n):
        return mem_of(s, n) <= 1.0

    cuts = [uniform_cut(L, p)]
    for reverse in (False, True):
        for extra in (mem_ok, None):
            c = _bisect_cut(time_of, p, L, reverse, extra)
            if c is not None:
                cuts.append(c)
        c = _bisect_cut(mem_of, p, L, reverse)  # least memory
        if c is not None:
            cuts.append(c)
    out, seen = [], set()
    for c in cuts:
        if tuple(c) not in seen:
            seen.add(tuple(c))
            out.append(c)
    return out


# ---------------------------------------------------------------------- mappings


def _pair_bw(topology: Topology, a: int, b: int) -> float:
    return min(topology.bandwidth(a, b), topology.bandwidth(b, a))


def greedy_chain(topology: Topology, start: int) -> list[int]:
    """A device ordering from ``start``: always step to the unused device with the fastest
    link both ways, ties to the same node, then the faster device, then the lower id."""
    n = topology.num_devices
    devs = topology.devices
    chain = [start]
    used = [False] * n
    used[start] = True
    cur = start
    for _ in range(n - 1):
        best, key = -1, None
        for d in range(n):
            if used[d]:
                continue
            k = (_pair_bw(topology, cur, d), devs[d].node == devs[cur].node, devs[d].peak_flops, -d)
            if key is None or k > key:
                best, key = d, k
        chain.append(best)
        used[best] = True
        cur = best
    return chain


def _signature(topology: Topology, chain: Sequence[int]) -> tuple:
    devs = topology.devices
    return (
        tuple((devs[d].name, devs[d].peak_flops, devs[d].memory_bytes) for d in chain),
        tuple((topology.route(a, b).bandwidth, topology.route(a, b).latency,
               topology.route(b, a).bandwidth, topology.route(b, a).latency) for a, b in zip(chain, chain[1:])),
    )


def greedy_chains(topology: Topology, starts: Sequence[int] | None = None) -> list[list[int]]:
    """The greedy ordering from each start device (every device on up to 16 devices;
    beyond that one start per node and device kind)."""
    n = topology.num_devices
    if starts is None:
        if n <= 16:
            starts = range(n)
        else:  # one start per node and per device kind
            seen_kind: set = set()
            starts = []
            for d, dev in enumerate(topology.devices):
                key = (dev.node, dev.name)
                if key not in seen_kind:
                    seen_kind.add(key)
                    starts.append(d)
    return [greedy_chain(topology, s) for s in starts]


def device_chains(topology: Topology, p: int, full: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Distinct (up to link and device symmetry) device chains of length p: the first p
    devices of each greedy ordering (``full``, default :func:`greedy_chains`), and their
    reversals."""
    if full is None:
        full = greedy_chains(topology)
    out, seen = [], set()
    for ch in full:
        ch = list(ch)
        for cand in (ch[:p], ch[:p][::-1]):
            sig = _signature(topology, cand)
            if sig not in seen:
                seen.add(sig)
                out.append(cand)
    return out


# ------------------------------------------------------------------------ search


def _best_on_chain(model, topology, chain, microbatches, limits, exhaustive_budget) -> _Candidate | None:
    best = None
    for cut in chain_cuts(model, topology, chain, microbatches, limits, exhaustive_budget):
        est, over = estimate(model, topology, cut, chain, microbatches, limits)
        c = _Candidate(est, over, tuple(cut), tuple(chain))
        if best is None or (max(c.est_mem_over, 0), c.est) < (max(best.est_mem_over, 0), best.est):
            best = c
    return best


def _local_search(model, topology, cands, microbatches, limits, exhaustive_budget,
                  starts: int = 4, max_neighbours: int = 400, max_rounds: int = 8) -> list[_Candidate]:
    """Hill-climb the device chains of the ``starts`` best fitting candidates (by estimate)."""
    D = topology.num_devices
    pool = sorted((c for c in cands if c.est_mem_over <= 0 and not c.replicas), key=lambda c: c.est)
    out: list[_Candidate] = []
    seen_chains: set = set()
    cache: dict = {}
    for start in pool:
        if len(seen_chains) >= starts:
            break
        if start.devices in seen_chains:
            continue
        seen_chains.add(start.devices)
        p = len(start.devices)
        if p * (p - 1) // 2 + p * (D - p) > max_neighbours:
            continue
        cur = start
        for _ in range(max_rounds):
            chain = list(cur.devices)
            unused = [d for d in range(D) if d not in chain]
            neighbours = []
            for i in range(p):
                for j in range(i + 1, p):
                    nb = chain[:]
                    nb[i], nb[j] = nb[j], nb[i]
                    neighbours.append(nb)
                for d in unused:
                    nb = chain[:]
                    nb[i] = d
                    neighbours.append(nb)
            improved = None
            for nb in neighbours:
                # chains alike up to device and link symmetry have the same best cut and estimate
                sig = _signature(topology, nb)
                if sig not in cache:
                    cache[sig] = _best_on_chain(model, topology, nb, microbatches, limits, exhaustive_budget)
                c = cache[sig]
                if c is not None and tuple(nb) != c.devices:
                    c = _Candidate(c.est, c.est_mem_over, c.layers, tuple(nb))
                if c is not None and c.est_mem_over <= 0 and c.est < (improved or cur).est * (1 - 1e-9):
                    improved = c
            if improved is None:
                break
            cur = improved
            out.append(cur)
    return out


def _check_args(spec, topology, microbatches, microbatch_size, memory_limit_bytes, num_stages):
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline.microbatches={microbatches!r}: must be a whole number >= 1")
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"pipeline.microbatch_size={microbatch_size!r}: must be a whole number >= 1")
    if memory_limit_bytes is not None and not (memory_limit_bytes > 0):
        raise ValueError(f"plan.memory_limit_gb={memory_limit_bytes / GB:g}: must be a number > 0 (or null)")
    most = min(spec.n_layer, topology.num_devices)
    if num_stages is not None and (
        isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= most
    ):
        raise ValueError(
            f"plan.stages={num_stages!r}: allowed values: null (search) or 1..{most} "
            f"(model '{spec.name}' has {spec.n_layer} layers, topology '{topology.name}' "
            f"{topology.num_devices} devices)"
        )


def _stage_counts(most: int, budget: int = 24) -> list[int]:
    """Every count up to 8, then a geometric-ish spread (with the extreme) up to ``most``."""
    if most <= budget:
        return list(range(1, most + 1))
    counts = set(range(1, 9))
    x = 8.0
    while x < most:
        x *= 1.25
        counts.add(min(most, int(round(x))))
    for d in range(1, most + 1):  # divisors-friendly values: powers of two and multiples of 8
        if d % 8 == 0 or (d & (d - 1)) == 0:
            counts.add(d)
    counts.add(most)
    return sorted(counts)


def not_fitting_message(spec: TransformerSpec, limit: float | None, need: float, over: float,
                        lean: Plan | None = None) -> str:
    where = ""
    if lean is not None:
        rep = f" x {lean.replicas} replicas" if lean.replicas > 1 else ""
        where = (f" (the leanest plan found: {lean.num_stages} stages{rep}, layers {lean.layers_per_stage} "
                 f"on devices {lean.pipelines if lean.replicas > 1 else lean.device_of_stage})")
    lim = "the devices' own memory (null)" if limit is None else f"{limit / GB:g} GB"
    return (
        f"plan.memory_limit_gb={'null' if limit is None else f'{limit / GB:g}'}: model '{spec.name}' does not fit "
        f"in {lim} per device; the smallest per-device requirement found is {need / GB:.2f} GB, "
        f"{over / GB:.2f} GB over the limit{where}; raise plan.memory_limit_gb, use more devices, "
        f"or a smaller pipeline.microbatch_size"
    )


def _replica_counts(most: int) -> list[int]:
    return [d for d in range(2, most + 1) if d <= 8 or (d & (d - 1)) == 0]


def replica_tables(topology: Topology, p: int, d: int, full: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """Device tables (``d`` pipelines of ``p`` stages) from the greedy orderings: blocked
    (pipeline k on the k-th run of p devices) and interleaved (a stage's replicas on d
    consecutive devices, its all-reduce inside a fast island)."""
    out, seen = [], set()
    for ch in full:
        ch = list(ch)[: p * d]
        for table in ([ch[k * p:(k + 1) * p] for k in range(d)], [[ch[s * d + k] for s in range(p)] for k in range(d)]):
            sig = (tuple(_signature(topology, row) for row in table),
                   tuple(topology.allreduce_time(list(col), 1e9) for col in zip(*table)))
            if sig not in seen:
                seen.add(sig)
                out.append(table)
    return out


def plan(
    spec: TransformerSpec,
    topology: Topology,
    microbatches: int,
    microbatch_size: int = 1,
    memory_limit_bytes: float | None = None,
    num_stages: int | None = None,
    efficiency: float = 0.5,
    dtype_bytes: int = 2,
    top_k: int = 12,
    exhaustive_budget: int = 64,
    replicas: int | None = None,
    tensor_parallel: int | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """The fastest 1F1B plan found; ValueError naming ``plan.memory_limit_gb`` and how far the
    leanest candidate is over it when nothing fits. ``replicas``: None searches data-parallel
    replicas too, k plans exactly k pipelines. ``tensor_parallel`` T > 1: ``topology`` seen as
    tensor groups of T (:func:`pipeflow.topology.tensor.tensor_topology`; None: its own
    grouping), every candidate priced per rank, with ``sequence_parallel`` or without."""
    _check_args(spec, topology, microbatches, microbatch_size, memory_limit_bytes, num_stages)
    T = tensor_degree_of(topology, tensor_parallel)
    _check_replicas(replicas, num_stages, topology, microbatches)
    model = StageModel(spec, microbatch_size, efficiency, dtype_bytes, T, sequence_parallel, topology)
    limits = device_limits(topology, memory_limit_bytes)
    cands = _candidates(model, topology, spec.n_layer, microbatches, limits, exhaustive_budget, num_stages, replicas)
    # the baselines are candidates too: the plan is never slower than them when they fit
    extra: list[_Candidate] = []
    if replicas in (None, 1):
        extra = _baseline_candidates(spec, model, topology, microbatches, microbatch_size, efficiency, dtype_bytes,
                                     num_stages, memory_limit_bytes, limits)

    def run(c: _Candidate) -> Plan:
        return evaluate(spec, topology, c.layers, c.devices, microbatches, microbatch_size, memory_limit_bytes,
                        efficiency, dtype_bytes, replica_devices=c.replicas, tensor_parallel=T,
                        sequence_parallel=sequence_parallel)[0]

    fitting = sorted((c for c in cands if c.est_mem_over <= 0), key=lambda c: c.est)
    # estimated memory is close but not exact: simulate a few beyond the estimate's edge
    near = sorted((c for c in cands if 0 < c.est_mem_over), key=lambda c: (c.est_mem_over, c.est))
    chosen = fitting[:top_k] + [c for c in extra if c.est_mem_over <= 0] + near[: max(2, top_k // 4)]
    best, leanest = _fastest_fitting(chosen, run, topology, memory_limit_bytes)
    if best is not None:
        best.method = "planner"
        return best
    # nothing fits: report the leanest candidate, by simulated memory
    for c in sorted(cands + extra, key=lambda c: c.est_mem_over)[:4]:
        leanest = _leaner(run(c), leanest, topology, memory_limit_bytes)
    over = overshoot(leanest, topology, memory_limit_bytes)
    limit_of = device_limits(topology, memory_limit_bytes)
    need = max(leanest.memory_per_device().items(), key=lambda kv: kv[1] - limit_of[kv[0]])[1]
    raise ValueError(not_fitting_message(spec, memory_limit_bytes, need, over, leanest))


def _check_replicas(replicas: int | None, num_stages: int | None, topology: Topology, microbatches: int) -> None:
    """plan.replicas: none (search), or a count the devices and microbatches allow, with
    plan.stages if fixed."""
    D = topology.num_devices
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)
                                 or not 1 <= replicas <= min(D, microbatches)):
        raise ValueError(f"plan.replicas={replicas!r}: allowed values: null (search) or "
                         f"1..{min(D, microbatches)} (devices and pipeline.microbatches allow)")
    if num_stages is not None and replicas is not None and num_stages * replicas > D:
        raise ValueError(f"plan.stages={num_stages} x plan.replicas={replicas} needs {num_stages * replicas} "
                         f"devices; topology '{topology.name}' has {D}")


def _candidates(model: StageModel, topology: Topology, n_layer: int, microbatches: int, limits: Sequence[float],
                exhaustive_budget: int, num_stages: int | None, replicas: int | None) -> list[_Candidate]:
    """Every layout the search ranks by its estimate, once each, in the order found: one
    pipeline's (chains with their cuts, then the best hill-climbed), then each count of
    replicated pipelines (``replicas``; None: every count)."""
    D = topology.num_devices
    full = greedy_chains(topology)
    found: dict[tuple, _Candidate] = {}

    def add(c: _Candidate) -> None:
        found.setdefault(c.key, c)

    if replicas in (None, 1):
        for p in [num_stages] if num_stages is not None else _stage_counts(min(n_layer, D)):
            for chain in device_chains(topology, p, full):
                for cut in chain_cuts(model, topology, chain, microbatches, limits, exhaustive_budget):
                    est, over = estimate(model, topology, cut, chain, microbatches, limits)
                    add(_Candidate(est, over, tuple(cut), tuple(chain)))
        # mapping refinement: hill-climb the best few chains by swapping two stages' devices or
        # moving a stage to an unused device, each neighbour priced with its best cut
        for c in _local_search(model, topology, list(found.values()), microbatches, limits, exhaustive_budget):
            add(c)
    for d in _replica_counts(min(D, microbatches)) if replicas is None else [r for r in [replicas] if r > 1]:
        most = min(n_layer, D // d)
        if most < 1 or (num_stages is not None and num_stages > most):
            continue
        for p in [num_stages] if num_stages is not None else _stage_counts(most):
            for table in replica_tables(topology, p, d, full):
                rows = [tuple(r) for r in table[1:]]
                # (each pipeline runs ceil(m / d) microbatches)
                for cut in chain_cuts(model, topology, table[0], -(-microbatches // d), limits, exhaustive_budget):
                    est, over = estimate(model, topology, cut, table[0], microbatches, limits, rows)
                    add(_Candidate(est, over, tuple(cut), tuple(table[0]), replicas=tuple(rows)))
    return list(found.values())


def _baseline_candidates(spec, model, topology, microbatches, microbatch_size, efficiency, dtype_bytes,
                         num_stages, memory_limit_bytes, limits) -> list[_Candidate]:
    """The uniform-identity, PipeDream-style and DAPPLE-style layouts, estimated as the
    search's own."""
    out = []
    for method, layout in (
        ("uniform", uniform_layout(spec, topology, num_stages)),
        ("pipedream", pipedream_plan_layout(spec, topology, microbatches, microbatch_size, efficiency,
                                            dtype_bytes, num_stages)),
        ("dapple", dapple_plan_layout(spec, topology, microbatches, microbatch_size, efficiency,
                                      dtype_bytes, num_stages, memory_limit_bytes)),
    ):
        cut, chain = layout
        est, over = estimate(model, topology, cut, chain, microbatches, limits)
        out.append(_Candidate(est, over, tuple(cut), tuple(chain), method))
    return out


def _fastest_fitting(chosen: list[_Candidate], run, topology: Topology,
                     memory_limit_bytes: float | None) -> tuple[Plan | None, Plan | None]:
    """Each layout of ``chosen`` simulated once (``run``): the fastest plan whose simulated
    memory fits (None: none), and of the others the leanest."""
    best: Plan | None = None
    leanest: Plan | None = None
    done: set = set()
    for c in chosen:
        if c.key in done:
            continue
        done.add(c.key)
        cand = run(c)
        if fits(cand, topology, memory_limit_bytes):
            if best is None or cand.predicted_iteration_time < best.predicted_iteration_time * (1 - 1e-12):
                best = cand
        else:
            leanest = _leaner(cand, leanest, topology, memory_limit_bytes)
    return best, leanest


def _leaner(cand: Plan, leanest: Plan | None, topology: Topology, memory_limit_bytes: float | None) -> Plan:
    """Of two plans, the one less over the memory limit (``leanest`` on a tie)."""
    if leanest is None or overshoot(cand, topology, memory_limit_bytes) < overshoot(leanest, topology,
                                                                                    memory_limit_bytes):
        return cand
    return leanest
