"""Looped BFS (Lamy-Poirier, MLSys 2023; torch's ``ScheduleLoopedBFS``): interleaved 1F1B's
placement gone breadth first: each chunk's forward for every microbatch in turn, then the
backwards from the last chunk down, the latest microbatch first (GPipe's memory). Bubble
with equal stages: (p-1)/(v*m+p-1) when m >= p."""

from __future__ import annotations

from .common import check_basic, finish_sync, require
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec


def looped_bfs(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    name = "looped_bfs"
    check_basic(name, stages, microbatches)
    p, m, v = stages, microbatches, virtual_stages
    require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, "pipeline.virtual_stages", v, name,
            "a whole number of chunks per device >= 1")
    orders = []
    for r in range(p):
        forwards = [Action(Kind.F, c * p + r, mb) for c in range(v) for mb in range(m)]
        backwards = [Action(Kind.B, c * p + r, mb) for c in reversed(range(v)) for mb in reversed(range(m))]
        orders.append(forwards + backwards)
    return finish_sync(name, StageGraph.chain(p * v), Placement.single([s % p for s in range(p * v)], p), orders, m,
                       meta={"virtual_stages": v})


SPEC = ScheduleSpec("looped_bfs", looped_bfs, "breadth first over v chunks per device: every microbatch through a "
                    "chunk before the next chunk (torch's ScheduleLoopedBFS)")
