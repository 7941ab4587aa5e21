"""Chimera (Li & Hoefler, SC'21): two pipelines in opposite directions over the same devices
(down: stage i on device i; up: on device p-1-i), in basic units of p microbatches, half on
each, concatenated for more. After a stage's last backward its two replicas all-reduce
their gradients, then step. A unit's order is list scheduling in unit time (a backward
before a forward, then the deeper stage, then the older microbatch), then fixed."""

from __future__ import annotations

from functools import lru_cache

from .common import check_basic, finish_sync, require
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec


@lru_cache(maxsize=64)
def _unit_template(p: int, size: int) -> tuple[tuple[tuple[str, int, int, int], ...], ...]:
    """Each device's order for one basic unit of ``size`` microbatches numbered from 0, as
    (kind, stage, microbatch, pipe) tuples."""
    half = size // 2
    pipe_of = [0] * half + [1] * (size - half)
    device = [list(range(p)), list(reversed(range(p)))]  # pipe -> stage -> device
    never = 1 << 60
    # finished[kind][pipe][stage][microbatch]: the time unit an action ends (never: not yet)
    done = {k: [[[never] * size for _ in range(p)] for _ in range(2)] for k in (Kind.F, Kind.B)}
    # per device, its actions not yet run, in the priority order (backward first, deeper
    # stage first, older microbatch first): the first ready one runs
    todo: list[list[tuple]] = [[] for _ in range(p)]
    for i in range(size):
        for s in range(p):
            for kind in (Kind.F, Kind.B):
                todo[device[pipe_of[i]][s]].append((kind == Kind.F, -s, i, kind, s, pipe_of[i]))
    for row in todo:
        row.sort()
    orders: list[list[tuple]] = [[] for _ in range(p)]
    t, left = 0, 2 * size * p
    while left:
        for d in range(p):
            row = todo[d]
            for j, (_, _, mb, kind, s, pipe) in enumerate(row):
                if kind == Kind.F:
                    ok = s == 0 or done[Kind.F][pipe][s - 1][mb] <= t
                else:
                    ok = done[Kind.F][pipe][s][mb] <= t and (s == p - 1 or done[Kind.B][pipe][s + 1][mb] <= t)
                if ok:
                    del row[j]
                    done[kind][pipe][s][mb] = t + 1
                    orders[d].append((kind, s, mb, pipe))
                    left -= 1
                    break
        t += 1
    return tuple(tuple(o) for o in orders)


def _unit_orders(p: int, first_mb: int, size: int) -> list[list[Action]]:
    return [[Action(kind, s, first_mb + mb, pipe) for kind, s, mb, pipe in order] for order in _unit_template(p, size)]


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
        for d, unit in enumerate(_unit_orders(p, first, size)):
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
