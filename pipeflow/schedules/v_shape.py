"""V-shaped schedules, two chunks per device (``zb_v``, ``dualpipe_v``): device d of p holds
stage d (down) and stage 2p-1-d (up), so the first and last stage share device 0 and the
turn of the V is on device p-1.

ZB-V (Qi et al., ICLR 2024, section 6) runs the backward split into I and W on this
placement; the construction fills the V with 2p-1 microbatches (with fewer, the missing
ones' actions are left out). The phases of each: docs/schedules.md."""

from __future__ import annotations

from collections import deque

from .common import check_basic, finish_sync, require
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec


def v_placement(p: int) -> Placement:
    """Stage s on device s for the first half, 2p-1-s for the second."""
    return Placement.single([s if s < p else 2 * p - 1 - s for s in range(2 * p)], p)


class _Device:
    """One device's order being written: counters per (kind, stage) and the I whose W
    is held back, per stage."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.count: dict[tuple[str, int], int] = {}
        self.held: dict[int, deque[int]] = {}

    def run(self, kind: str, stage: int) -> int:
        mb = self.count.get((kind, stage), 0)
        self.count[(kind, stage)] = mb + 1
        self.order.append(Action(kind, stage, mb))
        return mb

    def done(self, kind: str, stage: int) -> int:
        return self.count.get((kind, stage), 0)

    def backward(self, stage: int, weight: bool = True) -> None:
        """I of the next microbatch of ``stage``; its W now, or held back."""
        mb = self.run(Kind.I, stage)
        if weight:
            self.order.append(Action(Kind.W, stage, mb))
        else:
            self.held.setdefault(stage, deque()).append(mb)

    def release(self, stage: int) -> None:
        """The oldest held-back W of ``stage``."""
        self.order.append(Action(Kind.W, stage, self.held[stage].popleft()))


def zb_v_order(p: int, m: int, d: int) -> list[Action]:
    """Device ``d``'s ZB-V order (see the module docstring), microbatches >= m left out."""
    n = max(m, 2 * p - 1)
    down, up = d, 2 * p - 1 - d
    dev = _Device()
    for _ in range(2 * (p - d) - 1):
        dev.run(Kind.F, down)
    for _ in range(d):
        dev.run(Kind.F, up)
        dev.run(Kind.F, down)
    for _ in range(p - d):
        dev.run(Kind.F, up)
        dev.backward(up)
    while dev.done(Kind.F, up) < dev.done(Kind.F, down) or dev.done(Kind.F, down) < n:
        if dev.done(Kind.F, down) < n:
            dev.run(Kind.F, down)
        dev.backward(down)
        dev.run(Kind.F, up)
        dev.backward(up)
    for _ in range(d):
        dev.backward(down, weight=False)
        dev.backward(up, weight=False)
    for _ in range(p - d):
        dev.backward(down, weight=False)
        dev.release(down)
    while dev.held.get(up):
        dev.release(up)
    while dev.held.get(down):
        dev.release(down)
    return [a for a in dev.order if a.microbatch < m]


def zb_v(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    check_basic("zb_v", stages, microbatches)
    require(virtual_stages == 2, "pipeline.virtual_stages", virtual_stages, "zb_v",
            "exactly two chunks per device (the V's down and up stage): pipeline.virtual_stages=2")
    p, m = stages, microbatches
    orders = [zb_v_order(p, m, d) for d in range(p)]
    return finish_sync("zb_v", StageGraph.chain(2 * p), v_placement(p), orders, m, meta={"virtual_stages": 2})


class _DualDevice(_Device):
    """A DualPipeV device: B and I of a stage share one backward count, the I leave their
    W in one queue (oldest first), and overlapped F&B pairs are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: deque[Action] = deque()
        self.pairs: list[tuple[Action, Action]] = []

    def back(self, stage: int, split: bool = False) -> Action:
        mb = self.count.get(("back", stage), 0)
        self.count[("back", stage)] = mb + 1
        a = Action(Kind.I if split else Kind.B, stage, mb)
        self.order.append(a)
        if split:
            self.queue.append(Action(Kind.W, stage, mb))
        return a

    def weight(self) -> None:
        if self.queue:
            self.order.append(self.queue.popleft())

    def overlapped(self, forward_stage: int, backward_stage: int) -> None:
        self.run(Kind.F, forward_stage)
        f = self.order[-1]
        self.pairs.append((f, self.back(backward_stage)))


def dualpipe_v_order(p: int, m: int, d: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    """Device ``d``'s DualPipeV order and its overlapped pairs (see :func:`dualpipe_v`)."""
    down, up = d, 2 * p - 1 - d
    dev = _DualDevice()
    for _ in range(2 * (p - d - 1)):  # 1. the down stage fills the V
        dev.run(Kind.F, down)
    for _ in range(d + 1):  # 2. both halves
        dev.run(Kind.F, down)
        dev.run(Kind.F, up)
    for _ in range(p - d - 1):  # 3. the up stage's first backwards, split, their W in the gaps
        dev.back(up, split=True)
        dev.weight()
        dev.run(Kind.F, up)
    for i in range(m - 2 * p + d + 1):  # 4. steady: every forward overlapped with a backward
        if i == 0 and d == p - 1:  # the turn of the V: its first up backward needs this forward
            dev.run(Kind.F, down)
            dev.back(up)
        else:
            dev.overlapped(down, up)
        dev.overlapped(up, down)
    for _ in range(p - d - 1):  # 5. the down stage's forwards are done
        dev.back(up)
        dev.overlapped(up, down)
    split = False
    for i in range(d + 1):  # 6. both halves' last backwards, split from the middle on
        if i == (d + 1) // 2 and d % 2 == 1:
            split = True
        dev.back(up, split)
        if i == (d + 1) // 2 and d % 2 == 0:
            split = True
        dev.back(down, split)
    for _ in range(p - d - 1):  # 7. the down stage's last backwards, W in between
        dev.weight()
        dev.back(down, split)
    for _ in range(d + 1):  # 8. the W still queued
        dev.weight()
    return dev.order, dev.pairs


def dualpipe_v(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto a V; torch's ScheduleDualPipeV): every
    steady-state forward overlapped with a backward of the device's other stage
    (:attr:`pipeflow.schedules.ir.Schedule.overlapped`), the last backwards split into I and
    W. Needs m >= 2p."""
    name = "dualpipe_v"
    check_basic(name, stages, microbatches)
    require(virtual_stages == 2, "pipeline.virtual_stages", virtual_stages, name,
            "exactly two chunks per device (the V's down and up stage): pipeline.virtual_stages=2")
    p, m = stages, microbatches
    require(m >= 2 * p, "pipeline.microbatches", m, name,
            f"at least two per stage of the V: pipeline.microbatches >= 2 x pipeline.stages = {2 * p}")
    orders, pairs = [], []
    for d in range(p):
        order, own = dualpipe_v_order(p, m, d)
        orders.append(order)
        pairs += own
    return finish_sync(name, StageGraph.chain(2 * p), v_placement(p), orders, m, meta={"virtual_stages": 2},
                       overlapped=tuple(pairs))


DUALPIPE_V = ScheduleSpec("dualpipe_v", dualpipe_v, "DualPipeV: a V of two chunks per device, every steady-state "
                          "forward overlapped with a backward of the other chunk (cost.overlap)")

ZB_V = ScheduleSpec("zb_v", zb_v, "zero bubble on a V: two chunks per device (d and 2p-1-d), "
                    "1F1B's activation memory (ZB-V)")
