"""One device's walk over its actions in order: the memory terms each holds and lets go, recorded as a
:class:`~pipeflow.sim.memory_tape.Tape` for :mod:`pipeflow.sim.device_memory`. :class:`DeviceWalk` walks
one device (the backwards: :mod:`pipeflow.sim.backward_walk`); :func:`tapes`, each."""
# What an action holds mostly hinges on its stage and segment alone: such a piece is written
# once and copied, so a walk is linear in its actions (a 64-stage 1,024-microbatch 1F1B: 1.8M steps).

from __future__ import annotations

from array import array

from ..schedules.ir import Kind
from .backward_walk import BackwardWalk
from .memory_tape import _TEMP, Tape
from .sent_copies import SentCopies
from .step_facts import StepFacts
from .tape_steps import (ACTS, CASTS, FREE, GATHER, GRADS, INS, INSTANT, NOTHING, OPT, OUTS, PARAMS, STEP, VERS, WALKED,
                         B, F, I, W)


def reduces_after(order: list, kinds: tuple) -> dict[int, list]:
    """Index into the device's list of ``kinds`` -> the REDUCEs that follow it, (stage, number)."""
    out: dict[int, list] = {}
    seen, n = -1, 0
    for a in order:
        if a.kind == Kind.REDUCE:
            out.setdefault(seen, []).append((a.stage, n))
            n += 1
        elif a.kind in kinds:
            seen += 1
    return out


class DeviceWalk(BackwardWalk):
    """Device ``d``'s tape; with ``bare``, also the tape of the schedule's twin without GATHERs and FREEs
    (``pipeline.shard=bare``), sharing one list of terms. A kind's method copies its pieces
    (:meth:`piece`) and walks the rest."""

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
        """The steps of ``_<name>(e, *hinges)``, made once per (pipe, stage, segment) and ``hinges``."""
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
        """What the device holds for the whole run: parameters (or their shard), optimizer state (or its
        slice, or only owned stages') and weight versions."""
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
        """Per index into ``actions``, the receive buffers posted then."""
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
        """Full sharding: the whole parameters gathered, or let go for the own share."""
        whole, own = ("flat_parameters", e.stage), ("own_share", e.stage, self.facts.count[e.stage])
        if e.kind == FREE:
            whole, own = own, whole
        self.emit_own(self.flat([(PARAMS, whole, 1), NOTHING, (PARAMS, own, -1)]))

    def step(self, e) -> None:
        """An optimizer step: flattened gradients let go, the step's buffers at an instant, then gradients
        and casts gone; a tied gradient held until its update."""
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
        """Let go of the sent copies the messages this action waits for prove arrived."""
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
        """F: its input into the activations, the casts (once, or per microbatch when asynchronous), its
        most on top, its output held until its backward and the proof."""
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
        """The casts it makes, its most on top of what it keeps, and its output: with one copy per successor
        elsewhere beyond the first (each let go once proven), or the output successors here read."""
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
        """A predecessor on this device: at full precision its output is this stage's input, named the
        predecessor's output and held to the predecessor's backward."""
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


def tapes(schedule, devices=None, replicas: int = 1, bare: str | None = None):
    """Each device's :class:`Tape` (of ``devices`` only, where given; ``replicas``: see :class:`StepFacts`).
    ``bare`` ("gradients", a fully sharded schedule): (its tapes, the bare twin's); ValueError otherwise."""
    if bare is not None and (getattr(schedule, "shard", "none") != "full" or bare != "gradients"):
        raise ValueError(f"tapes(bare={bare!r}): a fully sharded schedule's twin under gradients only")
    facts = StepFacts(schedule, replicas)
    walked = [DeviceWalk(facts, d, bare).run() for d in (range(len(schedule.orders)) if devices is None else devices)]
    out = [t for t, _ in walked]
    return out if bare is None else (out, [t for _, t in walked])
