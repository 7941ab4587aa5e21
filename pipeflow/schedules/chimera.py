"""Chimera (Li & Hoefler, SC'21): two pipelines in opposite directions over the same devices.

The "down" pipeline places stage i on device i, the "up" pipeline on device p-1-i, so
every device holds two stages (twice the weights) and the warm-up of one pipeline
fills the drain of the other. A basic unit is p microbatches, half on each pipeline;
more microbatches are handled by concatenating basic units, as the paper does (a
trailing unit may be smaller). After a stage's last backward its two replicas
all-reduce their gradients (REDUCE, overlapped with the remaining work), then step.

The order inside a unit is built by list scheduling in unit time (F = B = 1, the
picture in the paper): whenever a device is free it runs, among its ready actions, a
backward before a forward, then the deeper stage (closer to its pipeline's loss) before
a shallower one, then the older microbatch. Run at those costs the unit takes exactly
2m + p - 2 time units for m = p: bubble ratio (p-2)/(2m+p-2). The order is then fixed;
other costs only change its timing.
"""

from __future__ import annotations

from .common import check_basic, finish_sync, require
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec


def _unit_orders(p: int, first_mb: int, size: int, placement: Placement) -> list[list[Action]]:
    half = size // 2
    pipe_of = [0] * half + [1] * (size - half)
    finished: dict[Action, int] = {}
    todo: set[Action] = set()
    for i in range(size):
        for s in range(p):
            todo.add(Action(Kind.F, s, first_mb + i, pipe_of[i]))
            todo.add(Action(Kind.B, s, first_mb + i, pipe_of[i]))
    by_device: list[list[Action]] = [[] for _ in range(p)]
    for a in todo:
        by_device[placement.device(a.pipe, a.stage)].append(a)
    orders: list[list[Action]] = [[] for _ in range(p)]
    never = 1 << 60

    def ready(a: Action, t: int) -> bool:
        if a.kind == Kind.F:
            return a.stage == 0 or finished.get(Action(Kind.F, a.stage - 1, a.microbatch, a.pipe), never) <= t
        return finished.get(Action(Kind.F, a.stage, a.microbatch, a.pipe), never) <= t and (
            a.stage == p - 1 or finished.get(Action(Kind.B, a.stage + 1, a.microbatch, a.pipe), never) <= t
        )

    t = 0
    while todo:
        for d in range(p):
            cands = [a for a in by_device[d] if a in todo and ready(a, t)]
            if cands:
                a = min(cands, key=lambda a: (a.kind == Kind.F, -a.stage, a.microbatch))
                todo.discard(a)
                finished[a] = t + 1
                orders[d].append(a)
        t += 1
    return orders


def chimera(stages: int, microbatches: int) -> Schedule:
    name = "chimera"
    check_basic(name, stages, microbatches)
    p, m = stages, microbatches
    require(p % 2 == 0, "pipeline.stages", p, name, "an even number of stages (2, 4, 6, ...): two pipelines of opposite direction share the devices")
    require(m % 2 == 0, "pipeline.microbatches", m, name, f"an even number of microbatches (half per direction), e.g. {p} or {2 * p}")
    placement = Placement(p, (tuple(range(p)), tuple(reversed(range(p)))))
    orders: list[list[Action]] = [[] for _ in range(p)]
    pipe_of: list[int] = []
    for first in range(0, m, p):
        size = min(p, m - first)
        pipe_of += [0] * (size // 2) + [1] * (size - size // 2)
        for d, unit in enumerate(_unit_orders(p, first, size, placement)):
            orders[d].extend(unit)
    return finish_sync(
        name,
        StageGraph.chain(p),
        placement,
        orders,
        m,
        pipe_of_microbatch=tuple(pipe_of),
        meta={"basic_unit": p},
    )


SPEC = ScheduleSpec("chimera", chimera, "two pipelines in opposite directions over the same devices", groupable=True,
                    single_pipeline=False)
