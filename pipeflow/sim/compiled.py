"""A schedule compiled for the simulator: integer ids and flat lists, once per schedule
(reusable across cost models and topologies); see :mod:`pipeflow.sim.engine`."""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import itemgetter

from ..schedules.deps import DepResolver
from ..schedules.ir import Action, Kind, Schedule
from ..schedules.versions import VersionRecord


class SimulationError(RuntimeError):
    """The schedule cannot be simulated as given (missing dependency, deadlock, or a
    topology that does not fit). The message says what to change."""


@contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector while we allocate.

    Compiling and simulating create hundreds of thousands of small tuples and lists
    and no reference cycles; left on, the collector rescans the growing heap again and
    again and takes about 40% of the time of a 64 x 1024 simulation.
    """
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
    """The schedule as integer ids and flat lists; independent of cost and topology.

    Actions are numbered device by device, each device's list in order, so the actions
    of device ``d`` are ids ``offsets[d]`` to ``offsets[d + 1] - 1``. Messages are
    grouped into classes (same devices, same stages, same segment, same direction) so
    that each class is priced once.
    """

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
    """Number the actions and turn DepResolver's dependencies into dependent lists.

    Compile once and pass the result to :func:`simulate` as often as needed: it does
    not depend on the cost model or the topology.
    """
    with _gc_paused():
        return _compile(schedule)


def _compile(schedule: Schedule) -> CompiledSchedule:
    resolver = DepResolver(schedule)
    actions, device, offsets, index = _numbered(schedule)
    kind = list(map(itemgetter(0), actions))
    stage = list(map(itemgetter(1), actions))
    segment = list(map(itemgetter(4), actions))
    local_out, msg_src, msg_dst, msg_to, num_waits = _dependents(schedule, resolver, actions, device, index)
    message_classes, message_counts, tensor_out = _messages(len(actions), kind, stage, segment, device,
                                                            msg_src, msg_dst, msg_to)
    next_on_device = _device_order(kind, offsets, local_out, num_waits)
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
    """Dependencies -> dependents: (each action's dependents on its own device, the
    messages' (source, consumer, waiter) numbers, how many things each action waits for).
    This loop runs once per dependency (a quarter of a million for 64 x 1024), so it only
    sorts edges; messages are classified in bulk (:func:`_messages`)."""
    n = len(actions)
    local_out: list[list[int]] = [[] for _ in range(n)]
    msg_src: list[int] = []
    msg_dst: list[int] = []
    msg_to: list[int] = []  # who waits for the message: its consumer, or the pair's forward
    num_waits = [0] * n
    # an overlapped pair starts when both halves are ready: what its backward waits for,
    # its forward waits for instead (the backward follows the forward on the stream)
    waiter = list(range(n))
    for f, b in schedule.overlapped:
        if f in index and b in index:
            waiter[index[b]] = index[f]
    c = -1
    try:
        for c, dep_list in enumerate(map(resolver.deps, actions)):
            dc = device[c]
            w = waiter[c]
            for dep_action, carries in dep_list:
                p = index[dep_action]
                if p == w:
                    continue  # a pair's backward does not wait for its own forward
                num_waits[w] += 1
                if carries and device[p] != dc:
                    msg_src.append(p)
                    msg_dst.append(c)
                    msg_to.append(w)
                else:
                    local_out[p].append(w)
    except KeyError:
        missing = [str(d.action) for d in resolver.deps(actions[c]) if d.action not in index]
        if not missing:
            raise
        raise SimulationError(
            f"schedule {schedule.name!r}: {actions[c]} on device {device[c]} depends on {', '.join(missing)}, "
            f"which is not in the schedule; run pipeflow.schedules.validate(schedule) first"
        ) from None
    return local_out, msg_src, msg_dst, msg_to, num_waits


def _messages(n: int, kind: list, stage: list, segment: list, device: list, msg_src: list, msg_dst: list,
              msg_to: list) -> tuple[list, list, list]:
    """The messages by class: (the classes, how many of each, each action's messages
    out as (waiter, class)). A message class is (src device, dst device, src stage, dst
    stage, segment) of the forward edge: activations flow along graph edges (the
    producer is an F), gradients against them with the same size."""
    keys = [
        (device[p], device[c], stage[p], stage[c], segment[p])
        if kind[p] == Kind.F
        else (device[p], device[c], stage[c], stage[p], segment[p])
        for p, c in zip(msg_src, msg_dst)
    ]
    class_of: dict[tuple, int] = {}
    msg_class = [class_of.setdefault(k, len(class_of)) for k in keys]
    message_classes = list(class_of)
    message_counts = [0] * len(message_classes)
    for mc, count in Counter(msg_class).items():
        message_counts[mc] = count
    tensor_out: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for p, c, mc in zip(msg_src, msg_to, msg_class):
        tensor_out[p].append((c, mc))
    return message_classes, message_counts, tensor_out


def _device_order(kind: list, offsets: list, local_out: list, num_waits: list) -> list[int]:
    """Each action's next on its device (-1: the last). The device predecessor is one
    more thing to wait for. A compute action frees the stream when it ends; a REDUCE
    frees it when issued (handled in the event loop)."""
    n = len(kind)
    next_on_device = list(range(1, n + 1))
    for d in range(len(offsets) - 1):
        lo, hi = offsets[d], offsets[d + 1]
        if hi > lo:
            next_on_device[hi - 1] = -1
            num_waits[lo + 1 : hi] = [w + 1 for w in num_waits[lo + 1 : hi]]
    for p, c in zip(range(n), next_on_device):
        if c >= 0 and kind[p] not in Kind.COLLECTIVE:
            local_out[p].append(c)
    return next_on_device


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
