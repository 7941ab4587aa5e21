"""Data parallelism around any synchronous schedule: ``pipeline.data_parallel = n``
replicas of the whole pipeline over n x p devices.

Replica r runs the schedule as generated for p devices on devices ``r*p .. r*p+p-1``,
on microbatches ``r*m .. r*m+m-1`` of the global batch (n x m microbatches a step; each
replica's pipes are pipes ``r*P .. r*P+P-1`` of the result). Every stage then has n (for
Chimera 2n) replicas, and the synchronous closing that Chimera already uses
(:func:`pipeflow.schedules.common.finish_sync`) all-reduces each stage's gradients across
them right after the stage's last weight-gradient action on a device, so the reduction
overlaps the rest of that device's backward, and then steps. The runtime, the validator
and the simulator need nothing new: replicas on distinct devices are pipes of the IR.
"""

from __future__ import annotations

from .common import finish_sync
from .ir import Kind, Placement, Schedule, WeightPolicy


def replicate(schedule: Schedule, n: int) -> Schedule:
    """``schedule`` (synchronous, one step) run by ``n`` data-parallel replicas."""
    if n == 1:
        return schedule
    if schedule.policy != WeightPolicy.SYNC:
        raise ValueError(f"pipeline.data_parallel={n}: schedule '{schedule.name}' is asynchronous; data "
                         f"parallelism wraps synchronous schedules (use pipeline.data_parallel=1)")
    p, m, pipes = schedule.num_devices, schedule.num_microbatches, schedule.placement.num_pipes
    table = tuple(tuple(d + r * p for d in row) for r in range(n) for row in schedule.placement.table)
    pipe_of = tuple(r * pipes + schedule.pipe_of_microbatch[mb] for r in range(n) for mb in range(m))
    orders = [
        [a._replace(microbatch=a.microbatch + r * m, pipe=a.pipe + r * pipes)
         for a in schedule.orders[d] if a.kind not in (Kind.REDUCE, Kind.STEP)]
        for r in range(n) for d in range(p)
    ]
    meta = {**schedule.meta, "data_parallel": n}
    return finish_sync(schedule.name, schedule.graph, Placement(n * p, table), orders, n * m,
                       pipe_of_microbatch=pipe_of, num_segments=schedule.num_segments, meta=meta)

