"""Data parallelism around any synchronous schedule: replicas of the whole pipeline on
disjoint devices, each stage's gradients all-reduced across its replicas right after its
last weight-gradient action (:func:`pipeflow.schedules.common.finish_sync`).
``pipeline.data_parallel`` (:func:`replicate`) and the planner's replicas
(:func:`pipeflow.planning.placement_plan.build_plan_schedule`) both go through
:func:`replicate_onto`; replicas are pipes of the IR."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .common import finish_sync
from .ir import Kind, Placement, Schedule, WeightPolicy


def replicate(schedule: Schedule, n: int) -> Schedule:
    """``schedule`` (synchronous, one step) run by ``n`` data-parallel replicas on
    consecutive blocks of devices, each on a contiguous share of the microbatches."""
    if n == 1:
        return schedule
    p, m = schedule.num_devices, schedule.num_microbatches
    return replicate_onto([schedule] * n, [range(r * p, (r + 1) * p) for r in range(n)], n * p,
                          [range(r * m, (r + 1) * m) for r in range(n)])


def round_robin(counts: Sequence[int]) -> list[list[int]]:
    """Global microbatch ids when replica r's i-th microbatch is global ``i*n + r``
    (``counts`` must be what dealing ``sum(counts)`` microbatches round robin gives)."""
    n, m = len(counts), sum(counts)
    ids = [list(range(r, m, n)) for r in range(n)]
    if [len(x) for x in ids] != list(counts):
        raise ValueError(f"microbatch counts {list(counts)} are not a round-robin deal of {m}")
    return ids


def replicate_onto(replicas: Sequence[Schedule], devices: Sequence[Sequence[int]], num_devices: int,
                   microbatch_ids: Sequence[Sequence[int]]) -> Schedule:
    """One synchronous step of pipeline replicas side by side: ``replicas[r]``'s device d runs on
    ``devices[r][d]``, its microbatch i is global microbatch ``microbatch_ids[r][i]``. The
    replicas share one stage graph; their microbatch counts may differ."""
    if not replicas or not (len(replicas) == len(devices) == len(microbatch_ids)):
        raise ValueError("replicate_onto: one device row and one microbatch list per replica")
    first = replicas[0]
    for s in replicas:
        if s.policy != WeightPolicy.SYNC:
            raise ValueError(f"pipeline.data_parallel={len(replicas)}: schedule '{s.name}' is asynchronous; "
                             f"data parallelism wraps synchronous schedules (use pipeline.data_parallel=1)")
        if s.graph != first.graph or s.placement.num_pipes != first.placement.num_pipes:
            raise ValueError("replicate_onto: the replicas must run the same stages in the same pipes")
    flat = [g for row in devices for g in row]
    if len(set(flat)) != len(flat) or any(not 0 <= g < num_devices for g in flat):
        raise ValueError(f"device rows {[list(r) for r in devices]}: every replica needs its own devices "
                         f"among 0..{num_devices - 1}")
    ids = [list(x) for x in microbatch_ids]
    total = sum(len(x) for x in ids)
    if sorted(i for x in ids for i in x) != list(range(total)):
        raise ValueError(f"microbatch ids {ids}: each of 0..{total - 1} must belong to exactly one replica")
    pipes = first.placement.num_pipes
    table: list[tuple[int, ...]] = []
    pipe_of = [0] * total
    orders: list[list] = [[] for _ in range(num_devices)]
    overlapped: list = []
    for r, (s, row, mbs) in enumerate(zip(replicas, devices, ids)):
        def moved(a, r=r, mbs=mbs):
            return a._replace(microbatch=mbs[a.microbatch] if a.microbatch >= 0 else a.microbatch,
                              pipe=a.pipe + r * pipes)

        overlapped += [(moved(f), moved(b)) for f, b in s.overlapped]
        row = list(row)
        if len(row) != s.num_devices or len(mbs) != s.num_microbatches:
            raise ValueError(f"replica {r}: {s.num_devices} devices and {s.num_microbatches} microbatches, "
                             f"given {len(row)} devices and {len(mbs)} microbatch ids")
        table.extend(tuple(row[d] for d in prow) for prow in s.placement.table)
        for i, g in enumerate(mbs):
            pipe_of[g] = r * pipes + s.pipe_of_microbatch[i]
        for d, order in enumerate(s.orders):
            orders[row[d]] = [moved(a) for a in order if a.kind not in (Kind.REDUCE, Kind.STEP)]
    whole = finish_sync(first.name, first.graph, Placement(num_devices, tuple(table)), orders, total,
                        pipe_of_microbatch=tuple(pipe_of), num_segments=first.num_segments, meta=dict(first.meta),
                        overlapped=tuple(overlapped))
    return dataclasses.replace(whole, data_parallel=len(replicas))


def as_replica(schedule: Schedule) -> Schedule:
    """The first replica's lists of ``replicate(schedule, n)`` for any n >= 2, on the schedule's
    own placement (each stage's REDUCE where the replicated step issues it), without building
    the other replicas."""
    orders = [[a for a in order if a.kind not in (Kind.REDUCE, Kind.STEP)] for order in schedule.orders]
    one = finish_sync(schedule.name, schedule.graph, schedule.placement, orders, schedule.num_microbatches,
                      pipe_of_microbatch=schedule.pipe_of_microbatch, num_segments=schedule.num_segments,
                      meta=dict(schedule.meta), overlapped=schedule.overlapped, replicated=True)
    return dataclasses.replace(one, data_parallel=schedule.data_parallel, layers_per_stage=schedule.layers_per_stage)


def pipeline_shape(schedule: Schedule, stages: int) -> dict:
    """A run summary's ``stages`` (``pipeline.stages`` or a plan's count) and ``data_parallel``
    (the pipeline's replicas)."""
    planned = bool(schedule.layers_per_stage)
    return {"stages": schedule.num_stages if planned else int(stages), "data_parallel": schedule.data_parallel}
