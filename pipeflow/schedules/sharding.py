"""Lowering for fully sharded stages (``pipeline.shard=full``, ZeRO-3 / FSDP): when each
replica of a stage gathers its parameters (GATHER) and lets them go (FREE), by
``pipeline.gather``: ``step`` (around the step's compute), ``chunk`` (while the device is
on that stage) or ``microbatch`` (around each compute action; an overlapped F&B pair is
one). A GATHER is a collective on the compute stream that the stage's compute up to its
FREE waits for (:class:`~pipeflow.schedules.deps.DepResolver`); REDUCE becomes a
reduce-scatter. Stages on one device are not sharded. docs/training.md has the table."""

from __future__ import annotations

import dataclasses
from collections import Counter

from .ir import Action, Kind, Schedule

GATHER_POLICIES = ("step", "chunk", "microbatch")


def with_gathers(schedule: Schedule, policy: str, every_stage: bool = False) -> Schedule:
    """``schedule`` with its GATHER and FREE actions, its ``meta["gather"]`` the policy.
    ``every_stage``: every stage counts as replicated (one replica's lists)."""
    if policy not in GATHER_POLICIES:
        raise ValueError(f"pipeline.gather={policy}: allowed values: {', '.join(GATHER_POLICIES)}")
    table = schedule.placement.table
    replicated = {s for s in range(schedule.num_stages) if every_stage or len({row[s] for row in table}) > 1}
    partner = schedule.overlap_partner()  # an overlapped F&B pair stays one unit: gathered around both
    orders = []
    for order in schedule.orders:
        units: list[list[Action]] = []
        for a in order:
            if units and units[-1][0] in partner and partner[units[-1][0]] == a:
                units[-1].append(a)
            else:
                units.append([a])
        needs = [[(a.pipe, a.stage) for a in u if a.kind in Kind.COMPUTE and a.stage in replicated] for u in units]
        last = {rep: i for i, reps in enumerate(needs) for rep in reps}
        compute = [i for i, reps in enumerate(needs) if reps]
        following = {i: set(needs[j]) for i, j in zip(compute, compute[1:])}
        held: set = set()
        count: Counter = Counter()
        new: list[Action] = []
        for i, (unit, reps) in enumerate(zip(units, needs)):
            for rep in dict.fromkeys(reps):
                if rep not in held:
                    new.append(Action(Kind.GATHER, rep[1], -1, rep[0], 0, count[rep]))
                    held.add(rep)
            new.extend(unit)
            for rep in dict.fromkeys(reps):
                if policy == "microbatch" or i == last[rep] or (policy == "chunk" and rep not in following[i]):
                    new.append(Action(Kind.FREE, rep[1], -1, rep[0], 0, count[rep]))
                    held.discard(rep)
                    count[rep] += 1
        orders.append(new)
    return dataclasses.replace(schedule, orders=orders, gather=policy)


def gathers_per_step(schedule: Schedule) -> dict[tuple[int, int], int]:
    """(pipe, stage) -> how many all-gathers of its parameters one step runs."""
    out: Counter = Counter()
    for order in schedule.orders:
        for a in order:
            if a.kind == Kind.GATHER:
                out[(a.pipe, a.stage)] += 1
    return dict(out)
