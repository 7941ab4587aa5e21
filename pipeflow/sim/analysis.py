"""After the event loop: the waits that explain every idle gap, weight versions and
weight memory, the recorded timeline, and the message of a deadlock; see
:mod:`pipeflow.sim.engine`."""

from __future__ import annotations

from operator import attrgetter, itemgetter

from ..schedules.deps import DepResolver
from ..schedules.ir import Kind, WeightPolicy
from ..schedules.versions import VersionRecord, weight_versions
from ..schedules.zero import zero_owners
from .compiled import CompiledSchedule, SimulationError
from .results import SimResult, WAIT_KINDS, Wait
from ..formats.timeline import Event, Timeline


def classify_edge(branch: tuple[str, ...] | list[str], src_stage: int, dst_stage: int) -> str:
    """The wait kind of a message along graph edge ``src_stage -> dst_stage``: "head" into the head,
    "interaction" between two other branches, "chain" within one (or unlabelled)."""
    if not branch:
        return "chain"
    a, b = branch[src_stage], branch[dst_stage]
    if a == "head" or b == "head":
        return "head"
    return "chain" if a == b else "interaction"


def _waits(cs: CompiledSchedule, start, end, issue_time: dict[int, float], transfers, makespan: float) -> list[Wait]:
    """Every idle gap of every compute stream and its cause: the message, collective or stream release that
    resolved exactly at the next action's start (else any dependency that ended then); ties go to the
    first kind of WAIT_KINDS."""
    actions, kind, stage, device, offsets = cs.actions, cs.kind, cs.stage, cs.device, cs.offsets
    branch = cs.schedule.graph.branch
    R, F = Kind.COLLECTIVE, Kind.F  # a REDUCE or a GATHER: issued, then run across the replicas
    new = tuple.__new__
    gaps: list[tuple[int, float, float, int]] = []  # device, from, to, waiting action (-1: drain)
    for d in range(cs.num_devices):
        prev = 0.0
        for i in range(offsets[d], offsets[d + 1]):
            if kind[i] in R:
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
            if q >= offsets[device[c]] and (issue_time.get(q, end[q]) if kind[q] in R else end[q]) == start[c]:
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
                    lst.append((p, "reduce" if kind[p] in R else "stream"))
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
    """The weight version of every forward and backward ([] under sync); SimulationError if bad."""
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
    """Per device: (peak weight versions of one replica, peak weight bytes, optimizer bytes); stash and
    double_buffer walk the device list (:func:`_version_peaks`)."""
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
        peak = base
        if policy == WeightPolicy.STASH or policy == WeightPolicy.DOUBLE_BUFFER:
            peak_versions, peak = _version_peaks(cs, d, policy == WeightPolicy.STASH, pbytes, base, peak_versions)
        out.append((peak_versions, peak, opt))
    return out


def _version_peaks(cs: CompiledSchedule, d: int, stash: bool, pbytes, base: float,
                   peak_versions: int) -> tuple[int, float]:
    """Device ``d``'s walk under stash (else double_buffer): (the most versions one replica holds, the most
    weight bytes from ``base``), a version of a stage ``pbytes(stage)`` bytes."""
    peak = total = base
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
    return peak_versions, peak


def _timeline(cs: CompiledSchedule, start, end, issue_time, gbytes, transfers, result: SimResult,
              time_unit: str) -> Timeline:
    """The :class:`Timeline` of every action and transfer, built as columns (``Timeline.from_columns``) so a
    large run makes no Event object until one is read."""
    actions, kind, stage, segment, device = cs.actions, cs.kind, cs.stage, cs.segment, cs.device
    n = len(actions)
    names = list(map(str, actions))
    mb = list(map(itemgetter(2), actions))
    pipe = list(map(itemgetter(3), actions))
    stream, nbytes, extra = ["compute"] * n, [0.0] * n, [None] * n
    for g, members in enumerate(cs.groups):
        for i in members:  # a REDUCE: its interval is the all-reduce, on the collective stream
            stream[i] = "collective"
            nbytes[i] = gbytes[g]
            extra[i] = {"issued": issue_time[i]}
    # transfers, on their sender: (producer, consumer, start, arrival, bytes)
    src, dst, t0, t1, sizes = zip(*transfers) if transfers else ((),) * 5
    at_src, at_dst = _picker(src), _picker(dst)
    m = len(src)
    src_device = at_src(device)
    columns = {
        "device": [*device, *src_device],
        "name": [*names, *map("%s->%s".__mod__, zip(at_src(names), at_dst(names)))],
        "kind": [*kind, *at_src(kind)],
        "stage": [*stage, *at_src(stage)],
        "microbatch": [*mb, *at_src(mb)],
        "pipe": [*pipe, *at_src(pipe)],
        "segment": [*segment, *at_src(segment)],
        "start": [*start, *t0],
        "end": [*end, *t1],
        "stream": stream + ["comm"] * m,
        "src": [*[-1] * n, *src_device],
        "dst": [*[-1] * n, *at_dst(device)],
        "nbytes": [*nbytes, *sizes],
        "version": list(map(itemgetter(5), actions)) + [-1] * m,
        "extra": extra + [None] * m,
    }
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
        waits = list(map(_wait_event, result.waits))
        for name, col in columns.items():
            col.extend(map(attrgetter(name), waits))
    return Timeline.from_columns(columns, cs.num_devices, time_unit=time_unit, source="simulated", meta=meta)


def _picker(positions: tuple[int, ...]):
    """A function picking ``values[i]`` for each i of ``positions``, as a tuple."""
    if len(positions) > 1:
        return itemgetter(*positions)
    return lambda values: tuple(values[i] for i in positions)


def _wait_event(w: Wait) -> Event:
    """A :class:`Wait` as a timeline event on the device's "wait" stream, the cause in ``extra``."""
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
