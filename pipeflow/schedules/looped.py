"""Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023; torch's
``ScheduleLoopedBFS``).

Each device holds v chunks, chunk c of device r being stage c*p + r (the placement of
interleaved 1F1B). Where interleaved 1F1B goes depth first, looped BFS goes breadth
first: a device runs the forward of its chunk 0 for every microbatch, then chunk 1 for
every microbatch, and so on; then the backwards from its last chunk down, the latest
microbatch first. Every microbatch's activations stay alive until the backward (GPipe's
memory, m microbatches per chunk), in exchange for long runs of one chunk, which suit
sharded data parallelism (one gather of a chunk's weights serves all microbatches).
Bubble with equal stages: (p-1)/(v*m+p-1) when m >= p.
"""

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
