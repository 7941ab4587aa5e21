"""Deterministic discrete-event simulator: schedule + cost model + topology -> timing
(:func:`simulate`; the rules: docs/simulation.md, "The simulator's rules"). The schedule is
compiled once to ints and flat lists (:mod:`.compiled`) and every price computed once; the
event loop (``_events``, ``_events_shared`` for hosts' shared cores) stays whole, being the
planner's inner loop. Results: :mod:`.results`; what is derived after the loop (waits,
weight versions and memory, the timeline): :mod:`.analysis`."""

from __future__ import annotations

import functools
import heapq
import math
from itertools import compress

from ..schedules.ir import Kind, Schedule, WeightPolicy
from ..schedules.versions import summarize
from .analysis import _deadlock_message, _timeline, _versions, _waits, _weight_memory, classify_edge
from .compiled import CompiledSchedule, SimulationError, _compile, _gc_paused, compile_schedule
from .results import WAIT_KINDS, DeviceStats, SimResult, Wait
from .memory_terms import price

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


# --------------------------------------------------------------------------- simulate
def simulate(
    schedule: Schedule | CompiledSchedule, cost, topology, record: bool = True, waits: bool = True
) -> SimResult:
    """Run ``schedule`` (or a :func:`compile_schedule` of it, to price it many times) on ``topology``
    with durations and sizes from ``cost``; a :class:`SimResult`. ``record=False`` skips the
    timeline and the idle-gap analysis, every other metric exact; ``waits=False`` skips only
    the idle-gap analysis where nothing shows it (no branch labels)."""
    with _gc_paused():
        cs = schedule if isinstance(schedule, CompiledSchedule) else _compile(schedule)
        return _simulate(cs, cost, topology, record, waits)


def _simulate(cs: CompiledSchedule, cost, topology, record: bool, want_waits: bool = True) -> SimResult:
    """Price every action, message and collective once, run the event loop over them,
    then each device's statistics and the result."""
    sched = cs.schedule
    ndev = cs.num_devices
    if topology.num_devices < ndev:
        raise SimulationError(
            f"schedule {sched.name!r} needs {ndev} devices but topology {topology.name!r} has "
            f"{topology.num_devices}; pick a larger topology (e.g. get_topology(name, num_devices={ndev}))"
        )
    n = len(cs.actions)
    dur = _durations(cs, cost, topology)
    specs, num_slots, sent, recv = _message_prices(cs, cost, topology)
    gdur, gdevs, gbytes, coll_bytes = _collective_prices(cs, cost, topology)

    # ---- the event loop
    run = _events_shared if topology.shares_compute else _events
    start, end, issue_time, transfers, num_launched, now, waits = run(
        cs, dur, specs, num_slots, cs.groups, gdevs, gdur, record, topology)
    if num_launched < n:
        raise SimulationError(_deadlock_message(cs, waits))
    if topology.shares_compute:
        dur = [e - s if k not in Kind.COLLECTIVE else 0.0 for s, e, k in zip(start, end, cs.kind)]  # busy = elapsed
    makespan = now if n else 0.0
    per_device = _device_stats(cs, cost, dur, start, end, makespan, (sent, recv, coll_bytes))
    total_busy = sum(st.busy for st in per_device)
    bubble = 1.0 - total_busy / (ndev * makespan) if makespan > 0 and ndev else 0.0
    return _result(cs, cost, topology, record, want_waits, per_device, makespan, bubble, start, end, issue_time,
                   transfers, gbytes, sum(sent), sum(coll_bytes))


def _durations(cs: CompiledSchedule, cost, topology) -> list[float]:
    """Each action's time on its device: the cost model's, cached per (kind, stage,
    segment, device), with what the step, sharding, a CPU rank's messages and an
    overlapped pair add or take away."""
    sched = cs.schedule
    ndev, n = cs.num_devices, len(cs.actions)
    devices = topology.devices
    kind, stage, segment, device = cs.kind, cs.stage, cs.segment, cs.device
    # ---- price every action once: durations are cached per (kind, stage, segment, device)
    @functools.cache
    def priced(k: str, s: int, g: int, d: int) -> float:
        if k in Kind.COLLECTIVE or k == Kind.FREE:  # (a FREE lets memory go: no time)
            return 0.0
        v = float(cost.compute_time(k, s, g, devices[d]))
        if not 0.0 <= v < math.inf:
            raise SimulationError(
                f"cost model {type(cost).__name__} gave {k} of stage {s} (segment {g}) "
                f"on device {d} a duration of {v}; durations must be finite and >= 0"
            )
        return v

    dur = list(map(priced, kind, stage, segment, device))

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

    # ---- ZeRO-1 (pipeline.shard=optimizer; pipeflow.runtime.sharded): a replicated stage's
    # STEP updates its replica's n-th of the parameters and all-gathers the updated
    # slices (fp32), before the stage computes again
    # (full, ZeRO-3: the STEP updates the shard alone; the next step's GATHERs gather)
    shard = getattr(sched, "shard", "none")
    if shard in ("optimizer", "gradients", "full"):
        table = sched.placement.table
        for i in range(n):
            if kind[i] == Kind.STEP:
                devs = sorted({row[stage[i]] for row in table})
                if len(devs) > 1:
                    weights = cost.state_bytes(stage[i])["parameters"]
                    dur[i] = dur[i] / len(devs) + (0.0 if shard == "full" else float(topology.allgather_time(devs, weights)))

    # ---- the host time of a message on its sender's and its receiver's compute (CPU ranks)
    host = float(getattr(topology, "message_host", 0.0) or 0.0)
    if host > 0:
        for a in range(n):
            for c, _mc in cs.tensor_out[a]:
                dur[a] += host
                dur[c] += host

    # ---- an overlapped F&B pair (DualPipeV) takes max + (1 - cost.overlap) x min of its
    # halves: the shorter half gives up the part the longer one hides
    overlap = float(getattr(cost, "overlap", 0.0) or 0.0)
    if overlap > 0:
        for fa, ba in sched.overlapped:
            f, b = cs.index[fa], cs.index[ba]
            shorter = f if dur[f] <= dur[b] else b
            dur[shorter] -= overlap * dur[shorter]

    return dur


def _message_prices(cs: CompiledSchedule, cost, topology) -> tuple[list, int, list, list]:
    """(each message class's (transfer time, latency, resource slots, bytes), how many
    resource slots, bytes each device sends, bytes each receives)."""
    ndev = cs.num_devices
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

    return specs, len(slot_of), sent, recv


def _collective_prices(cs: CompiledSchedule, cost, topology) -> tuple[list, list, list, list]:
    """Each collective group's (time, devices, bytes), and each device's collective bytes."""
    ndev, kind, stage, device = cs.num_devices, cs.kind, cs.stage, cs.device
    shard = getattr(cs.schedule, "shard", "none")
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
        if kind[members[0]] == Kind.GATHER:  # full: the stage's fp32 weights, from every one's shard
            gdur[g] = float(topology.allgather_time(list(devs), nbytes))
        elif shard in ("gradients", "full"):  # ZeRO-2/3: half the ring, into each one's slice
            gdur[g] = float(topology.reducescatter_time(list(devs), nbytes))
        else:
            gdur[g] = float(topology.allreduce_time(list(devs), nbytes))
        for d in devs:
            coll_bytes[d] += nbytes

    return gdur, gdevs, gbytes, coll_bytes


def _device_stats(cs: CompiledSchedule, cost, dur, start, end, makespan: float, traffic: tuple) -> list[DeviceStats]:
    """Each device's :class:`DeviceStats`: its busy time (by branch), its activations'
    peak as the engine walks them (each device's list in order: its events are
    time-ordered there), its traffic (sent, received, collective bytes) and weights."""
    sched = cs.schedule
    ndev, stage = cs.num_devices, cs.stage
    sent, recv, coll_bytes = traffic
    # ---- weights: versions seen (asynchronous policies), versions kept, optimizer state
    weights = _weight_memory(cs, cost)
    act_cache: dict[tuple[int, int], tuple[float, float]] = {}
    per_device: list[DeviceStats] = []
    nseg = max(1, sched.num_segments)
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
        peak, peak_live = _activation_peak(cs, cost, start, end, lo, hi, act_cache, nseg)
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
    return per_device


def _activation_peak(cs: CompiledSchedule, cost, start, end, lo: int, hi: int, act_cache: dict,
                     nseg: int) -> tuple[float, int]:
    """One device's activations walked over its actions ``lo:hi`` (time-ordered): (the
    peak bytes, the peak of microbatch segments held); ``act_cache``: (stage, segment)
    -> its sizes, filled as met."""
    kind, stage, segment = cs.kind, cs.stage, cs.segment
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
                price(cost, "rebuilt_layer_bytes", *key),
                _kv_gradient(cost, key, nseg),
            )
        if k == Kind.F:
            t, delta, dlive = start[i], sizes[0], 1
        elif k == Kind.B:
            t, delta, dlive = end[i], -sizes[0] + sizes[3], -1
        elif k == Kind.I:
            t, delta, dlive = end[i], sizes[1] - sizes[0] + sizes[3], -1
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
        if sizes[2] and k in (Kind.B, Kind.I):
            # while it runs, the backward holds the layer it recomputed on top of the
            # level before its free (nothing else allocates on this device meanwhile)
            peak = max(peak, cur + sizes[2])
        cur += delta
        live += dlive
    peak = max(peak, cur)
    peak_live = max(peak_live, live)
    return peak, peak_live


def _result(cs: CompiledSchedule, cost, topology, record: bool, want_waits: bool, per_device: list,
            makespan: float, bubble: float, start, end, issue_time: dict, transfers, gbytes, p2p: float,
            collective: float) -> SimResult:
    """The :class:`SimResult`: the numbers, with ``record`` the waits and the timeline."""
    sched, actions = cs.schedule, cs.actions
    labels = sched.graph.branch
    versions = _versions(cs)
    describe = getattr(cost, "describe", None)
    result = SimResult(
        schedule=sched.name,
        num_devices=cs.num_devices,
        num_stages=sched.num_stages,
        num_microbatches=sched.num_microbatches,
        makespan=makespan,
        bubble_ratio=bubble,
        per_device=per_device,
        p2p_bytes=p2p,
        collective_bytes=collective,
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
    if record and (want_waits or labels):  # a branched model's timeline and summary show the waits
        result.waits = waits = _waits(cs, start, end, issue_time, transfers or [], makespan)
        for st in per_device:
            st.idle_by_cause = dict.fromkeys(WAIT_KINDS, 0.0)
        for w in waits:
            per_device[w.device].idle_by_cause[w.kind] += w.end - w.start
    if record:
        result.timeline = _timeline(cs, start, end, issue_time, gbytes, transfers or [], result,
                                    getattr(cost, "time_unit", "s"))
    return result


def _kv_gradient(cost, key: tuple[int, int], nseg: int) -> float:
    """What a backward of (stage, segment) changes in the Seq1F1B key/value gradients: a
    microbatch's first backward on a stage (its last segment's) allocates those of every
    earlier segment; each earlier segment's backward frees its own."""
    stage, seg = key
    if nseg <= 1:
        return 0.0
    if seg == nseg - 1:
        return float(sum(price(cost, "kv_gradient_bytes", stage, j) for j in range(seg)))
    return -price(cost, "kv_gradient_bytes", stage, seg)


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


def _launch_keys(kind: list[str]) -> list[int]:
    """Each action's heap key when it launches: its number, a collective's plus the
    number of actions (issued, not ended)."""
    n = len(kind)
    keys = list(range(n))
    for i in compress(range(n), map(Kind.COLLECTIVE.__contains__, kind)):
        keys[i] += n
    return keys


def _events(cs: CompiledSchedule, dur, specs, num_slots, groups, gdevs, gdur, record, topology):
    """The event loop of devices that compute independently (every GPU, CPU ranks with a
    core each): an action's end is known when it starts. Returns (start, end,
    issue_time, transfers, actions launched, makespan, waits left)."""
    n, ndev, kind = len(cs.actions), cs.num_devices, cs.kind
    # Heap entries are (time, key). key < n: compute action ``key`` ended.
    # n <= key < 2n: REDUCE ``key - n`` was issued. key >= 2n: REDUCE ``key - 2n`` done.
    # Keys are unique, so equal times pop in key order: deterministic.
    n2 = 2 * n
    launch_key = _launch_keys(kind)
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
                        e = end[c] = s + dur[c]
                        push(heap, (e, launch_key[c]))
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
                e = end[c] = s + dur[c]
                push(heap, (e, launch_key[c]))
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
                e = end[c] = s + dur[c]
                push(heap, (e, launch_key[c]))
                num_launched += 1

    if num_launched < n:
        raise SimulationError(_deadlock_message(cs, waits))
    return start, end, issue_time, transfers, num_launched, now, waits


def _events_shared(cs: CompiledSchedule, dur, specs, num_slots, groups, gdevs, gdur, record, topology):
    """The event loop of devices that share a host's cores, processor sharing: while k devices
    compute each progresses at :meth:`~pipeflow.topology.topology.Topology.compute_rate` (k),
    so an action's end is known only when nothing else starts or ends before it. Otherwise
    as :func:`_events`; slower (it scans the running actions at every event)."""
    n, ndev, kind = len(cs.actions), cs.num_devices, cs.kind
    n2 = 2 * n
    # Heap keys: k < n: compute action k starts; n <= k < 2n: REDUCE k - n issued;
    # 2n <= k < 3n: REDUCE k - 2n done. Compute ends are not in the heap: they move.
    launch_key = _launch_keys(kind)
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
    num_launched = 0
    now = 0.0

    def launch(c: int, s: float) -> None:
        nonlocal num_launched
        num_launched += 1
        start[c] = s
        if kind[c] in Kind.COLLECTIVE:
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
