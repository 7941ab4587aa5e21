"""Ground truth for the planner on small instances: every replica count, stage count,
contiguous cut and injective placement of the stages onto devices (replicas' renumberings
once), each simulated (1F1B). Without replication that is sum over p of
C(L-1, p-1) * D!/(D-p)! simulations: 1,523 for 8 layers on 4 devices, about a second."""

from __future__ import annotations

import itertools
import math

from ..topology.topology import Topology
from .placement_plan import Plan, _compositions, evaluate, fits
from .transformer import TransformerSpec


def search_size(n_layer: int, num_devices: int, max_replicas: int = 1) -> int:
    """Simulations :func:`exhaustive_plan` runs (replicas up to ``max_replicas``)."""
    total = 0
    for d in range(1, max_replicas + 1):
        for p in range(1, min(n_layer, num_devices // d) + 1):
            total += math.comb(n_layer - 1, p - 1) * math.perm(num_devices, p * d) // math.factorial(d)
    return total


def exhaustive_plan(
    spec: TransformerSpec,
    topology: Topology,
    microbatches: int,
    microbatch_size: int = 1,
    memory_limit_bytes: float | None = None,
    num_stages: int | None = None,
    efficiency: float = 0.5,
    dtype_bytes: int = 2,
    max_replicas: int | None = None,
    max_candidates: int = 20000,
) -> Plan | None:
    """The fastest fitting plan over the whole space (None if nothing fits).
    ``max_replicas`` None allows as many pipeline replicas as devices and microbatches do."""
    L, D = spec.n_layer, topology.num_devices
    top = min(D, microbatches) if max_replicas is None else max_replicas
    size = search_size(L, D, top)
    if size > max_candidates:
        raise ValueError(
            f"exhaustive search over {L} layers and {D} devices is {size} simulations (max_candidates="
            f"{max_candidates}); use a smaller instance"
        )
    best: Plan | None = None
    for d in range(1, top + 1):
        counts = [num_stages] if num_stages else range(1, min(L, D // d) + 1)
        for p in counts:
            if p * d > D:
                continue
            for cut in _compositions(L, p):
                for devs in itertools.permutations(range(D), p * d):
                    table = [list(devs[k * p:(k + 1) * p]) for k in range(d)]
                    if any(table[k][0] > table[k + 1][0] for k in range(d - 1)):
                        continue  # the same placement with the replicas renumbered
                    cand, _ = evaluate(spec, topology, cut, table[0], microbatches, microbatch_size,
                                       memory_limit_bytes, efficiency, dtype_bytes, method="exhaustive",
                                       replica_devices=table[1:])
                    if not fits(cand, topology, memory_limit_bytes):
                        continue
                    if best is None or cand.predicted_iteration_time < best.predicted_iteration_time:
                        best = cand
    return best
