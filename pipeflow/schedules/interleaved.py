"""Interleaved 1F1B (Narayanan et al., SC'21; Megatron's virtual pipeline): device r holds v
chunks, chunk c being stage c*p + r; microbatches move in groups of p (any m: torch's
flexible interleaving), warm-up 2*(p-r-1) + (v-1)*p forwards. Bubble with equal stages:
(p-1)/(v*m+p-1)."""

from __future__ import annotations

from .common import check_basic, finish_sync, require
from .ir import Placement, Schedule, StageGraph
from .seq1f1b import interleaved_orders
from .spec import ScheduleSpec


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    name = "interleaved_1f1b"
    check_basic(name, stages, microbatches)
    p, m, v = stages, microbatches, virtual_stages
    require(isinstance(v, int) and v >= 1, "pipeline.virtual_stages", v, name, "a whole number of chunks per device >= 1")
    orders = interleaved_orders(p, m, v, 1)  # Seq1F1B-I's order with one segment per microbatch
    device_of_stage = [s % p for s in range(p * v)]
    return finish_sync(
        name,
        StageGraph.chain(p * v),
        Placement.single(device_of_stage, p),
        orders,
        m,
        meta={"virtual_stages": v},
    )


SPEC = ScheduleSpec("interleaved_1f1b", interleaved_1f1b, "1F1B over v model chunks per device (Megatron's virtual pipeline)")
