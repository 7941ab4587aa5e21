"""One device's walk over its actions: the memory terms each action holds and lets go,
recorded as a :class:`~pipeflow.sim.memory_tape.Tape` (what :mod:`pipeflow.sim.device_memory`
prices and walks). A device runs its actions one at a time, so its order is the time
order: no timeline is needed.

- :class:`StepFacts`: what every device's walk reads of the schedule (its placement,
  its stages' replicas and shards, its weight policy, where each action runs);
- :class:`SentCopies`: what a device sent and still holds until a message from the
  peer proves it arrived (the runtime's rule, :mod:`pipeflow.runtime.messages`);
- :class:`DeviceWalk`: one device's walk, one method per kind of action.

A tape's steps are ``(category, term, count)`` (that many of the term join the
category, or leave it when negative) or ``(-1, extra, 0)``, an instant that may be the
peak, with ``extra`` a term held for that instant only (-1: none). A term is a key such
as ``("activation_bytes", stage, segment)``, priced by
:func:`pipeflow.sim.memory_terms.term_value` (the glossary: ``docs/memory_terms.md``).

Most of what an action holds and lets go depends on its stage and segment only, not on
its microbatch: those stretches of steps (a *piece*, such as a forward's input arriving
and its activations kept) are written once per (piece, pipe, stage, segment) and what
they hinge on (a stage's first gradients, its first casts), kept, and copied onto the
tape each time; what depends on the microbatch (the sends proven arrived, the outputs
a stage on the same device holds) is walked each time. A device's walk is so linear in
its actions with a small constant (a 64-stage, 1,024-microbatch 1F1B: 1.8 million steps).
"""

from __future__ import annotations

import heapq
import itertools
from array import array

from ..schedules.ir import Kind, WeightPolicy
from ..schedules.lowering import action_positions
from ..schedules.versions import tied_update_plan
from ..schedules.zero import zero_owners
from .memory_tape import _CAT, _TEMP, Tape

F, B, I, W, STEP, GATHER, FREE = Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP, Kind.GATHER, Kind.FREE  # noqa: E741
WALKED = (F, B, I, W, STEP, GATHER, FREE)  # the actions a walk visits (a REDUCE is walked after the one before it)
PARAMS, OPT, VERS, GRADS, CASTS, ACTS, RESID, OUTS, INS = (_CAT[c] for c in (
    "parameters", "optimizer_state", "weight_versions", "gradients", "casts", "activations", "residuals", "outputs",
    "inputs"))
INSTANT = (-1, -1, 0)  # an instant with nothing on top
NOTHING = (-1, None, 0)  # (a piece's instant with nothing on top)


def reduces_after(order: list, kinds: tuple) -> dict[int, list]:
    """Index into the device's list of ``kinds`` -> the REDUCEs that follow it, each as
    (stage, which REDUCE of the device's order it is)."""
    out: dict[int, list] = {}
    seen, n = -1, 0
    for a in order:
        if a.kind == Kind.REDUCE:
            out.setdefault(seen, []).append((a.stage, n))
            n += 1
        elif a.kind in kinds:
            seen += 1
    return out


class StepFacts:
    """What every device's walk reads of one schedule. ``replicas``: the schedule is one
    replica among that many, each stage's copies that many times its own
    (data_parallel.as_replica's lists)."""

    def __init__(self, schedule, replicas: int = 1) -> None:
        self.placement, self.graph = placement, graph = schedule.placement, schedule.graph
        self.orders = schedule.orders
        self.nseg = max(1, schedule.num_segments)
        self.owners = zero_owners(placement) if getattr(schedule, "zero", False) else None
        # each stage's copies; a stage held by more than one device flattens its gradients for its REDUCE
        self.count = {s: replicas * len({row[s] for row in placement.table}) for s in range(len(placement.table[0]))}
        self.replicated = {s for s, c in self.count.items() if c > 1}
        self.shard = getattr(schedule, "shard", "none")  # pipeline.shard: what the replicas of a stage shard
        self.sliced = self.replicated if self.shard != "none" else set()  # ZeRO-1/2/3: each replica a slice
        # an asynchronous executor's forwards each cast the weights anew (their versions
        # change between microbatches): each microbatch's backward holds its own casts
        self.asynchronous = getattr(schedule, "policy", WeightPolicy.SYNC) != WeightPolicy.SYNC
        # a weight its first and last stages share (a tied embedding) is updated once the
        # last backward feeding it is done anywhere: until that STEP a copy holds the
        # update's gradient of it (the cost model prices it: 0 for an untied model)
        self.nstages = n = len(graph.preds)
        chain = n > 1 and all(len(p) <= 1 for p in graph.preds) and all(len(x) <= 1 for x in graph.succs)
        self.tied_plan = tied_update_plan(schedule, (0, n - 1)) if self.asynchronous and chain else {}
        # where each action runs: a message from a peer made by an action after the one that
        # consumed a send proves that send arrived (pipeflow.runtime.messages._drop_arrived)
        self.position = action_positions(schedule)

    def forward_at(self, stage: int, microbatch: int, pipe: int, segment: int) -> tuple | None:
        """(device, index) of that forward: where a message into ``stage`` is used, and
        where one out of it is made."""
        return self.position.get((F, stage, microbatch, pipe, segment, -1))  # (an Action is this tuple)

    def backward_at(self, stage: int, microbatch: int, pipe: int, segment: int) -> tuple | None:
        """(device, index) of that backward (B, else I): where a gradient out of
        ``stage`` is made, and where one into it is used."""
        got = self.position.get((B, stage, microbatch, pipe, segment, -1))
        return got if got is not None else self.position.get((I, stage, microbatch, pipe, segment, -1))


class SentCopies:
    """What a device sent, held until a message proves it arrived: a forward's 16-bit
    copy (named (pipe, stage, microbatch, segment, successor)) and a gradient sent back
    (("sent", pipe, to, from, microbatch, segment)). A send is proven by a message from
    its consumer's device made by an action after the one that consumed the send."""

    def __init__(self) -> None:
        self._held: dict = {}  # name -> [its term, proven already]
        # consumer's device -> heap of (consumer's position, order sent, name, its entry)
        self._unproven: dict[int, list] = {}
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, name: tuple, term: int, consumer: tuple | None) -> None:
        entry = self._held[name] = [term, False]
        if consumer is not None:  # (a send no one consumes is never proven)
            heapq.heappush(self._unproven.setdefault(consumer[0], []), (consumer[1], next(self._order), name, entry))

    def proven_by(self, maker: tuple) -> list[int]:
        """The terms of the sends a message made at ``maker`` (device, index) proves
        arrived, in the order they were sent: those whose consumer ran on the maker's
        device before it. A gradient sent back is let go; a forward's copy stays named
        until its backward (which counts it gone)."""
        due, heap = [], self._unproven.get(maker[0], ())
        while heap and heap[0][0] < maker[1]:
            _, n, name, entry = heapq.heappop(heap)
            if self._held.get(name) is entry and not entry[1]:
                due.append((n, name, entry))
        if not due:
            return due
        terms = []
        for _, name, entry in (sorted(due) if len(due) > 1 else due):
            entry[1] = True
            terms.append(entry[0])
            if name[0] == "sent":  # a gradient sent back: nothing more to hold
                del self._held[name]
        return terms

    def release(self, name: tuple) -> int | None:
        """A forward's copy, let go at its backward: its term where a message had proven
        it arrived already (it was counted gone then), else None."""
        entry = self._held.pop(name, None)
        return entry[0] if entry is not None and entry[1] else None


class DeviceWalk:
    """Device ``d``'s tape (and with ``bare``, the tape of the schedule's twin without its
    GATHERs and FREEs under ``pipeline.shard=bare``: they differ in the parameters'
    terms, where receives are posted and REDUCEs walked, and the step's buffers; the
    two share one list of terms). :meth:`run` walks its actions in order, each kind by
    its method; a method copies its pieces (:meth:`piece`: the method ``_<piece>``
    writes one, naming its terms) and walks the rest."""

    reuse = True  # False writes every piece anew (a test: the pieces read nothing but their keys)

    def __init__(self, facts: StepFacts, d: int, bare: str | None = None) -> None:
        self.facts, self.d, self.bare = facts, d, bare
        self.index: dict[tuple, int] = {}  # term -> its number
        self.own, self.twin = array("d"), array("d")  # the steps, flat: category, term, count, ...
        # onto this walk alone, the twin alone, both
        self.emit_own, self.emit_twin = self.own.extend, self.twin.extend
        self.emit = self.emit_own if bare is None else self._emit_both
        self.starts: list[tuple] = []  # (the step each action's walk starts at, the action)
        self.starts_b: list[tuple] = []
        self._pieces: dict[tuple, array] = {}  # (copied onto the tape: array onto array is a copy of bytes)
        self._ones: dict[tuple, array] = {}
        self._away: dict[tuple, tuple] = {}  # (pipe, stage) -> its neighbours on other devices
        self._here: dict[tuple, tuple] = {}  # and on this one
        self.reps = facts.placement.stages_on(d)
        self.sent = SentCopies()
        self.grads_on: set = set()  # the reps holding their gradients
        self.casts_on: set = set()  # and their 16-bit casts
        self.cast_by: dict = {}  # rep -> (microbatch, segment) of the forward that made its casts
        self.tied_held: set = set()  # (rep, update) whose tied gradient waits for its STEP
        self.plan_here = facts.tied_plan.get(d, {})
        self.held_out: dict = {}  # (rep, microbatch, segment) -> its output's term, until its backward
        # a stage whose successor runs on this device too keeps its output until its own
        # backward: (pipe, stage, microbatch, segment) -> the terms held for it
        self.held_local: dict = {}
        self.local_grads: dict = {}  # (pipe, stage, microbatch, segment): the gradients handed to it here
        # (pipe, stage, microbatch, segment) -> the outputs of predecessors here that it read as
        # its input at full precision, which they hold (with the copies they sent elsewhere)
        self.shared_in: dict = {}
        self.waiting: set = set()  # (rep, microbatch, segment): an empty I left its gradients to its W
        self.scattered: dict = {}  # ZeRO-2: rep -> its gradient slice's term, from its REDUCE to its STEP
        self.reduced: dict[int, array] = {}  # a REDUCE's number -> its steps (walked once, placed in each walk)
        self.flats: list[int] = []  # a replicated stage's gradients, flattened for their all-reduce

    def _emit_both(self, steps) -> None:
        self.own.extend(steps)
        self.twin.extend(steps)

    def key(self, *k) -> int:
        got = self.index.get(k)
        if got is None:
            got = self.index[k] = len(self.index)
        return got

    def flat(self, steps) -> array:
        """``steps`` ((category, term's key or None, count), ...) as the tape holds them."""
        out: list = []
        for cat, k, n in steps:
            out += (cat, -1 if k is None else self.key(*k), n)
        return array("d", out)

    def one(self, cat: int, term: int, n: int) -> array:
        """The step (category, term's number, count), as the tape holds it (made once)."""
        got = self._ones.get((cat, term, n))
        if got is None:
            got = self._ones[(cat, term, n)] = array("d", (cat, term, n))
        return got

    def piece(self, name: str, e, *hinges) -> tuple:
        """The steps of the method ``_<name>(e, *hinges)``, made once per (pipe, stage,
        segment) of ``e`` and ``hinges`` (a piece reads nothing else of the action)."""
        k = (name, e.pipe, e.stage, e.segment, *hinges)
        got = self._pieces.get(k)
        if got is None or not self.reuse:
            got = self._pieces[k] = self.flat(getattr(self, "_" + name)(e.pipe, e.stage, e.segment, *hinges))
        return got

    def neighbours(self, pipe: int, stage: int) -> tuple:
        """(predecessors, successors) of (pipe, stage) that run on other devices."""
        got = self._away.get((pipe, stage))
        if got is None:
            f = self.facts
            got = self._away[(pipe, stage)] = (
                [t for t in f.graph.preds[stage] if f.placement.device(pipe, t) != self.d],
                [t for t in f.graph.succs[stage] if f.placement.device(pipe, t) != self.d])
        return got

    def here(self, pipe: int, stage: int) -> tuple:
        """(predecessors, successors) of (pipe, stage) that run on this device too."""
        got = self._here.get((pipe, stage))
        if got is None:
            f = self.facts
            got = self._here[(pipe, stage)] = (
                [t for t in f.graph.preds[stage] if f.placement.device(pipe, t) == self.d],
                [t for t in f.graph.succs[stage] if f.placement.device(pipe, t) == self.d])
        return got

    def run(self) -> tuple[Tape, Tape | None]:
        """The walk: (its tape, the bare twin's or None)."""
        f, bare = self.facts, self.bare
        self.state()
        order = f.orders[self.d]
        mine = [a for a in order if a.kind in WALKED]
        after = reduces_after(order, WALKED)
        posted = self.receives(mine)
        # the bare twin's: its list without the GATHERs and FREEs
        mine_b = [a for a in mine if a.kind != GATHER and a.kind != FREE] if bare else []
        after_b = reduces_after(order, (F, B, I, W, STEP)) if bare else {}
        posted_b = self.receives(mine_b)
        ib = -1  # the bare twin's index into mine_b
        preds, own, starts = f.graph.preds, self.own, self.starts
        for i, e in enumerate(mine):
            starts.append((len(own) // 3, e))  # (named as the runtime names it where a walk reports it)
            kind = e.kind
            self.walk_in(self.emit_own, after.get(i - 1, ()), posted[i])
            if kind == GATHER or kind == FREE:
                self.gather_or_free(e)
                continue
            if bare:
                ib += 1
                self.starts_b.append((len(self.twin) // 3, e))
                self.walk_in(self.emit_twin, after_b.get(ib - 1, ()), posted_b[ib])
            if kind == STEP:
                self.step(e)
                continue
            if kind != W and self.sent:
                self.prove_arrivals(e)
            if kind == F:
                self.forward(e)
            elif not preds[e.stage] and kind == I:  # a first stage's I is empty, its W the whole backward
                self.empty_input(e)
            elif kind == W and preds[e.stage]:
                self.weight(e)
            else:
                self.backward(e)
        tape = Tape(list(self.index), self.own, self.starts)
        return tape, (Tape(tape.terms, self.twin, self.starts_b) if bare else None)

    def state(self) -> None:
        """What the device holds for the whole run: its stages' parameters (full: the
        parameters' shard; GATHER adds the whole ones, FREE takes them), optimizer state
        (a slice where sharded; AMDP's ZeRO: the stages it owns) and weight versions."""
        f, flat = self.facts, self.flat
        for _, s in self.reps:
            self.emit_own(flat([(PARAMS, ("parameter_shard", s, f.count[s]) if f.shard == "full" and s in f.sliced
                                 else ("state", s, "parameters"), 1)]))
            if self.bare:
                self.emit_twin(flat([(PARAMS, ("state", s, "parameters"), 1)]))
            if s in f.sliced:
                self.emit(flat([(OPT, ("sharded_optimizer_state", s, f.count[s]), 1)]))
            elif f.owners is None or f.owners[s] == self.d:
                self.emit(flat([(OPT, ("state", s, "optimizer_state"), 1)]))
            if f.asynchronous:  # (a synchronous schedule's stages hold one version each)
                self.emit(flat([(VERS, ("extra_versions", self.d, s), 1 / len(self.reps))]))
        self.emit(array("d", INSTANT))

    def receives(self, actions: list) -> list:
        """Per index into ``actions``, the receive buffers posted then: a message from
        another device lands in a buffer posted before the action ahead of the one that
        needs it (a gradient's buffer lives until its backward is done, an activation's
        becomes the stage's input, an activation, when its forward starts)."""
        posted: list[list] = [[] for _ in range(len(actions) + 1)]
        for i, e in enumerate(actions):
            if e.kind == F:
                posted[max(0, i - 1)] += [("message_bytes", t, e.stage, e.segment)
                                          for t in self.neighbours(e.pipe, e.stage)[0]]
            elif e.kind == B or e.kind == I:
                posted[max(0, i - 1)] += [("message_bytes", e.stage, t, e.segment)
                                          for t in self.neighbours(e.pipe, e.stage)[1]]
        made: dict[tuple, array] = {}
        for i, ks in enumerate(posted):
            got = None
            if ks:
                got = made.get(ks := tuple(ks))
                if got is None:
                    got = made[ks] = self.flat([(INS, k, 1) for k in ks] + [NOTHING])
            posted[i] = got
        return posted

    def walk_in(self, emit, reduces, posts) -> None:
        """The REDUCEs after the action before and the receives posted now, into a walk."""
        for s, n in reduces:
            emit(self.reduce_steps(s, n))
        if posts:
            emit(posts)

    def reduce_steps(self, s: int, n: int) -> tuple:
        """REDUCE number ``n`` (of stage ``s``)'s steps, and what it leaves to the STEP."""
        got = self.reduced.get(n)
        if got is not None:
            return got
        f, key = self.facts, self.key
        got = []
        if s in f.sliced and f.shard != "optimizer":  # laid end to end (the tied copy's apart)
            self.flats.append(key("flat_gradients", s))  # for the reduce-scatter; then they
            got += [(_TEMP, self.flats[-1], 1), INSTANT,  # go, and this replica's slice arrives
                    (GRADS, key("scattered_gradients", s), -1)]
            for r in (r for r in self.reps if r[1] == s):
                self.scattered[r] = key("gradient_slice", s, f.count[s])
                got.append((GRADS, self.scattered[r], 1))
        elif s in f.replicated:  # a copy of the stage's gradients, flattened for the all-reduce
            self.flats.append(key("flat_gradients", s))
            got += [(_TEMP, self.flats[-1], 1), INSTANT]  # each held to the step: the last all-reduce holds them all
        got = self.reduced[n] = array("d", (x for step in got for x in step))
        return got

    def gather_or_free(self, e) -> None:
        """Full sharding: the whole parameters gathered, or let go for the own share
        (while gathered, the share is the flat's part)."""
        whole, own = ("flat_parameters", e.stage), ("own_share", e.stage, self.facts.count[e.stage])
        if e.kind == FREE:
            whole, own = own, whole
        self.emit_own(self.flat([(PARAMS, whole, 1), NOTHING, (PARAMS, own, -1)]))

    def step(self, e) -> None:
        """An optimizer step: the flattened gradients copied back and let go, the
        optimizer's buffers beside the gradients (ZeRO-1/2: of a slice), then the
        gradients and casts gone; a tied weight's gradient held until its update."""
        f, rep, stage = self.facts, (e.pipe, e.stage), e.stage
        steps: list = [(_TEMP, k, -1) for k in self.flats]
        self.flats.clear()
        emit = self.emit
        emit(array("d", (x for step in steps for x in step)))
        for walk, shard in ((self.emit_own, f.shard), (self.emit_twin if self.bare else None, self.bare)):
            if walk is not None:
                walk(self.flat([(-1, ("sharded_step_workspace", stage, f.count[stage], shard) if stage in f.sliced
                                 else ("step_workspace_bytes", stage), 0)]))
        if rep in self.scattered:  # ZeRO-2: what is left of its gradients, the tied copy's and the slice
            emit(self.flat([(GRADS, ("state", stage, "gradients"), -1), (GRADS, ("scattered_gradients", stage), 1)]))
            emit(self.one(GRADS, self.scattered.pop(rep), -1))
            self.grads_on.discard(rep)
        elif rep in self.grads_on:
            emit(self.flat([(GRADS, ("state", stage, "gradients"), -1)]))
            self.grads_on.discard(rep)
        if rep in self.casts_on:
            emit(self.flat([(CASTS, ("state", stage, "casts"), -1)]))
            self.casts_on.discard(rep)
        if stage in (0, f.nstages - 1) and self.plan_here:
            applied = self.plan_here.get((e.pipe, stage, e.version), [])
            tied = self.key("tied_gradient_bytes", stage)
            if e.version not in applied:
                self.tied_held.add((rep, e.version))
                emit(self.one(GRADS, tied, 1))
            for u in applied:
                if (rep, u) in self.tied_held:
                    self.tied_held.discard((rep, u))
                    emit(self.one(GRADS, tied, -1))

    def prove_arrivals(self, e) -> None:
        """The messages this action waits for prove the sends their makers had consumed:
        those copies go."""
        f, mb, pipe, seg = self.facts, e.microbatch, e.pipe, e.segment
        away_in, away_out = self.neighbours(pipe, e.stage)
        if e.kind == F:
            makers = [f.forward_at(t, mb, pipe, seg) for t in away_in]
        else:
            makers = [f.backward_at(t, mb, pipe, seg) for t in away_out]
        for maker in makers:
            if maker is not None:
                for term in self.sent.proven_by(maker):
                    self.emit(self.one(OUTS, term, -1))

    # F --------------------------------------------------------------------------------
    def forward(self, e) -> None:
        """F: its input arrives into the activations, the casts made (once, or per
        microbatch when asynchronous), its most on top of what it keeps, and its output
        held (with the copies it is sent as) until its backward and the proof."""
        f, rep, stage, seg, mb = self.facts, (e.pipe, e.stage), e.stage, e.segment, e.microbatch
        self.emit(self.piece("forward_in", e))
        if self.here(e.pipe, stage)[0]:
            self.inputs_here(e)
        cast = f.asynchronous or rep not in self.casts_on  # this microbatch's own casts, or the stage's first
        if cast and not f.asynchronous:
            self.casts_on.add(rep)
            self.cast_by[rep] = (mb, seg)
        self.emit(self.piece("forward_out", e, cast))
        away_out = self.neighbours(e.pipe, stage)[1]
        if away_out:
            self.held_out[(rep, mb, seg)] = self.key("output_bytes", stage, seg)
            sent = self.key("sent_copy_bytes", stage, seg)
            for t in away_out:
                self.sent.hold((e.pipe, stage, mb, seg, t), sent, f.forward_at(t, mb, e.pipe, seg))
        elif f.graph.succs[stage]:
            self.held_local[(e.pipe, stage, mb, seg)] = [self.key("local_output_bytes", stage, seg)]

    def _forward_in(self, pipe: int, stage: int, seg: int) -> list:
        """Its input arrived from elsewhere becomes its activations."""
        return ([(INS, ("message_bytes", t, stage, seg), -1) for t in self.neighbours(pipe, stage)[0]]
                + [(ACTS, ("activation_bytes", stage, seg), 1)])

    def _forward_out(self, pipe: int, stage: int, seg: int, cast: bool) -> list:
        """The casts it makes; its most: what it keeps and holds a moment on top (a head's
        loss; a tensor group's MLP); its output: to successors elsewhere the output and the
        copy it is sent as (output_bytes), at 16 bits one copy more for each successor
        beyond the first (the executor casts it per send), each let go once its own peer
        proves it arrived; to successors here only, the output they read."""
        late = ("forward_late_saved_bytes", stage, seg)
        steps = [(CASTS, ("state", stage, "casts"), 1)] if cast else []
        steps += [(ACTS, late, -1), (-1, ("forward_workspace_bytes", stage, seg), 0), (ACTS, late, 1)]
        away_out = self.neighbours(pipe, stage)[1]
        if away_out:
            steps.append((OUTS, ("output_bytes", stage, seg), 1))
            steps += [(OUTS, ("sent_copy_bytes", stage, seg), 1)] * (len(away_out) - 1)
            steps.append(NOTHING)
        elif self.facts.graph.succs[stage]:  # every successor here (one elsewhere holds the output already)
            steps.append((OUTS, ("local_output_bytes", stage, seg), 1))
        return steps

    def inputs_here(self, e) -> None:
        """A predecessor on this device: at full precision its output is this stage's
        input, counted with this stage's activations; the runtime names it the
        predecessor's output (its forward made it), held to the predecessor's backward."""
        mb, seg = e.microbatch, e.segment
        for t in self.here(e.pipe, e.stage)[0]:
            held = self.held_local.get((e.pipe, t, mb, seg))
            k = self.key("shared_output_bytes", t, seg)
            if held is not None:
                held.append(k)
                self.emit(self.one(ACTS, k, -1))
                self.emit(self.one(OUTS, k, 1))
            elif ((e.pipe, t), mb, seg) in self.held_out:  # held with its sent copy already
                self.shared_in.setdefault((e.pipe, e.stage, mb, seg), []).append(k)
                self.emit(self.one(ACTS, k, -1))

    # a first stage's I ----------------------------------------------------------------
    def empty_input(self, e) -> None:
        """A first stage's I (its input needs no gradient: pipeflow.runtime.backward): the
        gradient that arrived for it waits for the W (:meth:`_waiting`)."""
        self.waiting.add(((e.pipe, e.stage), e.microbatch, e.segment))
        self.emit(self.piece("waiting", e, True))

    def _waiting(self, pipe: int, stage: int, seg: int, start: bool) -> list:
        """From an empty I to its W (``start``; else back): the gradients that arrived,
        at 16 bits as the one fp32 copy the executor restored at I (of their sum, where
        several successors sent one), a temporary, the messages let go."""
        moved = [(INS if self.facts.placement.device(pipe, t) != self.d else OUTS,  # a local one: its maker's
                  ("waiting_message_bytes", stage, t, seg), ("message_bytes", stage, t, seg))
                 for t in self.facts.graph.succs[stage]]
        restored = ("restored_gradient_bytes", stage, self.facts.graph.succs[stage][0], seg) if moved else None
        if start:
            steps = [step for cat, m, k in moved for step in ((cat, k, -1), (cat, m, 1))]
            return steps + ([(_TEMP, restored, 1)] if moved else [])
        # back to the messages a backward's working set counts it beside (its fp32
        # restore is in the working set: BackwardWorkingSet)
        steps = [(_TEMP, restored, -1)] if moved else []
        return steps + [step for cat, m, k in moved for step in ((cat, m, -1), (cat, k, 1))]

    # B, I, and a first stage's W --------------------------------------------------------
    def backward(self, e) -> None:
        """B, a non-empty I, or a first stage's W (its whole backward): the working set at
        its peak, then what it held for its microbatch let go and the gradients it hands
        on held."""
        f, kind, rep, mb, seg, pipe = self.facts, e.kind, (e.pipe, e.stage), e.microbatch, e.segment, e.pipe
        emit, here = self.emit, self.here(pipe, e.stage)
        arrived = kind != W
        if kind == W and (rep, mb, seg) in self.waiting:
            self.waiting.discard((rep, mb, seg))
            emit(self.piece("waiting", e, False))
            arrived = True
        if kind == I:
            emit(self.piece("input_peak", e))
        else:
            fresh = rep not in self.grads_on
            through = rep in self.casts_on and self.cast_by.get(rep) != (mb, seg)
            emit(self.piece("working_set", e, fresh, through))
        self.output_done(e)
        if arrived:
            emit(self.piece("arrived_done", e))
        for k in self.local_grads.pop((pipe, e.stage, mb, seg), ()):
            emit(self.one(OUTS, k, -1))
        for t in here[0]:
            # a gradient handed to a stage on this device (in the wire's dtype, as sent):
            # held until that stage's backward is done with it
            self.local_grads.setdefault((pipe, t, mb, seg), []).append(k := self.key("message_bytes", t, e.stage, seg))
            emit(self.one(OUTS, k, 1))
        emit(self.piece("backward_done", e))
        for p in self.neighbours(pipe, e.stage)[0]:  # the gradients it sent back, until proven arrived
            self.sent.hold(("sent", pipe, p, e.stage, mb, seg), self.key("message_bytes", p, e.stage, seg),
                           f.backward_at(p, mb, pipe, seg))
        for k in self.held_local.pop((pipe, e.stage, mb, seg), ()):
            emit(self.one(OUTS, k, -1))
        for t in here[0]:  # (the shared output: out of this stage's activations since its forward)
            if (pipe, t, mb, seg) in self.held_local:
                emit(self.one(ACTS, self.key("shared_output_bytes", t, seg), 1))
        for k in self.shared_in.pop((pipe, e.stage, mb, seg), ()):
            emit(self.one(ACTS, k, 1))
        self.finish(e)

    def _input_peak(self, pipe: int, stage: int, seg: int) -> list:
        """I's peak: what it has kept by then (less what it has freed) is held with the
        activations for that instant; the rest of its working set is temporary."""
        kept, freed = ("input_kept_bytes", stage, seg), ("input_freed_bytes", stage, seg)
        return [(ACTS, freed, -1), (RESID, kept, 1), (-1, ("during_input", stage, seg), 0), (RESID, kept, -1),
                (ACTS, freed, 1)]

    def _working_set(self, pipe: int, stage: int, seg: int, fresh: bool, through: bool) -> list:
        """B's peaks: what it has freed by its peak leaves the activations for that
        instant; a backward into a stage with no gradients yet (``fresh``) has made some
        by then; through casts an earlier forward made, two instants more (at its blocks'
        attention, beside the gradients it has made so far, and near its end, its
        activations gone: see held_cast_gradients)."""
        fresh_ = ("fresh",) if fresh else ()
        own = ("own_casts",) if self.facts.asynchronous else ()  # casts of its own, each gone with its weight's backward
        freed, made = ("backward_freed_bytes", stage, seg, *fresh_, *own), ("backward_grads_made_bytes", stage, seg, *own)
        steps = [(ACTS, freed, -1)] + ([(GRADS, made, 1)] if fresh else [])
        steps += [(-1, ("during_backward", stage, seg, *fresh_, *own), 0), (ACTS, freed, 1)]
        if through:
            cf = ("cast_phase_freed_bytes", stage, seg)
            steps += [(ACTS, cf, -1), (-1, ("cast_phase_bytes", stage, seg), 0), (ACTS, cf, 1)]
        if fresh:
            steps.append((GRADS, made, -1))
        if through:
            act = ("activation_bytes", stage, seg)
            steps += [(ACTS, act, -1), (-1, ("held_cast_gradients", stage, seg), 0), (ACTS, act, 1)]
        return steps

    def output_done(self, e) -> None:
        """The output a forward sent elsewhere, kept through its backward, goes with the
        copies sent of it (those proven arrived went earlier)."""
        rep, stage, seg, mb = (e.pipe, e.stage), e.stage, e.segment, e.microbatch
        out_k = self.held_out.pop((rep, mb, seg), None)
        if out_k is None:
            return
        self.emit(self.one(OUTS, out_k, -1))
        for n, t in enumerate(self.neighbours(e.pipe, stage)[1]):
            proven = self.sent.release((e.pipe, stage, mb, seg, t))
            if n:  # the copies beyond output_bytes' one
                self.emit(self.one(OUTS, self.key("sent_copy_bytes", stage, seg), -1))
            if proven is not None:  # that copy went earlier
                self.emit(self.one(OUTS, proven, 1))

    def _arrived_done(self, pipe: int, stage: int, seg: int) -> list:
        """The gradients that arrived from elsewhere, let go."""
        return [(INS, ("message_bytes", stage, t, seg), -1) for t in self.neighbours(pipe, stage)[1]]

    def _backward_done(self, pipe: int, stage: int, seg: int) -> list:
        """The gradients it sends back held (until proven arrived); Seq1F1B's key/value
        gradients (the engine's rule, sim.engine._kv_gradient: a microbatch's first
        backward on a stage, its last segment's, allocates those of every earlier
        segment; each earlier segment's backward frees its own); its activations and
        (asynchronous) its own casts gone."""
        steps = [(OUTS, ("message_bytes", p, stage, seg), 1) for p in self.neighbours(pipe, stage)[0]]
        nseg = self.facts.nseg
        if nseg > 1 and seg == nseg - 1:
            steps += [(ACTS, ("kv_gradient_bytes", stage, j), 1) for j in range(seg)]
        elif nseg > 1:
            steps.append((ACTS, ("kv_gradient_bytes", stage, seg), -1))
        steps.append((ACTS, ("activation_bytes", stage, seg), -1))
        if self.facts.asynchronous:
            steps.append((CASTS, ("state", stage, "casts"), -1))
        return steps

    # W ----------------------------------------------------------------------------------
    def weight(self, e) -> None:
        """W (of a stage with an input gradient, its I done): at its products, what I
        kept for it still held; then that goes."""
        rep = (e.pipe, e.stage)
        fresh = rep not in self.grads_on
        self.grads_on.add(rep)
        self.emit(self.piece("weight", e, fresh))
        self.finish(e)

    def _weight(self, pipe: int, stage: int, seg: int, fresh: bool) -> list:
        steps = [(GRADS, ("state", stage, "gradients"), 1)] if fresh else []
        return steps + [(-1, ("weight_workspace_bytes", stage, seg, *(("fresh",) if fresh else ())), 0),
                        (RESID, ("weight_residual_bytes", stage, seg), -1)]

    def finish(self, e) -> None:
        """After a backward: an I keeps what its W needs; a B or W's stage holds its
        gradients from its first; then an instant."""
        rep = (e.pipe, e.stage)
        first = e.kind != I and rep not in self.grads_on
        if first:
            self.grads_on.add(rep)
        self.emit(self.piece("closing", e, e.kind == I, first))

    def _closing(self, pipe: int, stage: int, seg: int, input_: bool, first: bool) -> list:
        steps = [(RESID, ("weight_residual_bytes", stage, seg), 1)] if input_ else []
        if first:
            steps.append((GRADS, ("state", stage, "gradients"), 1))
        return steps + [NOTHING]


def tapes(schedule, devices=None, replicas: int = 1, bare: str | None = None):
    """Each device's :class:`Tape` (of ``devices`` only, where given). ``replicas``: see
    :class:`StepFacts`. ``bare`` (gradients): the schedule is fully sharded (its GATHERs
    and FREEs lowered), and its twin without them under ``pipeline.shard=bare`` is walked
    in the same pass (:class:`DeviceWalk`): returns (its tapes, the twin's)."""
    if bare is not None and (getattr(schedule, "shard", "none") != "full" or bare != "gradients"):
        raise ValueError(f"tapes(bare={bare!r}): a fully sharded schedule's twin under gradients only")
    facts = StepFacts(schedule, replicas)
    walked = [DeviceWalk(facts, d, bare).run() for d in (range(len(schedule.orders)) if devices is None else devices)]
    out = [t for t, _ in walked]
    return out if bare is None else (out, [t for _, t in walked])
