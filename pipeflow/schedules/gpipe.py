"""GPipe (Huang et al., 2019): every forward, then every backward, then a flush.

Stage r runs F0..F(m-1) then B0..B(m-1); stage 0 holds all m microbatches' activations.
Bubble ratio with equal stages: (p-1)/(m+p-1).
"""

from __future__ import annotations

from .common import check_basic, finish_sync
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec


def gpipe(stages: int, microbatches: int) -> Schedule:
    check_basic("gpipe", stages, microbatches)
    p, m = stages, microbatches
    orders = [
        [Action(Kind.F, r, mb) for mb in range(m)] + [Action(Kind.B, r, mb) for mb in range(m)]
        for r in range(p)
    ]
    return finish_sync("gpipe", StageGraph.chain(p), Placement.single(range(p)), orders, m)


SPEC = ScheduleSpec("gpipe", gpipe, "every forward, then every backward, then a flush", groupable=True)
