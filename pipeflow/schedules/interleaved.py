"""Interleaved 1F1B (Narayanan et al., SC'21; Megatron's virtual pipeline).

Each device r holds v model chunks; chunk c of device r is stage c*p + r of a chain of
p*v stages, so a microbatch passes through every device v times. Microbatches move in
groups of p: device r's k-th forward is chunk (k // p) % v of microbatch
(k // (p*v))*p + k % p, and its k-th backward walks the chunks in reverse. Warm-up is
2*(p-r-1) + (v-1)*p forwards, then one forward / one backward, then the drain.
Bubble ratio with equal stages: (p-1)/(v*m+p-1), v times smaller than 1F1B's,
paid for with v times more point-to-point messages. Any m runs: with m not a multiple
of p the microbatches move in max(1, m // p) groups as even as can be (torch's flexible
interleaving: 10 on 4 devices as 5 + 5, 3 as one group of 3; and 9 as 5 + 4).
"""

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
