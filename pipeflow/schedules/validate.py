"""The validator: complete, placed where the placement says, dependency-respecting, deadlock-free (a
zero-cost dry run). Every ScheduleError names the actions at fault."""

from __future__ import annotations

from collections import Counter
from itertools import chain, compress
from operator import itemgetter

import numpy as np

from .deps import DepResolver
from .ir import Action, Kind, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot be run as written. ``actions`` are the ones at fault."""

    def __init__(self, message: str, actions: list[Action] | None = None):
        super().__init__(message)
        self.actions = list(actions or [])


def _fmt(actions, limit: int = 8) -> str:
    items = [str(a) for a in actions]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_complete(schedule: Schedule) -> None:
    """Raise ScheduleError unless each (stage, microbatch, segment) has one F and one backward (a B, or an I
    and a W), each on the device holding its stage for its pipe."""
    if _complete(schedule):
        return
    _check_complete_by_action(schedule)


def _complete(schedule: Schedule) -> bool:
    """Whether the schedule certainly passes check_complete (False: look closer), as arrays."""
    S, M, G = schedule.num_stages, schedule.num_microbatches, schedule.num_segments
    every = list(chain.from_iterable(schedule.orders))
    try:
        kind = np.array(list(map(itemgetter(0), every)), dtype=str)
        stage, mb, pipe, seg = (np.fromiter(map(itemgetter(i), every), dtype=np.int64, count=len(every))
                                for i in (1, 2, 3, 4))
    except (TypeError, ValueError, OverflowError):
        return False  # a field that is not a number
    device = np.repeat(np.arange(len(schedule.orders)), list(map(len, schedule.orders)))
    # each action on the device that holds its (pipe, stage)
    table = np.array(schedule.placement.table)
    if not (len(every) and 0 <= stage.min() and stage.max() < S and 0 <= pipe.min() and pipe.max() < len(table)
            and (table[pipe, stage] == device).all()):
        return False
    compute = np.isin(kind, list(Kind.COMPUTE))
    c_mb, c_seg, c_pipe = mb[compute], seg[compute], pipe[compute]
    if len(c_mb) and not (0 <= c_mb.min() and c_mb.max() < M and 0 <= c_seg.min() and c_seg.max() < G
                          and (np.array(schedule.pipe_of_microbatch)[c_mb] == c_pipe).all()):
        return False
    key = (stage * M + mb) * G + seg  # (stage, microbatch, segment), one number each in range
    f, b, i, w = (np.sort(key[kind == k]) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
    if any((keys[1:] == keys[:-1]).any() for keys in (f, b, i, w)):
        return False  # one twice
    n = S * M * G
    if len(f) != n or not np.array_equal(i, w) or len(np.intersect1d(b, i, assume_unique=True)) \
            or len(b) + len(i) != n:
        return False  # with every key in range, n distinct B-or-I keys are all of them
    other = list(compress(every, ~compute))
    seen = set(other)
    return len(seen) == len(other) and all(a[0] in Kind.ALL for a in other) and _steps_complete(schedule, seen)


def _steps_complete(schedule: Schedule, seen) -> bool:
    """The STEP and REDUCE part of check_complete, as a verdict."""
    steps = {a for a in seen if a.kind == Kind.STEP}
    if not steps:
        return True
    placement = schedule.placement
    want = {Action(Kind.STEP, s, -1, p, 0, u) for u in sorted(set(schedule.update_of_microbatch))
            for s in range(schedule.num_stages) for p in range(placement.num_pipes)}
    if want - steps:
        return False
    return placement.num_pipes == 1 or all(Action(Kind.REDUCE, a.stage, -1, a.pipe, 0, a.version) in seen for a in want)


def _check_complete_by_action(schedule: Schedule) -> None:
    """check_complete's walk, action by action: raise ScheduleError naming what is wrong."""
    seen = _placed_once(schedule)
    _check_backwards(schedule, seen)
    _check_steps(schedule, seen)


def _placed_once(schedule: Schedule) -> Counter:
    """Every action -> how often it runs; ScheduleError on one out of range, misplaced or run twice."""
    S, M, G = schedule.num_stages, schedule.num_microbatches, schedule.num_segments
    placement = schedule.placement
    pipe_of = schedule.pipe_of_microbatch
    seen: Counter = Counter()
    misplaced: list[str] = []
    bad: list[str] = []
    for dev, _pos, a in schedule.actions():
        if a.kind not in Kind.ALL or not 0 <= a.stage < S or not 0 <= a.pipe < placement.num_pipes:
            bad.append(f"{a} on device {dev}")
            continue
        if a.kind in Kind.COMPUTE:
            if not (0 <= a.microbatch < M and 0 <= a.segment < G):
                bad.append(f"{a} on device {dev}")
                continue
            if pipe_of[a.microbatch] != a.pipe:
                misplaced.append(f"{a} (microbatch {a.microbatch} belongs to pipe {pipe_of[a.microbatch]})")
                continue
        want = placement.device(a.pipe, a.stage)
        if want != dev:
            misplaced.append(f"{a} on device {dev} (pipe {a.pipe} places stage {a.stage} on device {want})")
        seen[a] += 1
    if bad:
        raise ScheduleError(
            f"schedule {schedule.name!r}: actions out of range "
            f"(stages 0..{S - 1}, microbatches 0..{M - 1}, segments 0..{G - 1}): {_fmt(bad)}"
        )
    if misplaced:
        raise ScheduleError(f"schedule {schedule.name!r}: actions on the wrong device: {_fmt(misplaced)}")
    dups = [a for a, n in seen.items() if n > 1]
    if dups:
        raise ScheduleError(f"schedule {schedule.name!r}: actions scheduled more than once: {_fmt(dups)}", dups)
    return seen


def _check_backwards(schedule: Schedule, seen: Counter) -> None:
    """ScheduleError unless each (stage, microbatch, segment) has its F and a B, or an I and its W."""
    S, M, G = schedule.num_stages, schedule.num_microbatches, schedule.num_segments
    pipe_of = schedule.pipe_of_microbatch
    missing: list[Action] = []
    conflicting: list[Action] = []
    for mb in range(M):
        pipe = pipe_of[mb]
        for s in range(S):
            for g in range(G):
                f = Action(Kind.F, s, mb, pipe, g)
                b = Action(Kind.B, s, mb, pipe, g)
                i = Action(Kind.I, s, mb, pipe, g)
                w = Action(Kind.W, s, mb, pipe, g)
                if f not in seen:
                    missing.append(f)
                has_b, has_i, has_w = b in seen, i in seen, w in seen
                if has_b and (has_i or has_w):
                    conflicting.append(b)
                elif not has_b:
                    if not has_i:
                        missing.append(b if not has_w else i)
                    if has_i and not has_w:
                        missing.append(w)
    if conflicting:
        raise ScheduleError(
            f"schedule {schedule.name!r}: both a full backward and an I/W split for {_fmt(conflicting)}",
            conflicting,
        )
    if missing:
        raise ScheduleError(f"schedule {schedule.name!r}: missing actions: {_fmt(missing)}", missing)


def _check_steps(schedule: Schedule, seen: Counter) -> None:
    """ScheduleError unless every (stage, pipe) steps at every update, a replicated one after its REDUCE."""
    S, placement = schedule.num_stages, schedule.placement
    steps = {a for a in seen if a.kind == Kind.STEP}
    if steps:
        updates = sorted(set(schedule.update_of_microbatch))
        want = {
            Action(Kind.STEP, s, -1, p, 0, u)
            for u in updates
            for s in range(S)
            for p in range(placement.num_pipes)
        }
        lacking = sorted(want - steps)
        if lacking:
            raise ScheduleError(f"schedule {schedule.name!r}: missing optimizer steps: {_fmt(lacking)}", lacking)
        if placement.num_pipes > 1:
            need_reduce = sorted(Action(Kind.REDUCE, a.stage, -1, a.pipe, 0, a.version) for a in want)
            lacking = [a for a in need_reduce if a not in seen]
            if lacking:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: replicated stages step without reducing "
                    f"their gradients; missing: {_fmt(lacking)}",
                    lacking,
                )


def dry_run(schedule: Schedule, resolver: DepResolver | None = None) -> list[Action]:
    """The global completion order of a zero-cost run (a REDUCE completes once every replica issued it);
    ScheduleError naming the stuck heads and what each waits for."""
    res = resolver or DepResolver(schedule)
    orders = schedule.orders
    ndev = len(orders)
    where, deps_cache = _waits(schedule, res)
    done: set[Action] = set()
    issued: Counter = Counter()  # collectives (REDUCE, GATHER): (kind, stage, version) -> replicas issued
    npipes = schedule.placement.num_pipes
    pending_reduce: dict[tuple, list[Action]] = {}
    ptr = [0] * ndev
    completion: list[Action] = []
    total = sum(len(o) for o in orders)
    progress = True
    while progress:
        progress = False
        for dev in range(ndev):
            order = orders[dev]
            p = ptr[dev]
            while p < len(order):
                a = order[p]
                if any(d not in done for d in deps_cache[dev][p]):
                    break
                p += 1
                progress = True
                if a.kind in Kind.COLLECTIVE and npipes > 1:
                    key = (a.kind, a.stage, a.version)
                    issued[key] += 1
                    pending_reduce.setdefault(key, []).append(a)
                    if issued[key] == npipes:
                        for r in pending_reduce.pop(key):
                            done.add(r)
                            completion.append(r)
                else:
                    done.add(a)
                    completion.append(a)
            ptr[dev] = p
    if len(done) == total:
        return completion
    raise _deadlock(schedule, where, deps_cache, ptr, done)


def _waits(schedule: Schedule, res: DepResolver) -> tuple[dict, list]:
    """(where: action -> (device, position), deps: [device][position] -> what it waits for); ScheduleError
    on a dependency the schedule does not run."""
    orders = schedule.orders
    where: dict[Action, tuple[int, int]] = {}
    for dev, order in enumerate(orders):
        for pos, a in enumerate(order):
            where[a] = (dev, pos)
    deps_cache: list[list[list[Action]]] = [[[d.action for d in res.deps(a)] for a in order] for order in orders]
    # an overlapped pair starts when both halves are ready: its forward waits for what its
    # backward needs too (a backward that needs its own forward's result cannot overlap it)
    for f, b in schedule.overlapped:
        if f in where and b in where:
            fdev, fpos = where[f]
            bdev, bpos = where[b]
            deps_cache[fdev][fpos] = deps_cache[fdev][fpos] + [d for d in deps_cache[bdev][bpos] if d != f]
    for dev, order in enumerate(orders):
        for pos, a in enumerate(order):
            for d in deps_cache[dev][pos]:
                if d not in where:
                    raise ScheduleError(
                        f"schedule {schedule.name!r}: {a} on device {dev} depends on {d}, "
                        f"which is not in the schedule",
                        [a, d],
                    )
    return where, deps_cache


def _deadlock(schedule: Schedule, where: dict, deps_cache: list, ptr: list, done: set) -> ScheduleError:
    """The ScheduleError of a dry run stuck at ``ptr``: each stuck head and what it waits for."""
    orders = schedule.orders
    ndev, total = len(orders), sum(len(o) for o in orders)
    stuck: list[Action] = []
    reasons: list[str] = []
    for dev in range(ndev):
        if ptr[dev] >= len(orders[dev]):
            continue
        a = orders[dev][ptr[dev]]
        stuck.append(a)
        waits = []
        for d in deps_cache[dev][ptr[dev]]:
            if d in done:
                continue
            ddev, dpos = where[d]
            if ddev == dev and dpos > ptr[dev]:
                waits.append(f"{d}, which comes later on the same device (position {dpos})")
            else:
                waits.append(f"{d} on device {ddev}")
        if not waits and a.kind in Kind.COLLECTIVE:
            waits.append("the other replicas to issue the same " + ("reduction" if a.kind == Kind.REDUCE else "gather"))
        reasons.append(f"device {dev} at {a} (position {ptr[dev]}) waits for " + "; ".join(waits))
    return ScheduleError(
        f"schedule {schedule.name!r} deadlocks after {len(done)} of {total} actions: " + " | ".join(reasons),
        stuck,
    )


def check_overlaps(schedule: Schedule) -> None:
    """ScheduleError unless each overlapped pair is an F and right after it a B on one device."""
    if not schedule.overlapped:
        return
    where = {a: (dev, pos) for dev, pos, a in schedule.actions()}
    seen: set[Action] = set()
    for f, b in schedule.overlapped:
        pair = f"overlapped pair ({f};{b})"
        if f.kind != Kind.F or b.kind != Kind.B:
            raise ScheduleError(f"schedule {schedule.name!r}: {pair} must be a forward (F) and a full backward (B)",
                                [f, b])
        if f in seen or b in seen:
            raise ScheduleError(f"schedule {schedule.name!r}: {pair} shares an action with another pair", [f, b])
        seen |= {f, b}
        if f not in where or b not in where:
            raise ScheduleError(f"schedule {schedule.name!r}: {pair} names an action the schedule does not run",
                                [f, b])
        (fd, fp), (bd, bp) = where[f], where[b]
        if fd != bd or bp != fp + 1:
            raise ScheduleError(f"schedule {schedule.name!r}: {pair} must be adjacent on one device, the backward "
                                f"right after the forward (they are at device {fd} position {fp} and device {bd} "
                                f"position {bp})", [f, b])


def validate(schedule: Schedule) -> Schedule:
    """Raise ScheduleError unless the schedule is complete and runs to completion."""
    completion_order(schedule)
    return schedule


def completion_order(schedule: Schedule) -> list[Action]:
    """:func:`validate`'s checks; the dry run's global completion order (:func:`dry_run`)."""
    check_complete(schedule)
    check_overlaps(schedule)
    return dry_run(schedule)
