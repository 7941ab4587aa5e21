"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward is split into I (gradient of the stage input, on the critical path) and
W (gradient of the weights, which nothing downstream waits for). ZB-H1 keeps 1F1B's
order and memory (p-r-1 warm-up forwards), runs I where 1F1B runs B, and holds W back:
stage r skips the W of its first r steady-state steps and runs those W in the drain,
where 1F1B would leave the device idle waiting for gradients. The last stage, whose
drain is the longest, defers the most. With m >= p the bubble per device falls from
(p-1)(F+B) to (p-1)(F+B-2W), B being the full backward I+W.
"""

from __future__ import annotations

from collections import deque

from .common import check_basic, finish_sync
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec


def zb_h1(stages: int, microbatches: int) -> Schedule:
    check_basic("zb_h1", stages, microbatches)
    p, m = stages, microbatches
    orders: list[list[Action]] = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action(Kind.F, r, mb) for mb in range(warmup)]
        pending_w: deque[int] = deque()
        deferred = r  # how many W this stage holds back for the drain
        fwd, bwd = warmup, 0

        def backward_then_maybe_w() -> None:
            nonlocal bwd
            order.append(Action(Kind.I, r, bwd))
            pending_w.append(bwd)
            bwd += 1
            if bwd > deferred:
                order.append(Action(Kind.W, r, pending_w.popleft()))

        while fwd < m:
            order.append(Action(Kind.F, r, fwd))
            fwd += 1
            backward_then_maybe_w()
        while bwd < m:
            backward_then_maybe_w()
        order.extend(Action(Kind.W, r, mb) for mb in pending_w)
        orders.append(order)
    return finish_sync("zb_h1", StageGraph.chain(p), Placement.single(range(p)), orders, m)


SPEC = ScheduleSpec("zb_h1", zb_h1, "1F1B with the backward split into I and W, W deferred into the drain", groupable=True)
