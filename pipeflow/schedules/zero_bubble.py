"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's order and memory
with the backward split into I (input gradient, where 1F1B runs B) and W (weight gradient),
stage r holding back the W of its first r steady-state steps into the drain. With m >= p
the bubble per device falls from (p-1)(F+B) to (p-1)(F+B-2W)."""

from __future__ import annotations

from collections import deque

from .common import check_basic, finish_sync, require
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .seq1f1b import interleaved_units
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


def interleaved_zb(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Zero bubble over v chunks per device (ZB-1P on interleaved 1F1B's placement; torch's
    ScheduleInterleavedZeroBubble): interleaved 1F1B's order with the backward split, a
    warm-up of (v-1)*g + p-r-1 (g: the first group's microbatches), device r holding r weight
    gradients back into its drain."""
    name = "interleaved_zb"
    check_basic(name, stages, microbatches)
    p, m, v = stages, microbatches, virtual_stages
    require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, "pipeline.virtual_stages", v, name,
            "a whole number of chunks per device >= 1")
    groups, fwd_units, bwd_units = interleaved_units(p, m, v, 1)  # (chunk, microbatch), interleaved 1F1B's order
    total = len(fwd_units)
    orders: list[list[Action]] = []
    for r in range(p):
        warmup = min((v - 1) * groups[0] + p - r - 1, total)
        order = [Action(Kind.F, c * p + r, mb) for c, mb in fwd_units[:warmup]]
        done_i: list[Action] = []

        def backward(k: int, r: int = r, order: list[Action] = order, done_i: list[Action] = done_i) -> None:
            c, mb = bwd_units[k]
            done_i.append(Action(Kind.W, c * p + r, mb))
            order.append(Action(Kind.I, c * p + r, mb))
            if len(done_i) > r:  # the W of the backward r places back
                order.append(done_i[len(done_i) - 1 - r])

        for k in range(total - warmup):
            c, mb = fwd_units[warmup + k]
            order.append(Action(Kind.F, c * p + r, mb))
            backward(k)
        for k in range(total - warmup, total):
            backward(k)
        order.extend(done_i[max(0, len(done_i) - r):] if r else [])  # the W still held back
        orders.append(order)
    return finish_sync(name, StageGraph.chain(p * v), Placement.single([s % p for s in range(p * v)], p), orders, m,
                       meta={"virtual_stages": v})


INTERLEAVED_ZB = ScheduleSpec("interleaved_zb", interleaved_zb, "zero bubble over v chunks per device: interleaved "
                              "1F1B with I and W split, W held back r places (torch's ScheduleInterleavedZeroBubble)")


def zb_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al., ICLR 2024): stage r warms up with 2(p-r)-1 forwards, then each I is
    followed by the next forward while any remain and by the oldest held-back W after; the
    held-back W close the iteration."""
    check_basic("zb_h2", stages, microbatches)
    p, m = stages, microbatches
    orders: list[list[Action]] = []
    for r in range(p):
        warmup = min(2 * (p - r) - 1, m)
        order = [Action(Kind.F, r, mb) for mb in range(warmup)]
        held: deque[int] = deque()
        fwd = warmup
        for mb in range(m):
            order.append(Action(Kind.I, r, mb))
            held.append(mb)
            if fwd < m:
                order.append(Action(Kind.F, r, fwd))
                fwd += 1
            else:
                order.append(Action(Kind.W, r, held.popleft()))
        order.extend(Action(Kind.W, r, mb) for mb in held)
        orders.append(order)
    return finish_sync("zb_h2", StageGraph.chain(p), Placement.single(range(p)), orders, m)


ZB_H2 = ScheduleSpec("zb_h2", zb_h2, "zero bubble H2: 2(p-r)-1 warm-up forwards, I F W cycles; up to 2p-1 "
                     "microbatches alive on stage 0", groupable=True)
