"""Deterministic discrete-event simulator: schedule + cost model + topology -> timing.

The rules (tests compare them with closed forms, so they are exact, not approximate):

- Each device has one compute stream. Its F, B, I, W and STEP actions run one at a
  time in list order; an action starts at the latest of "the stream is free" and
  "every dependency is resolved" (dependencies come from :class:`DepResolver`, the
  one place they are derived). Durations come from ``cost.compute_time``.
- A dependency on the same device is resolved when it ends. A cross-device
  dependency that carries a tensor is a message: it leaves when its producer ends,
  holds every resource (link, switch, NIC) of ``topology.route(src, dst)`` for
  ``bytes / bandwidth`` from the moment all of them are free, and arrives ``latency``
  after that. Resources are granted in the order producers finish (a time-ordered
  event heap, ties broken by action id), so contention is first-come-first-served.
- REDUCE does not occupy the compute stream: once the device reaches it and its
  dependencies are resolved, it is issued and the device moves on (the all-reduce
  overlaps later work, as Chimera does). When every replica has issued it, the
  collective runs on the members' collective streams for
  ``topology.allreduce_time(devices, cost.param_bytes(stage))``; all members' REDUCEs
  end together. With one replica a REDUCE is a zero-time no-op.

Weight versions (asynchronous schedules) change no timing. The simulator follows each
device's list, so the version every forward and backward sees is the one
:func:`pipeflow.schedules.versions.weight_versions` derives from the lists; the result
carries those records (``versions``) and their summary (``summary()["staleness"]``).
Weight memory follows the policy: every (pipe, stage) replica keeps its live version,
plus (stash) every older version an in-flight microbatch's forward used until its
backward, or (double_buffer) the previous version once it has been updated; sync, none
and bounded keep the live version only. ``optimizer_bytes`` is what model state adds
to the weights (``cost.model_state_bytes - cost.param_bytes`` per replica), held only
by the owner device of each stage (:func:`pipeflow.schedules.zero.zero_owners`) when
the schedule's ``zero`` is set.

Branched models (``graph.branch`` labels, e.g. a concurrent-branch model's "vision",
"text" and "head" stages) get a multi-branch view: ``DeviceStats.busy_by_branch`` splits
each device's busy time by the branch of the stage it worked on, and, with
``record=True``, ``SimResult.waits`` explains every idle gap of every compute stream
(:class:`Wait`, summed per device into ``DeviceStats.idle_by_cause``). A gap before an
action is charged to the dependency that resolved last -- by definition the one that set
the action's start -- classified as:

- ``interaction``: an activation or gradient message from another device along an edge
  between two different branches, neither of them the head (cross-attention, fusion);
- ``head``: a message along an edge into the head (the join of the branches);
- ``chain``: a message along an edge within one branch (every edge of an unlabelled
  graph is a chain edge);
- ``reduce``: a gradient all-reduce (a STEP waiting for its REDUCE's collective);
- ``stream``: anything else on the device itself (its own list order, a dependency that
  carries no message);
- ``drain``: the tail after the device's last action, until the iteration ends.

When several dependencies resolve at the same instant the gap goes to the first of
interaction, head, chain, reduce, stream (each of them alone would have held the action).
The waits are derived after the event loop from the recorded times and transfers, so the
``record=False`` fast path does no extra work.

Speed matters because the planner calls this in its inner loop: the schedule is
compiled once into integer ids and flat lists (:func:`compile_schedule`, reusable
across cost models and topologies), every duration and message is priced once, and the
event loop touches only lists of ints and floats.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

from ..schedules.deps import DepResolver
from ..schedules.ir import Action, Kind, Schedule, WeightPolicy
from ..schedules.versions import VersionRecord, summarize, weight_versions
from ..schedules.zero import zero_owners
from .timeline import Event, Timeline

__all__ = [
    "WAIT_KINDS",
    "classify_edge",
    "CompiledSchedule",
    "DeviceStats",
    "SimResult",
    "SimulationError",
    "Wait",
    "compile_schedule",
    "simulate",
]

# what an idle gap of a compute stream waited for (see the module doc), in tie-break order
WAIT_KINDS = ("interaction", "head", "chain", "reduce", "stream", "drain")


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
    kind = list(map(itemgetter(0), actions))
    stage = list(map(itemgetter(1), actions))
    segment = list(map(itemgetter(4), actions))

    # Dependencies -> dependents. This loop runs once per dependency (a quarter of a
    # million for 64 x 1024), so it only sorts edges; messages are classified in bulk below.
    local_out: list[list[int]] = [[] for _ in range(n)]
    msg_src: list[int] = []
    msg_dst: list[int] = []
    num_waits = [0] * n
    c = -1
    try:
        for c, dep_list in enumerate(map(resolver.deps, actions)):
            dc = device[c]
            num_waits[c] = len(dep_list)
            for dep_action, carries in dep_list:
                p = index[dep_action]
                if carries and device[p] != dc:
                    msg_src.append(p)
                    msg_dst.append(c)
                else:
                    local_out[p].append(c)
    except KeyError:
        missing = [str(d.action) for d in resolver.deps(actions[c]) if d.action not in index]
        if not missing:
            raise
        raise SimulationError(
            f"schedule {schedule.name!r}: {actions[c]} on device {device[c]} depends on {', '.join(missing)}, "
            f"which is not in the schedule; run pipeflow.schedules.validate(schedule) first"
        ) from None

    # A message class is (src device, dst device, src stage, dst stage, segment) of the
    # forward edge: activations flow along graph edges (the producer is an F), gradients
    # against them with the same size.
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
    for p, c, mc in zip(msg_src, msg_dst, msg_class):
        tensor_out[p].append((c, mc))

    # The device predecessor is one more thing to wait for. A compute action frees the
    # stream when it ends; a REDUCE frees it when issued (handled in the event loop).
    next_on_device = list(range(1, n + 1))
    for d in range(len(offsets) - 1):
        lo, hi = offsets[d], offsets[d + 1]
        if hi > lo:
            next_on_device[hi - 1] = -1
            num_waits[lo + 1 : hi] = [w + 1 for w in num_waits[lo + 1 : hi]]
    for p, c in zip(range(n), next_on_device):
        if c >= 0 and kind[p] != Kind.REDUCE:
            local_out[p].append(c)

    group_of = [-1] * n
    groups: list[list[int]] = []
    for i in [i for i, k in enumerate(kind) if k == Kind.REDUCE]:
        if group_of[i] >= 0:
            continue
        members = []
        for r in resolver.reduce_group(actions[i]):
            j = index.get(r)
            if j is None:
                raise SimulationError(
                    f"schedule {schedule.name!r}: {actions[i]} is an all-reduce with {r}, which is not in the "
                    f"schedule, so it would wait forever; every replica of a stage must issue its REDUCE"
                )
            members.append(j)
        for j in members:
            group_of[j] = len(groups)
        groups.append(members)

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


# --------------------------------------------------------------------------- results
@dataclass
class DeviceStats:
    device: int
    busy: float  # compute-stream time (F, B, I, W, STEP)
    idle: float  # makespan - busy
    utilization: float  # busy / makespan
    peak_activation_bytes: float
    peak_live_microbatches: float  # (microbatch, stage, segment) in flight / segments
    sent_bytes: float  # point-to-point activations and gradients sent
    recv_bytes: float
    collective_bytes: float  # gradient bytes this device all-reduced
    num_actions: int
    peak_weight_versions: int = 0  # most weight versions one of its replicas keeps at once
    weight_bytes: float = 0.0  # peak over time of the weight bytes of all its replicas' versions
    optimizer_bytes: float = 0.0  # gradients and optimizer state (model state beyond the weights)
    # branch label -> compute time of this device's actions on stages of that branch (every
    # label of the graph, in the graph's order); empty for an unlabelled graph
    busy_by_branch: dict[str, float] = field(default_factory=dict)
    # wait kind (WAIT_KINDS) -> idle time charged to it; sums to ``idle``. Filled only
    # with record=True (empty otherwise)
    idle_by_cause: dict[str, float] = field(default_factory=dict)


class Wait(NamedTuple):
    """One idle gap of a device's compute stream and what ended it.

    ``action`` waited from ``start`` to ``end`` (it started at ``end``); ``cause`` is the
    dependency that resolved last, on ``cause_device``, and ``message`` says whether it
    reached this device as an activation or gradient message. ``kind`` is one of
    :data:`WAIT_KINDS`. The gap after a device's last action is a ``drain`` wait with no
    action and no cause.
    """

    device: int
    start: float
    end: float
    action: Action | None
    cause: Action | None
    cause_device: int
    kind: str
    message: bool = False

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "start": self.start,
            "end": self.end,
            "action": None if self.action is None else str(self.action),
            "cause": None if self.cause is None else str(self.cause),
            "cause_device": self.cause_device,
            "kind": self.kind,
            "message": self.message,
        }


_BRANCH_VIEW = ("busy_by_branch", "idle_by_cause")


@dataclass
class SimResult:
    schedule: str
    num_devices: int
    num_stages: int
    num_microbatches: int
    makespan: float
    bubble_ratio: float
    per_device: list[DeviceStats]
    p2p_bytes: float  # total point-to-point payload
    collective_bytes: float  # total gradient bytes all-reduced, summed over members
    timeline: Timeline | None = None
    topology: str = ""
    cost: object = None  # cost.describe()
    # achieved times, indexed like ``actions`` (device by device, in list order). For a
    # REDUCE, start/end are the collective's; ``issued`` holds when the device issued it.
    actions: list[Action] = field(default_factory=list, repr=False)
    start: list[float] = field(default_factory=list, repr=False)
    end: list[float] = field(default_factory=list, repr=False)
    issued: dict[Action, float] = field(default_factory=dict, repr=False)
    # weight version each forward and backward saw (empty for synchronous schedules: all 0)
    versions: list[VersionRecord] = field(default_factory=list, repr=False)
    staleness: dict = field(default_factory=lambda: summarize([]))
    # asynchronous schedules: microbatches per update window, windows simulated, updates
    microbatches_per_step: int | None = None
    windows: int | None = None
    updates: int = 1
    # every idle gap of every compute stream and its cause (record=True only), device by
    # device in time order; see :class:`Wait`
    waits: list[Wait] = field(default_factory=list, repr=False)
    branches: tuple[str, ...] = ()  # the graph's branch labels per stage (empty: unlabelled)

    @property
    def peak_activation_bytes(self) -> float:
        return max((d.peak_activation_bytes for d in self.per_device), default=0.0)

    def times(self) -> dict[Action, tuple[float, float]]:
        """Action -> (start, end)."""
        return {a: (s, e) for a, s, e in zip(self.actions, self.start, self.end)}

    def time_of(self, action: Action | str) -> tuple[float, float]:
        a = Action.parse(action) if isinstance(action, str) else action
        try:
            i = self.actions.index(a)
        except ValueError:
            raise KeyError(f"{a} is not an action of schedule {self.schedule!r}") from None
        return self.start[i], self.end[i]

    def summary(self) -> dict:
        """JSON-able metrics (no per-action times).

        For a branched graph every device also carries ``busy_by_branch`` and (with
        record=True) ``idle_by_cause``, and their sums over devices come at the top
        level; for an unlabelled graph these are left out, so the summary does not
        depend on ``record``."""
        branched = bool(self.branches)
        cost = self.cost
        if not isinstance(cost, (dict, str, int, float, type(None))):
            cost = str(cost)
        out = {
            "schedule": self.schedule,
            "topology": self.topology,
            "cost": cost,
            "num_devices": self.num_devices,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "peak_activation_bytes": self.peak_activation_bytes,
            "p2p_bytes": self.p2p_bytes,
            "collective_bytes": self.collective_bytes,
            "staleness": dict(self.staleness),
            "per_device": [
                {k: dict(v) if isinstance(v, dict) else v
                 for k, v in vars(d).items() if branched or k not in _BRANCH_VIEW}
                for d in self.per_device
            ],
        }
        by_branch: dict[str, float] = {}
        by_cause: dict[str, float] = {}
        for d in self.per_device if branched else ():
            for k, v in d.busy_by_branch.items():
                by_branch[k] = by_branch.get(k, 0.0) + v
            for k, v in d.idle_by_cause.items():
                by_cause[k] = by_cause.get(k, 0.0) + v
        if by_branch:
            out["busy_by_branch"] = by_branch  # summed over devices
        if by_cause:
            out["idle_by_cause"] = by_cause
        if self.microbatches_per_step is not None:
            out["microbatches_per_step"] = self.microbatches_per_step
            out["windows"] = self.windows
            out["updates"] = self.updates
        return out


# --------------------------------------------------------------------------- simulate
def simulate(
    schedule: Schedule | CompiledSchedule, cost, topology, record: bool = True
) -> SimResult:
    """Run ``schedule`` on ``topology`` with durations and sizes from ``cost``.

    ``schedule`` may be compiled already (:func:`compile_schedule`) to price one
    schedule under many cost models or topologies. ``record=False`` skips building the
    timeline and the idle-gap analysis (``waits``, ``DeviceStats.idle_by_cause``); every
    other metric is still exact.
    """
    with _gc_paused():
        cs = schedule if isinstance(schedule, CompiledSchedule) else _compile(schedule)
        return _simulate(cs, cost, topology, record)


def _simulate(cs: CompiledSchedule, cost, topology, record: bool) -> SimResult:
    sched = cs.schedule
    ndev = cs.num_devices
    if topology.num_devices < ndev:
        raise SimulationError(
            f"schedule {sched.name!r} needs {ndev} devices but topology {topology.name!r} has "
            f"{topology.num_devices}; pick a larger topology (e.g. get_topology(name, num_devices={ndev}))"
        )
    devices = topology.devices
    actions, kind, stage, segment, device = cs.actions, cs.kind, cs.stage, cs.segment, cs.device
    n = len(actions)

    # ---- price every action once: durations are cached per (kind, stage, segment, device)
    dur = [0.0] * n
    dcache: dict[tuple, float] = {}
    for i in range(n):
        k = kind[i]
        if k == Kind.REDUCE:
            continue
        key = (k, stage[i], segment[i], device[i])
        v = dcache.get(key)
        if v is None:
            v = float(cost.compute_time(k, stage[i], segment[i], devices[device[i]]))
            if not 0.0 <= v < math.inf:
                raise SimulationError(
                    f"cost model {type(cost).__name__} gave {k} of stage {stage[i]} (segment {segment[i]}) "
                    f"on device {device[i]} a duration of {v}; durations must be finite and >= 0"
                )
            dcache[key] = v
        dur[i] = v

    # ---- the synchronisation a synchronous step runs on each rank before its first STEP
    # (the runtime's world all-reduce of the gradient norm and the loss, with the tied
    # embedding's): once per device, however many stages the device holds; asynchronous
    # schedules update stage by stage without it
    sync = float(getattr(cost, "step_sync", 0.0) or 0.0)
    if sync > 0 and sched.policy == WeightPolicy.SYNC:
        for d in range(ndev):
            first = next((i for i in range(cs.offsets[d], cs.offsets[d + 1]) if kind[i] == Kind.STEP), None)
            if first is not None:
                dur[first] += sync

    # ---- the host time of a message on its sender's and its receiver's compute (CPU ranks)
    host = float(getattr(topology, "message_host", 0.0) or 0.0)
    if host > 0:
        for a in range(n):
            for c, _mc in cs.tensor_out[a]:
                dur[a] += host
                dur[c] += host

    # ---- price every message class once: (transfer time, latency, resource slots, bytes)
    slot_of: dict = {}  # topology resource id -> index into ``free``
    specs: list[tuple[float, float, tuple[int, ...], float]] = []
    sent = [0.0] * ndev
    recv = [0.0] * ndev
    fixed_time = getattr(cost, "message_time", None)
    if fixed_time is not None:
        fixed_time = float(fixed_time)
    for (dp, dc, src_stage, dst_stage, seg), count in zip(cs.message_classes, cs.message_counts):
        nbytes = float(cost.message_bytes(src_stage, dst_stage, seg))
        route = topology.route(dp, dc)
        if not route.bandwidth > 0:
            raise SimulationError(
                f"topology {topology.name!r}: the route from device {dp} to device {dc} has "
                f"bandwidth {route.bandwidth}; every route between devices needs a bandwidth > 0"
            )
        if fixed_time is not None:
            # the cost model prices messages itself (unit costs): no link is occupied
            specs.append((0.0, fixed_time, (), nbytes))
        else:
            xfer = nbytes / route.bandwidth
            # a message that takes no link time (zero bytes, infinite links) reserves nothing
            slots = tuple(slot_of.setdefault(r, len(slot_of)) for r in route.resources) if xfer > 0 else ()
            specs.append((xfer, float(route.latency), slots, nbytes))
        sent[dp] += nbytes * count
        recv[dc] += nbytes * count

    # ---- price every collective once
    groups = cs.groups
    gdur = [0.0] * len(groups)
    gdevs: list[tuple[int, ...]] = []
    gbytes = [0.0] * len(groups)
    coll_bytes = [0.0] * ndev
    for g, members in enumerate(groups):
        devs = tuple(sorted({device[m] for m in members}))
        gdevs.append(devs)
        if len(devs) < 2:
            continue  # one replica (or all on one device): nothing to exchange
        nbytes = float(cost.param_bytes(stage[members[0]]))
        gbytes[g] = nbytes
        gdur[g] = float(topology.allreduce_time(list(devs), nbytes))
        for d in devs:
            coll_bytes[d] += nbytes

    # ---- the event loop
    run = _events_shared if topology.shares_compute else _events
    start, end, issue_time, transfers, num_launched, now, waits = run(
        cs, dur, specs, len(slot_of), groups, gdevs, gdur, record, topology)
    if num_launched < n:
        raise SimulationError(_deadlock_message(cs, waits))
    if topology.shares_compute:
        dur = [e - s if k != Kind.REDUCE else 0.0 for s, e, k in zip(start, end, kind)]  # busy = elapsed
    makespan = now if n else 0.0

    # ---- weights: versions seen (asynchronous policies), versions kept, optimizer state
    versions = _versions(cs)
    weights = _weight_memory(cs, cost)

    # ---- memory: walk each device's list in order (its events are time-ordered there)
    act_cache: dict[tuple[int, int], tuple[float, float]] = {}
    per_device: list[DeviceStats] = []
    nseg = max(1, sched.num_segments)
    total_busy = 0.0
    labels = sched.graph.branch
    label_order = tuple(dict.fromkeys(labels))
    for d in range(ndev):
        lo, hi = cs.offsets[d], cs.offsets[d + 1]
        busy = sum(dur[lo:hi])
        by_branch: dict[str, float] = {}
        if labels:
            by_branch = dict.fromkeys(label_order, 0.0)
            for i in range(lo, hi):
                by_branch[labels[stage[i]]] += dur[i]
        cur = peak = 0.0
        live = peak_live = 0
        last = -math.inf
        for i in range(lo, hi):
            k = kind[i]
            if k not in Kind.COMPUTE:
                continue
            key = (stage[i], segment[i])
            sizes = act_cache.get(key)
            if sizes is None:
                sizes = act_cache[key] = (
                    float(cost.activation_bytes(*key)),
                    float(cost.weight_residual_bytes(*key)),
                )
            if k == Kind.F:
                t, delta, dlive = start[i], sizes[0], 1
            elif k == Kind.B:
                t, delta, dlive = end[i], -sizes[0], -1
            elif k == Kind.I:
                t, delta, dlive = end[i], sizes[1] - sizes[0], -1
            else:  # W
                t, delta, dlive = end[i], -sizes[1], 0
            # Frees come before allocations at equal times, so the level that counts at
            # a time stamp is the one after all its events: take the peak when time moves.
            if t > last:
                if cur > peak:
                    peak = cur
                if live > peak_live:
                    peak_live = live
                last = t
            cur += delta
            live += dlive
        peak = max(peak, cur)
        peak_live = max(peak_live, live)
        total_busy += busy
        nver, wbytes, obytes = weights[d]
        per_device.append(
            DeviceStats(
                device=d,
                busy=busy,
                idle=makespan - busy,
                utilization=busy / makespan if makespan > 0 else 0.0,
                peak_activation_bytes=peak,
                peak_live_microbatches=peak_live / nseg,
                sent_bytes=sent[d],
                recv_bytes=recv[d],
                collective_bytes=coll_bytes[d],
                num_actions=cs.offsets[d + 1] - cs.offsets[d],
                peak_weight_versions=nver,
                weight_bytes=wbytes,
                optimizer_bytes=obytes,
                busy_by_branch=by_branch,
            )
        )
    bubble = 1.0 - total_busy / (ndev * makespan) if makespan > 0 and ndev else 0.0

    describe = getattr(cost, "describe", None)
    result = SimResult(
        schedule=sched.name,
        num_devices=ndev,
        num_stages=sched.num_stages,
        num_microbatches=sched.num_microbatches,
        makespan=makespan,
        bubble_ratio=bubble,
        per_device=per_device,
        p2p_bytes=sum(sent),
        collective_bytes=sum(coll_bytes),
        topology=getattr(topology, "name", ""),
        cost=describe() if callable(describe) else None,
        actions=actions,
        start=start,
        end=end,
        issued={actions[i]: t for i, t in issue_time.items()},
        versions=versions,
        staleness=summarize(versions),
        branches=tuple(labels),
    )
    if sched.policy != WeightPolicy.SYNC:
        result.microbatches_per_step = sched.microbatches_per_step
        result.windows = sched.windows
        result.updates = len(set(sched.update_of_microbatch))
    if record:
        result.waits = waits = _waits(cs, start, end, issue_time, transfers or [], makespan)
        for st in per_device:
            st.idle_by_cause = dict.fromkeys(WAIT_KINDS, 0.0)
        for w in waits:
            per_device[w.device].idle_by_cause[w.kind] += w.end - w.start
        result.timeline = _timeline(cs, start, end, issue_time, gbytes, transfers or [], result,
                                    getattr(cost, "time_unit", "s"))
    return result



def _collective_span(members, issue_time: dict, devs: tuple, duration: float, coll_free: list) -> tuple[float, float]:
    """(start, end) of a REDUCE group's collective: it starts once every replica has
    issued it and every device in it is done with its previous collective; one replica
    (or all on one device) has nothing to reduce."""
    s = max(issue_time[m] for m in members)
    if len(devs) < 2:
        return s, s
    for d in devs:
        if coll_free[d] > s:
            s = coll_free[d]
    e = s + duration
    for d in devs:
        coll_free[d] = e
    return s, e


def _events(cs: CompiledSchedule, dur, specs, num_slots, groups, gdevs, gdur, record, topology):
    """The event loop of devices that compute independently (every GPU, CPU ranks with a
    core each): an action's end is known when it starts. Returns (start, end,
    issue_time, transfers, actions launched, makespan, waits left)."""
    n, ndev, kind = len(cs.actions), cs.num_devices, cs.kind
    # Heap entries are (time, key). key < n: compute action ``key`` ended.
    # n <= key < 2n: REDUCE ``key - n`` was issued. key >= 2n: REDUCE ``key - 2n`` done.
    # Keys are unique, so equal times pop in key order: deterministic.
    n2 = 2 * n
    launch_key = [i + n if k == Kind.REDUCE else i for i, k in enumerate(kind)]
    ready = [0.0] * n
    waits = cs.num_waits.copy()
    start = [0.0] * n
    end = [0.0] * n
    free = [0.0] * num_slots
    coll_free = [0.0] * ndev
    left = [len(m) for m in groups]
    issue_time: dict[int, float] = {}
    local_out, tensor_out = cs.local_out, cs.tensor_out
    next_on_device, group_of = cs.next_on_device, cs.group_of
    transfers: list[tuple] | None = [] if record else None
    push, pop = heapq.heappush, heapq.heappop

    heap: list[tuple[float, int]] = []
    num_launched = 0
    for d in range(ndev):
        c = cs.offsets[d]
        if c < cs.offsets[d + 1] and waits[c] == 0:
            # launching = taking the stream at the latest resolved dependency; a REDUCE
            # has no duration there, its "end" is the moment it is issued
            end[c] = dur[c]
            push(heap, (dur[c], launch_key[c]))
            num_launched += 1
    now = 0.0
    while heap:
        now, a = pop(heap)
        if a >= n:
            if a >= n2:
                a -= n2  # a REDUCE's collective finished: resolve what waits for it below
            else:
                a -= n
                # a REDUCE was issued: the device moves on at once ...
                issue_time[a] = now
                c = next_on_device[a]
                if c >= 0:
                    if ready[c] < now:
                        ready[c] = now
                    waits[c] -= 1
                    if not waits[c]:
                        s = ready[c]
                        start[c] = s
                        end[c] = s + dur[c]
                        push(heap, (s + dur[c], launch_key[c]))
                        num_launched += 1
                # ... and the collective starts once every replica has issued it
                g = group_of[a]
                left[g] -= 1
                if not left[g]:
                    members = groups[g]
                    s, e = _collective_span(members, issue_time, gdevs[g], gdur[g], coll_free)
                    for m in members:
                        start[m] = s
                        end[m] = e
                        push(heap, (e, m + n2))
                continue
        # ``a`` is done at ``now``: resolve what waits for it
        for c in local_out[a]:
            if ready[c] < now:
                ready[c] = now
            w = waits[c] - 1
            waits[c] = w
            if not w:
                s = ready[c]
                start[c] = s
                end[c] = s + dur[c]
                push(heap, (s + dur[c], launch_key[c]))
                num_launched += 1
        for c, mc in tensor_out[a]:
            xfer, lat, slots, nbytes = specs[mc]
            s = now
            for r in slots:
                if free[r] > s:
                    s = free[r]
            e = s + xfer
            for r in slots:
                free[r] = e
            arrive = e + lat
            if transfers is not None:
                transfers.append((a, c, s, arrive, nbytes))
            if ready[c] < arrive:
                ready[c] = arrive
            w = waits[c] - 1
            waits[c] = w
            if not w:
                s = ready[c]
                start[c] = s
                end[c] = s + dur[c]
                push(heap, (s + dur[c], launch_key[c]))
                num_launched += 1

    if num_launched < n:
        raise SimulationError(_deadlock_message(cs, waits))
    return start, end, issue_time, transfers, num_launched, now, waits


def _events_shared(cs: CompiledSchedule, dur, specs, num_slots, groups, gdevs, gdur, record, topology):
    """The event loop of devices that share a host's cores (:meth:`Topology.compute_rate`):
    processor sharing. A compute action is work of ``dur`` seconds at full speed; while
    k devices compute, each progresses at ``compute_rate(k)``, so an action's end is
    known only when no other starts or ends before it. Messages, REDUCE and the
    resolution of dependencies follow :func:`_events` exactly. Slower than that loop
    (it scans the running actions at every event), and used only for shared hosts,
    which hold a handful of ranks."""
    n, ndev, kind = len(cs.actions), cs.num_devices, cs.kind
    n2, n3 = 2 * n, 3 * n
    # Heap keys: k < n: compute action k starts; n <= k < 2n: REDUCE k - n issued;
    # 2n <= k < 3n: REDUCE k - 2n done. Compute ends are not in the heap: they move.
    launch_key = [i + n if k == Kind.REDUCE else i for i, k in enumerate(kind)]
    ready = [0.0] * n
    waits = cs.num_waits.copy()
    start = [0.0] * n
    end = [0.0] * n
    free = [0.0] * num_slots
    coll_free = [0.0] * ndev
    left = [len(m) for m in groups]
    issue_time: dict[int, float] = {}
    local_out, tensor_out = cs.local_out, cs.tensor_out
    next_on_device, group_of = cs.next_on_device, cs.group_of
    transfers: list[tuple] | None = [] if record else None
    push, pop = heapq.heappush, heapq.heappop
    rate_of = [topology.compute_rate(k) for k in range(ndev + 1)]
    heap: list[tuple[float, int]] = []
    running: dict[int, float] = {}  # compute action -> work left (seconds at full speed)
    finished: list[int] = []  # compute actions of zero work, done when launched
    num_launched = 0
    now = 0.0

    def launch(c: int, s: float) -> None:
        nonlocal num_launched
        num_launched += 1
        start[c] = s
        if kind[c] == Kind.REDUCE:
            end[c] = s
            push(heap, (s, launch_key[c]))
        else:
            push(heap, (s, c))

    def resolved(c: int, t: float) -> None:
        if ready[c] < t:
            ready[c] = t
        waits[c] -= 1
        if not waits[c]:
            launch(c, ready[c])

    def done(a: int) -> None:
        for c in local_out[a]:
            resolved(c, now)
        for c, mc in tensor_out[a]:
            xfer, lat, slots, nbytes = specs[mc]
            s = now
            for r in slots:
                if free[r] > s:
                    s = free[r]
            e = s + xfer
            for r in slots:
                free[r] = e
            if transfers is not None:
                transfers.append((a, c, s, e + lat, nbytes))
            resolved(c, e + lat)

    for d in range(ndev):
        c = cs.offsets[d]
        if c < cs.offsets[d + 1] and waits[c] == 0:
            launch(c, 0.0)
    while heap or running:
        rate = rate_of[len(running)]
        if running:
            a = min(running, key=running.__getitem__)
            t_end = now + running[a] / rate
        if running and (not heap or t_end < heap[0][0]):
            step = (t_end - now) * rate
            for c in running:
                running[c] -= step
            now = t_end
            del running[a]
            end[a] = now
            done(a)
            continue
        t, a = pop(heap)
        if running:
            step = (t - now) * rate
            for c in running:
                running[c] -= step
        now = t
        if a < n:  # a compute action starts
            if dur[a] > 0:
                running[a] = dur[a]
            else:
                end[a] = now
                done(a)
        elif a < n2:  # a REDUCE is issued: the device moves on, the collective waits for all replicas
            a -= n
            issue_time[a] = now
            c = next_on_device[a]
            if c >= 0:
                resolved(c, now)
            g = group_of[a]
            left[g] -= 1
            if not left[g]:
                members = groups[g]
                s, e = _collective_span(members, issue_time, gdevs[g], gdur[g], coll_free)
                for m in members:
                    start[m] = s
                    end[m] = e
                    push(heap, (e, m + n2))
        else:  # a REDUCE's collective finished
            done(a - n2)
    return start, end, issue_time, transfers, num_launched, now, waits


def classify_edge(branch: tuple[str, ...] | list[str], src_stage: int, dst_stage: int) -> str:
    """The wait kind of a message along graph edge ``src_stage -> dst_stage`` (an
    activation along it or a gradient against it): "head" into the head, "interaction"
    between two other branches, "chain" within one branch or in an unlabelled graph."""
    if not branch:
        return "chain"
    a, b = branch[src_stage], branch[dst_stage]
    if a == "head" or b == "head":
        return "head"
    return "chain" if a == b else "interaction"


def _waits(cs: CompiledSchedule, start, end, issue_time: dict[int, float], transfers, makespan: float) -> list[Wait]:
    """Every idle gap of every compute stream (REDUCE is not on it) and its cause.

    The action after a gap started at the latest of its dependencies' resolution times
    and its device predecessor's release (see the event loop), so one of them equals its
    start exactly: a message's arrival (``transfers``), a REDUCE's collective end, or the
    predecessor's release (a REDUCE releases the stream when issued). Candidates are
    gathered for the gap actions only; a gap that none of them explains (a same-device
    dependency, which cannot end after the previous action, would be one) falls back to
    the schedule's full dependency list. Ties go to the first kind of WAIT_KINDS.
    """
    actions, kind, stage, device, offsets = cs.actions, cs.kind, cs.stage, cs.device, cs.offsets
    branch = cs.schedule.graph.branch
    R, F = Kind.REDUCE, Kind.F
    new = tuple.__new__
    gaps: list[tuple[int, float, float, int]] = []  # device, from, to, waiting action (-1: drain)
    for d in range(cs.num_devices):
        prev = 0.0
        for i in range(offsets[d], offsets[d + 1]):
            if kind[i] == R:
                continue
            s = start[i]
            if s > prev:
                gaps.append((d, prev, s, i))
            prev = end[i]
        if makespan > prev:
            gaps.append((d, prev, makespan, -1))

    # the candidates that resolved exactly at each waiting action's start: (cause id, kind)
    # with kind None for a message (classified below, only when it is chosen)
    tied: dict[int, list[tuple[int, str | None]]] = {g[3]: [] for g in gaps if g[3] >= 0}
    if tied:
        for p, c, _, arrive, _ in transfers:
            lst = tied.get(c)
            if lst is not None and arrive == start[c]:
                lst.append((p, None))
        for members in cs.groups:
            for r in members:
                for c in cs.local_out[r]:
                    lst = tied.get(c)
                    if lst is not None and end[r] == start[c]:
                        lst.append((r, "reduce"))
        for c, lst in tied.items():
            q = c - 1  # the device predecessor: a REDUCE releases the stream when issued
            if q >= offsets[device[c]] and (issue_time.get(q, end[q]) if kind[q] == R else end[q]) == start[c]:
                lst.append((q, "stream"))

    rank = {k: r for r, k in enumerate(WAIT_KINDS)}
    resolver = None
    out: list[Wait] = []
    for d, a, b, c in gaps:
        if c < 0:
            out.append(new(Wait, (d, a, b, None, None, -1, "drain", False)))
            continue
        lst = tied[c]
        if not lst:  # not explained by a message, a collective or the stream: any dependency that ended then
            if resolver is None:
                resolver = DepResolver(cs.schedule)
            for dep, _ in resolver.deps(actions[c]):
                p = cs.index[dep]
                if end[p] == b:
                    lst.append((p, "reduce" if kind[p] == R else "stream"))
        best_p, best_kind, best_rank = -1, "stream", len(WAIT_KINDS)
        for p, k in lst:
            if k is None:
                # an activation along the edge, or a gradient against it
                src, dst = (stage[p], stage[c]) if kind[p] == F else (stage[c], stage[p])
                k = classify_edge(branch, src, dst)
            r = rank[k]
            if r < best_rank:
                best_p, best_kind, best_rank = p, k, r
        if best_p < 0:
            out.append(new(Wait, (d, a, b, actions[c], None, -1, "stream", False)))
        else:
            out.append(new(Wait, (d, a, b, actions[c], actions[best_p], device[best_p], best_kind,
                                  best_kind in ("interaction", "head", "chain") and device[best_p] != d)))
    return out


def _versions(cs: CompiledSchedule) -> list[VersionRecord]:
    """The weight version of every forward and backward, from the device lists (which the
    simulator follows); computed once per compiled schedule, and only for asynchronous
    policies (under sync every version is 0)."""
    if cs.versions is None:
        sched = cs.schedule
        if sched.policy == WeightPolicy.SYNC:
            cs.versions = []
        else:
            try:
                cs.versions = weight_versions(sched)
            except ValueError as err:
                raise SimulationError(str(err)) from None
    return cs.versions


def _weight_memory(cs: CompiledSchedule, cost) -> list[tuple[int, float, float]]:
    """Per device: (peak weight versions of one replica, peak weight bytes, optimizer bytes).

    Versions per (pipe, stage) replica, walking the device's list (its compute and STEP
    actions run in that order): the live version (STEPs so far) is always kept; under
    stash so is every version that an in-flight microbatch's forward used, until the
    backward that produces its input gradient (B or I); under double_buffer the
    previous version is kept once the replica has been updated. Other policies keep
    one version, so no walk is needed.
    """
    sched = cs.schedule
    placement = sched.placement
    policy = sched.policy
    pcache: dict[int, float] = {}

    def pbytes(stage: int) -> float:
        v = pcache.get(stage)
        if v is None:
            v = pcache[stage] = float(cost.param_bytes(stage))
        return v

    state_of = getattr(cost, "model_state_bytes", None)
    owners = zero_owners(placement) if sched.zero else None
    out = []
    for d in range(cs.num_devices):
        reps = placement.stages_on(d)
        base = sum(pbytes(s) for _, s in reps)
        # gradients and optimizer state: every replica's, or with ZeRO one per owned stage
        opt = 0.0
        if state_of is not None:
            held = reps if owners is None else [(0, s) for s in sorted({s for _, s in reps}) if owners[s] == d]
            for _, s in held:
                extra = float(state_of(s)) - pbytes(s)
                if extra > 0:
                    opt += extra
        peak_versions = 1 if reps else 0
        peak = total = base
        if policy == WeightPolicy.STASH or policy == WeightPolicy.DOUBLE_BUFFER:
            stash = policy == WeightPolicy.STASH
            live: dict[tuple[int, int], int] = {}
            count: dict[tuple[int, int], int] = {}
            users: dict[tuple[int, int], dict[int, int]] = {}  # version -> in-flight forwards
            fwd_version: dict[tuple, int] = {}
            for a in cs.actions[cs.offsets[d]:cs.offsets[d + 1]]:
                k = a[0]
                if k == Kind.STEP:
                    key = (a[3], a[1])
                    v = live.get(key, 0)
                    live[key] = v + 1
                    n = count.get(key, 1)
                    if stash:
                        grow = v in users.get(key, ())  # the old version still has a user
                    else:
                        grow = n < 2  # double buffer: the previous version is kept from now on
                    if grow:
                        n += 1
                        count[key] = n
                        total += pbytes(a[1])
                        if total > peak:
                            peak = total
                        if n > peak_versions:
                            peak_versions = n
                elif not stash:
                    continue
                elif k == Kind.F:
                    key = (a[3], a[1])
                    v = live.get(key, 0)
                    fwd_version[(key, a[2], a[4])] = v
                    u = users.setdefault(key, {})
                    u[v] = u.get(v, 0) + 1
                elif k in Kind.BACKWARD:
                    key = (a[3], a[1])
                    v = fwd_version.pop((key, a[2], a[4]), None)
                    if v is None:
                        continue
                    u = users[key]
                    left = u[v] - 1
                    if left:
                        u[v] = left
                    else:
                        del u[v]
                        if v != live.get(key, 0):  # the last user of an old version: free it
                            count[key] = count.get(key, 1) - 1
                            total -= pbytes(a[1])
        out.append((peak_versions, peak, opt))
    return out


def _timeline(cs: CompiledSchedule, start, end, issue_time, gbytes, transfers, result: SimResult,
              time_unit: str) -> Timeline:
    """Events for every action (compute or collective stream) and every transfer (comm).

    Compute events are built column-wise with map(), which keeps the quarter of a
    million events of a 64 x 1024 run at about the cost of the simulation itself.
    """
    actions, kind, stage, segment, device = cs.actions, cs.kind, cs.stage, cs.segment, cs.device
    names = list(map(str, actions))
    mb = list(map(itemgetter(2), actions))
    pipe = list(map(itemgetter(3), actions))
    version = list(map(itemgetter(5), actions))
    events: list[Event] = list(
        map(Event, device, names, kind, stage, mb, pipe, segment, start, end,
            repeat("compute"), repeat(-1), repeat(-1), repeat(0.0), version)
    )
    for i, g in enumerate(cs.group_of):
        if g >= 0:  # a REDUCE: its interval is the all-reduce, on the collective stream
            e = events[i]
            e.stream = "collective"
            e.nbytes = gbytes[g]
            e.extra = {"issued": issue_time[i]}
    events.extend(
        [
            Event(device[p], f"{names[p]}->{names[c]}", kind[p], stage[p], mb[p], pipe[p], segment[p], s, arrive,
                  "comm", device[p], device[c], nbytes)
            for p, c, s, arrive, nbytes in transfers
        ]
    )
    meta = {
        "schedule": result.schedule,
        "topology": result.topology,
        "num_stages": result.num_stages,
        "num_microbatches": result.num_microbatches,
        "num_segments": cs.schedule.num_segments,
        "makespan": result.makespan,
        "bubble_ratio": result.bubble_ratio,
    }
    if result.branches:
        # the multi-branch view: stage -> branch (the Gantt chart colours by it) and the
        # compute streams' idle gaps with their causes, as "wait" events
        meta["branch"] = list(result.branches)
        events.extend(map(_wait_event, result.waits))
    return Timeline(events=events, num_devices=cs.num_devices, time_unit=time_unit, source="simulated", meta=meta)


def _wait_event(w: Wait) -> Event:
    """A :class:`Wait` as a timeline event on the device's "wait" stream: named and
    indexed by the action that waited ("drain" after the last one), ``src`` the cause's
    device, the cause in ``extra``."""
    a = w.action
    extra = {
        "cause_kind": w.kind,
        "cause": None if w.cause is None else str(w.cause),
        "cause_device": w.cause_device,
        "message": w.message,
    }
    if a is None:
        return Event(w.device, "drain", "", -1, -1, 0, 0, w.start, w.end, "wait", -1, w.device, extra=extra)
    return Event(w.device, f"wait {a}", a[0], a[1], a[2], a[3], a[4], w.start, w.end, "wait",
                 w.cause_device, w.device, extra=extra)


def _deadlock_message(cs: CompiledSchedule, waits: list[int]) -> str:
    """Name, per stuck device, the first action that never started."""
    stuck = []
    for d in range(cs.num_devices):
        for i in range(cs.offsets[d], cs.offsets[d + 1]):
            if waits[i] > 0:
                stuck.append(f"device {d} at {cs.actions[i]}")
                break
    return (
        f"schedule {cs.schedule.name!r} cannot finish: " + ", ".join(stuck[:8])
        + (f" and {len(stuck) - 8} more" if len(stuck) > 8 else "")
        + " never start; run pipeflow.schedules.validate(schedule) to see what each waits for"
    )
