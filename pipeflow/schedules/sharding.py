"""Lowering for fully sharded stages (``pipeline.shard=full``, ZeRO-3 / FSDP): when each
replica of a stage gathers the stage's parameters and when it lets them go.

Under ``full`` each of a stage's n replicas keeps one n-th of the stage's parameters (and
of their gradients and optimizer state) between uses. :func:`with_gathers` inserts into
every device's list a GATHER before a replicated stage's compute needs its whole
parameters and a FREE after the last compute that needed them, by one of three policies
(``pipeline.gather``):

- ``step``: gathered before the stage's first forward of the step and freed after its
  last backward (or W): one all-gather a step, the whole parameters held through it (the
  saving is between steps and at the optimizer step, which updates the shard alone).
- ``chunk``: gathered when the device turns to the stage and freed when it turns to
  another stage (an interleaved or V-shaped device holds one chunk's parameters at a
  time); on a device with one stage it is ``step``.
- ``microbatch``: gathered before every forward and every backward and freed after it:
  the whole parameters only while one runs, at m x 2 (3 with the I/W split) all-gathers
  a step, which the maintainers of DeepSpeed's pipeline name as the reason they refuse
  ZeRO-3 with it.

An overlapped F&B pair (DualPipeV) is one unit: both stages gathered before it, freed
after it. GATHER is a collective (its k-th occurrence on every replica of the stage is one
all-gather, numbered by ``version``), issued on the compute stream like REDUCE: the
stage's compute up to the matching FREE waits for it (:class:`~pipeflow.schedules.deps.
DepResolver`), so a gather issued ahead of other work overlaps it. A W reads no weight,
but it is gathered for like the others: the runtime's weight backward runs through the
graph the forward built on the gathered parameters. REDUCE is then a reduce-scatter
(as under ``gradients``). Stages held by one device are not sharded and get neither.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from .ir import Action, Kind, Schedule

GATHER_POLICIES = ("step", "chunk", "microbatch")


def with_gathers(schedule: Schedule, policy: str, every_stage: bool = False) -> Schedule:
    """``schedule`` with its GATHER and FREE actions (module docstring); its ``meta``
    records the policy under ``"gather"``. ``every_stage``: every stage counts as
    replicated (one replica's lists, data_parallel.as_replica)."""
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
