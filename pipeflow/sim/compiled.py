"""A schedule compiled for the simulator: integer ids and flat lists, once per schedule
(reusable across cost models and topologies); see :mod:`pipeflow.sim.engine`."""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from ..schedules.deps import DepResolver
from ..schedules.ir import Action, Kind, Schedule
from ..schedules.versions import VersionRecord


class SimulationError(RuntimeError):
    """The schedule cannot be simulated as given (missing dependency, deadlock, or a
    topology that does not fit). The message says what to change."""


@contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector while we allocate: compiling and simulating make
    hundreds of thousands of small acyclic objects, and its rescans took about 40% of a
    64 x 1024 simulation."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------- compile
@dataclass(eq=False)
class CompiledSchedule:
    """The schedule as integer ids and flat lists; independent of cost and topology. Device
    ``d``'s actions are ids ``offsets[d]`` to ``offsets[d + 1] - 1``, in list order; messages
    are grouped into classes, each priced once."""

    schedule: Schedule
    actions: list[Action]
    kind: list[str]
    stage: list[int]
    segment: list[int]
    device: list[int]
    offsets: list[int]
    index: dict[Action, int]
    # dependents resolved when an action is done: same-device or tensor-free
    # dependencies, and the device successor of a compute action (the stream frees then)
    local_out: list[list[int]]
    # (dependent, message class) for dependents on another device that receive a tensor
    tensor_out: list[list[tuple[int, int]]]
    # message class -> (src device, dst device, src stage, dst stage, segment) of the
    # forward edge (a gradient travels dst stage -> src stage but has the same size)
    message_classes: list[tuple[int, int, int, int, int]]
    message_counts: list[int]  # messages per class
    num_waits: list[int]  # dependencies, plus one for the device predecessor
    next_on_device: list[int]  # -1 for the last action of a device
    group_of: list[int]  # REDUCE id -> collective group, -1 for other actions
    groups: list[list[int]]  # member REDUCE ids of each collective
    # weight-version records (asynchronous policies only), filled by the first simulate
    versions: list[VersionRecord] | None = field(default=None, repr=False)

    @property
    def num_actions(self) -> int:
        return len(self.actions)

    @property
    def num_devices(self) -> int:
        return len(self.offsets) - 1


def compile_schedule(schedule: Schedule) -> CompiledSchedule:
    """Number the actions and turn DepResolver's dependencies into dependent lists; the
    result, independent of the cost model and topology, goes to
    :func:`~pipeflow.sim.engine.simulate` as often as needed."""
    with _gc_paused():
        return _compile(schedule)


def _compile(schedule: Schedule) -> CompiledSchedule:
    resolver = DepResolver(schedule)
    actions, device, offsets, index = _numbered(schedule)
    kind = list(map(itemgetter(0), actions))
    stage = list(map(itemgetter(1), actions))
    segment = list(map(itemgetter(4), actions))
    local, messages, num_waits = _dependents(schedule, resolver, actions, device, index)
    kinds = np.array(kind)
    message_classes, message_counts, tensor_out = _messages(
        len(actions), kinds, np.array(stage), np.array(segment), np.array(device), *messages)
    next_on_device, local_out, num_waits = _device_order(np.isin(kinds, list(Kind.COLLECTIVE)), offsets, local,
                                                         num_waits)
    group_of, groups = _collective_groups(schedule, resolver, actions, kind, index)
    return CompiledSchedule(
        schedule=schedule,
        actions=actions,
        kind=kind,
        stage=stage,
        segment=segment,
        device=device,
        offsets=offsets,
        index=index,
        local_out=local_out,
        tensor_out=tensor_out,
        message_classes=message_classes,
        message_counts=message_counts,
        num_waits=num_waits,
        next_on_device=next_on_device,
        group_of=group_of,
        groups=groups,
    )


def _numbered(schedule: Schedule) -> tuple[list, list, list, dict]:
    """Every action numbered, device by device: (actions, each one's device, where each
    device's start, action -> number); an action listed twice is refused."""
    actions: list[Action] = []
    device: list[int] = []
    offsets = [0]
    for d, order in enumerate(schedule.orders):
        actions.extend(order)
        device.extend([d] * len(order))
        offsets.append(len(actions))
    n = len(actions)
    index = dict(zip(actions, range(n)))
    if len(index) != n:
        seen: set[Action] = set()
        dups = sorted({str(a) for a in actions if a in seen or seen.add(a)})
        raise SimulationError(
            f"schedule {schedule.name!r} lists {', '.join(dups[:8])} more than once; "
            f"run pipeflow.schedules.validate(schedule) to see every problem"
        )
    return actions, device, offsets, index


def _dependents(schedule: Schedule, resolver, actions: list, device: list, index: dict) -> tuple:
    """Dependencies -> dependents, as arrays: ((producer, waiter) of each dependency that
    is no message, (producer, consumer, waiter) of each message, how many things each action
    waits for); vectorised, with no Python step per dependency."""
    n = len(actions)
    where, producer, carries = resolver.numbered_deps(actions, index)
    if len(producer) and producer.min() < 0:
        c = int(where[np.argmax(producer < 0)])  # the first action in order with a missing dependency
        missing = [str(d.action) for d in resolver.deps(actions[c]) if d.action not in index]
        raise SimulationError(
            f"schedule {schedule.name!r}: {actions[c]} on device {device[c]} depends on {', '.join(missing)}, "
            f"which is not in the schedule; run pipeflow.schedules.validate(schedule) first"
        )
    # an overlapped pair starts when both halves are ready: what its backward waits for,
    # its forward waits for instead (the backward follows the forward on the stream)
    waiter = np.arange(n)
    for f, b in schedule.overlapped:
        if f in index and b in index:
            waiter[index[b]] = index[f]
    waits = waiter[where]
    keep = producer != waits  # a pair's backward does not wait for its own forward
    on_device = np.array(device, dtype=np.intp)
    message = keep & carries & (on_device[producer] != on_device[where])
    local = keep & ~message
    num_waits = np.bincount(waits[keep], minlength=n)
    return (producer[local], waits[local]), (producer[message], where[message], waits[message]), num_waits


def _messages(n: int, kind: np.ndarray, stage: np.ndarray, segment: np.ndarray, device: np.ndarray,
              msg_src: np.ndarray, msg_dst: np.ndarray, msg_to: np.ndarray) -> tuple[list, list, list]:
    """The messages by class: (the classes, how many of each, each action's messages out as
    (waiter, class)). A class is (src device, dst device, src stage, dst stage, segment) of the
    forward edge (gradients flow against it, the same size), numbered by first message."""
    forward = kind[msg_src] == Kind.F
    keys = np.stack([device[msg_src], device[msg_dst], np.where(forward, stage[msg_src], stage[msg_dst]),
                     np.where(forward, stage[msg_dst], stage[msg_src]), segment[msg_src]], axis=1)
    if not len(keys):
        return [], [], [[] for _ in range(n)]
    lows = keys.min(axis=0)
    spans = keys.max(axis=0) - lows + 1
    if math.prod(spans.tolist()) < 2**63:  # a key as one number: its columns' offsets in mixed radix
        code = np.zeros(len(keys), dtype=np.int64)
        for col, low, span in zip(keys.T, lows, spans):
            code = code * span + (col - low)
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    else:  # (only stray fields span that much; rows compared whole are slower)
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
    by_first = np.argsort(first)
    number = np.empty_like(by_first)
    number[by_first] = np.arange(len(first))
    msg_class = number[inverse]
    message_classes = list(map(tuple, keys[first[by_first]].tolist()))
    message_counts = np.bincount(msg_class, minlength=len(first)).tolist()
    return message_classes, message_counts, _grouped(n, msg_src, msg_to, msg_class)


def _device_order(is_collective: np.ndarray, offsets: list, local: tuple, num_waits: np.ndarray
                  ) -> tuple[list, list, list]:
    """(each action's next on its device (-1: the last), each action's dependents on its own
    device, how many things each waits for). A compute action's successor waits for its end;
    a REDUCE frees the stream when issued (the event loop's)."""
    n = len(is_collective)
    next_on_device = np.arange(1, n + 1)
    firsts = [lo for lo, hi in zip(offsets, offsets[1:]) if hi > lo]
    lasts = [hi - 1 for lo, hi in zip(offsets, offsets[1:]) if hi > lo]
    next_on_device[lasts] = -1
    num_waits = num_waits + 1
    num_waits[firsts] -= 1
    frees = np.flatnonzero((next_on_device >= 0) & ~is_collective)
    local_out = _grouped(n, np.concatenate([local[0], frees]), np.concatenate([local[1], frees + 1]))
    return next_on_device.tolist(), local_out, num_waits.tolist()


def _grouped(n: int, keys: np.ndarray, *columns: np.ndarray) -> list[list]:
    """The rows of ``columns`` in one list per key 0 .. n - 1 (``keys`` says whose each
    row is), each list in the rows' order; a row is a value, or with several columns a
    tuple."""
    order = np.argsort(keys, kind="stable")
    ends = np.cumsum(np.bincount(keys, minlength=n)).tolist()
    rows = [c[order].tolist() for c in columns]
    rows = rows[0] if len(rows) == 1 else list(zip(*rows))
    return list(map(rows.__getitem__, map(slice, [0, *ends], ends)))


def _collective_groups(schedule: Schedule, resolver, actions: list, kind: list, index: dict) -> tuple[list, list]:
    """(each action's collective group, -1: none; each group's members): the replicas of
    a stage that issue one REDUCE (or GATHER) together, every one of them required."""
    group_of = [-1] * len(actions)
    groups: list[list[int]] = []
    for i in [i for i, k in enumerate(kind) if k in Kind.COLLECTIVE]:
        if group_of[i] >= 0:
            continue
        members = []
        for r in resolver.reduce_group(actions[i]):
            j = index.get(r)
            if j is None:
                raise SimulationError(
                    f"schedule {schedule.name!r}: {actions[i]} is a collective with {r}, which is not in the "
                    f"schedule, so it would wait forever; every replica of a stage must issue its REDUCE (and GATHER)"
                )
            members.append(j)
        for j in members:
            group_of[j] = len(groups)
        groups.append(members)
    return group_of, groups
