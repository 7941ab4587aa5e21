"""Pieces every generator shares: size checks with errors that name the config key,
and the synchronous tail (REDUCE for replicated stages, then STEP) that closes an
iteration with a flush."""

from __future__ import annotations

from .ir import Action, Kind, Placement, Schedule, StageGraph, WeightPolicy


class ScheduleConfigError(ValueError):
    """Sizes a schedule cannot be built for. The message names the key and the allowed values."""


def require(condition: bool, key: str, value, schedule: str, rule: str) -> None:
    """Raise ScheduleConfigError("pipeline.stages=3: chimera needs ...") unless condition."""
    if not condition:
        raise ScheduleConfigError(f"{key}={value}: schedule '{schedule}' needs {rule}")


def check_basic(name: str, stages: int, microbatches: int) -> None:
    require(isinstance(stages, int) and stages >= 1, "pipeline.stages", stages, name, "a whole number of stages >= 1")
    require(
        isinstance(microbatches, int) and microbatches >= 1,
        "pipeline.microbatches",
        microbatches,
        name,
        "a whole number of microbatches >= 1",
    )


def warmup_alternate_drain(total: int, warmup: int, forward, backward) -> list[Action]:
    """The 1F1B shape over ``total`` units: ``warmup`` forwards, then one forward and one
    backward in turn, then the remaining backwards; ``forward(k)`` / ``backward(k)``: the
    k-th unit's actions."""
    warmup = min(warmup, total)
    steady = total - warmup  # forward-backward pairs
    forwards, backwards = list(map(forward, range(total))), list(map(backward, range(total)))
    order = forwards[:warmup] + [None] * (2 * steady) + backwards[steady:]
    order[warmup:warmup + 2 * steady:2] = forwards[warmup:]
    order[warmup + 1:warmup + 2 * steady:2] = backwards[:steady]
    return order


def finish_sync(
    name: str,
    graph: StageGraph,
    placement: Placement,
    orders: list[list[Action]],
    microbatches: int,
    pipe_of_microbatch: tuple[int, ...] = (),
    num_segments: int = 1,
    meta: dict | None = None,
    overlapped: tuple = (),
    replicated: bool | None = None,
) -> Schedule:
    """Close a synchronous iteration: each replicated stage's REDUCE right after its last
    weight-gradient action on a device, then STEP every stage the device holds.
    ``replicated``: None, whether the placement has several pipes; True, as one replica."""
    replicated = placement.num_pipes > 1 if replicated is None else replicated
    out: list[list[Action]] = []
    for dev, order in enumerate(orders):
        new, reduced = _with_reduces(order) if replicated else (list(order), set())
        for pipe, stage in placement.stages_on(dev):
            if replicated and (pipe, stage) not in reduced:
                # a replica that ran no microbatch still joins the collective
                new.append(Action(Kind.REDUCE, stage, -1, pipe, 0, 0))
        # the steps in stage order on every device: a sharded stage's step is a blocking
        # collective over its replicas, and Chimera's mirror replicas hold their stages in
        # opposite orders (device 0: stage 0 then p-1; device p-1: p-1 then 0), where
        # stepping in placement order had each wait in a different group for the other
        for pipe, stage in sorted(placement.stages_on(dev), key=lambda ps: (ps[1], ps[0])):
            new.append(Action(Kind.STEP, stage, -1, pipe, 0, 0))
        out.append(new)
    return Schedule(
        name=name,
        graph=graph,
        placement=placement,
        orders=out,
        num_microbatches=microbatches,
        num_segments=num_segments,
        policy=WeightPolicy.SYNC,
        pipe_of_microbatch=pipe_of_microbatch,
        meta=dict(meta or {}),
        overlapped=tuple(overlapped),
    )


def _with_reduces(order: list[Action]) -> tuple[list[Action], set[tuple[int, int]]]:
    """``order`` with the REDUCE of each (pipe, stage) after its last weight-gradient
    action, and those (pipe, stage)."""
    last_wgrad: dict[tuple[int, int], int] = {}
    for pos, a in enumerate(order):
        if a.kind in Kind.WEIGHT_GRAD:
            last_wgrad[(a.pipe, a.stage)] = pos
    after: dict[int, list[Action]] = {}
    for (pipe, stage), pos in last_wgrad.items():
        after.setdefault(pos, []).append(Action(Kind.REDUCE, stage, -1, pipe, 0, 0))
    new: list[Action] = []
    for pos, a in enumerate(order):
        new.append(a)
        new.extend(after.get(pos, ()))
    return new, set(last_wgrad)
