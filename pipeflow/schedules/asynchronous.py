"""Asynchronous schedules (``pipedream``, ``pipedream_2bw``, ``amdp``): weight updates
without a flush.

They cover ``windows`` consecutive steps of ``microbatches`` each: microbatch ``w * m + i``
is the i-th of step ``w``, ``update_of_microbatch`` names the update each gradient feeds,
STEP actions sit in the stream, and the policy says which weight version a forward and a
backward see (:mod:`pipeflow.schedules.versions`). Each schedule's rules and staleness:
docs/schedules.md."""

from __future__ import annotations

import heapq

from .common import check_basic, require, warmup_alternate_drain
from .ir import Action, Kind, Placement, Schedule, StageGraph, WeightPolicy
from .spec import ScheduleSpec


def _check_windows(name: str, windows: int) -> None:
    require(isinstance(windows, int) and windows >= 1, "schedule.windows", windows, name,
            "a whole number >= 1 of steps run without a flush")


def _nonflush_1f1b(p: int, total: int) -> list[list[Action]]:
    """1F1B over ``total`` microbatches with no flush: warm up once, alternate, drain once."""
    return [
        warmup_alternate_drain(total, p - r - 1, lambda mb, r=r: Action(Kind.F, r, mb),
                               lambda mb, r=r: Action(Kind.B, r, mb))
        for r in range(p)
    ]


def _steps_after_last_backward(orders: list[list[Action]], update_of: tuple[int, ...]) -> list[list[Action]]:
    """Insert STEP(stage, update) right after the stage's last backward of that update."""
    out = []
    for order in orders:
        last: dict[tuple[int, int, int], int] = {}
        for pos, a in enumerate(order):
            if a.kind in Kind.WEIGHT_GRAD:
                last[(a.pipe, a.stage, update_of[a.microbatch])] = pos
        after = {pos: key for key, pos in last.items()}
        new = []
        for pos, a in enumerate(order):
            new.append(a)
            if pos in after:
                pipe, stage, u = after[pos]
                new.append(Action(Kind.STEP, stage, -1, pipe, 0, u))
        out.append(new)
    return out


def pipedream(stages: int, microbatches: int, windows: int = 1, stash: bool = True) -> Schedule:
    name = "pipedream"
    check_basic(name, stages, microbatches)
    _check_windows(name, windows)
    require(isinstance(stash, bool), "schedule.stash", stash, name, "true (weight stashing) or false")
    p, total = stages, microbatches * windows
    update_of = tuple(range(total))  # one update per microbatch
    orders = _steps_after_last_backward(_nonflush_1f1b(p, total), update_of)
    return Schedule(
        name=name, graph=StageGraph.chain(p), placement=Placement.single(range(p)), orders=orders,
        num_microbatches=total, policy=WeightPolicy.STASH if stash else WeightPolicy.NONE,
        update_of_microbatch=update_of,
        windows=windows, microbatches_per_step=microbatches, meta={"stash": stash},
    )


def pipedream_2bw(stages: int, microbatches: int, windows: int = 1) -> Schedule:
    name = "pipedream_2bw"
    check_basic(name, stages, microbatches)
    _check_windows(name, windows)
    p, m = stages, microbatches
    require(m >= p, "pipeline.microbatches", m, name,
            f"at least as many microbatches per window as stages (m >= {p}), so two weight versions suffice")
    total = m * windows
    update_of = tuple(mb // m for mb in range(total))
    orders = _steps_after_last_backward(_nonflush_1f1b(p, total), update_of)
    return Schedule(
        name=name, graph=StageGraph.chain(p), placement=Placement.single(range(p)), orders=orders,
        num_microbatches=total, policy=WeightPolicy.DOUBLE_BUFFER, update_of_microbatch=update_of,
        windows=windows, microbatches_per_step=m,
    )


def amdp_placement(d: int) -> Placement:
    """Pipeline j places stage i on (2j + i) mod d for even j, (2j + 1 - i) mod d for odd j."""
    table = []
    for j in range(d // 2):
        if j % 2 == 0:
            table.append(tuple((2 * j + i) % d for i in range(d)))
        else:
            table.append(tuple((2 * j + 1 - i) % d for i in range(d)))
    return Placement(d, tuple(table))


def mirror_groups(placement: Placement) -> list[tuple[int, ...]]:
    """Sets of devices that hold the same stages (AMDP's mirror groups), sorted."""
    seen = {tuple(sorted({d for _, d in placement.replicas(s)})) for s in range(placement.num_stages)}
    return sorted(seen)


# Ties between ready actions on a device, after first come first served: a backward
# first (it frees memory and returns the admission slot), the deeper stage first, the
# older minibatch first, or the action with the most work still behind it (forwards
# before backwards, the shallowest forward first: longest remaining path). The generator
# keeps whichever order is shortest in unit time.
_TIES = {
    "backward_first": lambda a, d: (a.kind != Kind.B, a.pipe),
    "deeper_first": lambda a, d: (-a.stage if a.kind == Kind.F else -d, a.pipe),
    "older_first": lambda a, d: (a.microbatch, a.kind != Kind.B),
    "most_remaining_first": lambda a, d: (a.stage - 2 * d if a.kind == Kind.F else -a.stage, a.pipe),
}
_RULES = tuple(_TIES)


def _amdp_list_schedule(placement: Placement, pipe_of, update_of, round_in_window, admission: int, ratio: float,
                        rule: str) -> tuple[list[list[Action]], float]:
    """List scheduling in unit time (forward 1, backward ``ratio``): a free device runs the
    ready action that became ready first, ``rule`` breaking ties. Returns the per-device
    orders (with REDUCE and STEP) and the makespan in those units."""
    run = _ListSchedule(placement, pipe_of, update_of, round_in_window, admission, ratio, rule)
    for j in range(placement.num_pipes):
        run.admit(j, 0.0)
    remaining, now = 2 * len(pipe_of) * placement.num_devices, 0.0
    while remaining:
        run.start(now)
        if not run.events:
            raise RuntimeError("amdp list scheduling stalled")  # a bug, never a config error
        now = run.events[0][0]
        while run.events and run.events[0][0] <= now:
            t, _, a = heapq.heappop(run.events)
            remaining -= 1
            run.finish(a, t)
    for dev in range(placement.num_devices):  # the last window's updates
        run.orders[dev].extend(run.step_ready[dev])
    return run.orders, now


class _ListSchedule:
    """The state of :func:`_amdp_list_schedule` as it runs: ready queues, orders, running
    actions, admissions, and each window's backwards and updates still to come."""

    def __init__(self, placement: Placement, pipe_of, update_of, round_in_window, admission: int, ratio: float,
                 rule: str) -> None:
        d, npipes = placement.num_devices, placement.num_pipes
        self.placement, self.update_of, self.round_in_window = placement, update_of, round_in_window
        self.admission, self.tie = admission, _TIES[rule]
        self.dur = {Kind.F: 1.0, Kind.B: ratio}
        self.per_pipe: list[list[int]] = [[] for _ in range(npipes)]
        for mb in range(len(pipe_of)):
            self.per_pipe[pipe_of[mb]].append(mb)
        self.left: dict[tuple[int, int, int], int] = {}  # backwards still to run per (pipe, stage, update)
        for mb in range(len(pipe_of)):
            for s in range(d):
                key = (pipe_of[mb], s, update_of[mb])
                self.left[key] = self.left.get(key, 0) + 1
        self.reduced: dict[tuple[int, int], int] = {}
        self.stepped: set[tuple[int, int, int]] = set()
        self.step_ready: list[list[Action]] = [[] for _ in range(d)]
        self.held: dict[tuple[int, int, int], list[Action]] = {}
        self.in_flight, self.next_admit = [0] * npipes, [0] * npipes
        self.free_at = [0.0] * d
        self.queue: list[list] = [[] for _ in range(d)]
        self.events: list = []  # (end, seq, action) of the actions running
        self.orders: list[list[Action]] = [[] for _ in range(d)]
        self.seq = 0

    def make_ready(self, a: Action, t: float) -> None:
        """``a`` ready at ``t``: queued on its device, or (a forward beyond its window's
        first round) held until the update before it."""
        u = self.update_of[a.microbatch]
        gate = (a.pipe, a.stage, u - 1)
        if a.kind == Kind.F and u > 0 and self.round_in_window[a.microbatch] >= 1 and gate not in self.stepped:
            self.held.setdefault(gate, []).append(a)  # beyond a window's first round: wait for the update
            return
        device = self.placement.device(a.pipe, a.stage)
        heapq.heappush(self.queue[device], (t, self.tie(a, self.placement.num_devices), self.seq, a))
        self.seq += 1

    def admit(self, j: int, t: float) -> None:
        """Pipeline ``j``'s next microbatches, while it has fewer than ``admission`` in flight."""
        while self.in_flight[j] < self.admission and self.next_admit[j] < len(self.per_pipe[j]):
            mb = self.per_pipe[j][self.next_admit[j]]
            self.next_admit[j] += 1
            self.in_flight[j] += 1
            self.make_ready(Action(Kind.F, 0, mb, j), t)

    def start(self, now: float) -> None:
        """Each device free at ``now`` runs its updates ready (each at the device's first
        free moment) and then its first ready action, until none can start."""
        changed = True
        while changed:  # an update may release forwards on any device
            changed = False
            for dev in range(self.placement.num_devices):
                if self.free_at[dev] > now:
                    continue
                for st in self.step_ready[dev]:
                    self.orders[dev].append(st)
                    self.stepped.add((st.pipe, st.stage, st.version))
                    for a in self.held.pop((st.pipe, st.stage, st.version), ()):
                        self.make_ready(a, now)
                    changed = True
                self.step_ready[dev] = []
                if self.queue[dev]:
                    a = heapq.heappop(self.queue[dev])[-1]
                    self.orders[dev].append(a)
                    self.free_at[dev] = now + self.dur[a.kind]
                    heapq.heappush(self.events, (self.free_at[dev], self.seq, a))
                    self.seq += 1
                    changed = True

    def finish(self, a: Action, t: float) -> None:
        """``a`` done at ``t``: its microbatch's next action becomes ready; a window's last backward
        of a replica's stage reduces, and the last replica's lets every replica step."""
        j, s, mb = a.pipe, a.stage, a.microbatch
        d, npipes = self.placement.num_devices, self.placement.num_pipes
        if a.kind == Kind.F:
            self.make_ready(Action(Kind.F, s + 1, mb, j) if s + 1 < d else Action(Kind.B, s, mb, j), t)
            return
        if s > 0:
            self.make_ready(Action(Kind.B, s - 1, mb, j), t)
        else:
            self.in_flight[j] -= 1
            self.admit(j, t)
        u = self.update_of[mb]
        self.left[(j, s, u)] -= 1
        if self.left[(j, s, u)] == 0:  # the replica's last backward of the window: reduce now
            if npipes > 1:  # a single pipeline has no mirror replicas
                self.orders[self.placement.device(j, s)].append(Action(Kind.REDUCE, s, -1, j, 0, u))
            self.reduced[(s, u)] = self.reduced.get((s, u), 0) + 1
            if self.reduced[(s, u)] == npipes:  # the reduction is complete: every replica may step
                for jj in range(npipes):
                    self.step_ready[self.placement.device(jj, s)].append(Action(Kind.STEP, s, -1, jj, 0, u))


def amdp(
    stages: int,
    microbatches: int,
    windows: int = 1,
    accumulation_rounds: int | None = None,
    zero: bool = False,
    admission: int = 2,
    backward_ratio: float = 2.0,
) -> Schedule:
    """AMDP over d = ``stages`` devices; ``microbatches`` = R * d minibatches per update window.
    The order is fixed by list scheduling in unit time (forward 1, backward
    ``backward_ratio``; first come first served, a backward before a forward on ties, then
    the lower pipeline); other costs change only its timing."""
    name = "amdp"
    check_basic(name, stages, microbatches)
    _check_windows(name, windows)
    d = stages
    require(d % 2 == 0, "pipeline.stages", d, name,
            "an even pipeline depth d (2, 4, 8, ...): d/2 pipelines in complementary directions share the devices")
    if accumulation_rounds is None:
        require(microbatches % d == 0, "pipeline.microbatches", microbatches, name,
                f"a multiple of pipeline.stages={d}: a round is d minibatches (two per pipeline), "
                f"and a window is schedule.accumulation_rounds rounds, e.g. {d} or {2 * d}")
        rounds = microbatches // d
    else:
        require(isinstance(accumulation_rounds, int) and accumulation_rounds >= 1, "schedule.accumulation_rounds",
                accumulation_rounds, name, "a whole number of rounds >= 1 (null: pipeline.microbatches / stages)")
        rounds = accumulation_rounds
        require(microbatches == rounds * d, "pipeline.microbatches", microbatches, name,
                f"schedule.accumulation_rounds={rounds} rounds of d={d} minibatches per update, i.e. "
                f"pipeline.microbatches={rounds * d} (or schedule.accumulation_rounds=null)")
    require(isinstance(zero, bool), "schedule.zero", zero, name, "true (owner-based optimizer sharding) or false")
    require(isinstance(admission, int) and admission >= 1, "schedule.admission", admission, name, "a whole number >= 1")
    placement = amdp_placement(d)
    m = microbatches
    total = m * windows
    pipe_of = tuple((mb % m) % d // 2 for mb in range(total))
    update_of = tuple(mb // m for mb in range(total))
    round_in_window = tuple((mb % m) // d for mb in range(total))
    best = None
    for rule in _RULES:
        orders, makespan = _amdp_list_schedule(placement, pipe_of, update_of, round_in_window, admission,
                                               float(backward_ratio), rule)
        if best is None or makespan < best[1]:
            best = (orders, makespan, rule)
    orders, _, rule = best
    return Schedule(
        name=name, graph=StageGraph.chain(d), placement=placement, orders=orders, num_microbatches=total,
        policy=WeightPolicy.BOUNDED, pipe_of_microbatch=pipe_of, update_of_microbatch=update_of,
        windows=windows, microbatches_per_step=m, zero=zero,
        meta={"accumulation_rounds": rounds,
              "admission": admission, "order_rule": rule, "mirror_groups": [list(g) for g in mirror_groups(placement)]},
    )


PIPEDREAM = ScheduleSpec("pipedream", pipedream, "asynchronous 1F1B, an update after every backward (weight stashing)",
                         asynchronous=True)
PIPEDREAM_2BW = ScheduleSpec("pipedream_2bw", pipedream_2bw, "asynchronous 1F1B, two weight versions, one update per window",
                             asynchronous=True)
AMDP = ScheduleSpec("amdp", amdp, "d/2 pipelines in complementary directions, bounded weight mismatch", asynchronous=True)
