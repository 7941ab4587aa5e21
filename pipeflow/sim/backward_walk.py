"""One device's memory walk over its backwards (B, I, W): the working set at each peak, what each lets go
and the gradients it hands on."""

from __future__ import annotations

from .memory_tape import _TEMP
from .tape_steps import ACTS, CASTS, GRADS, I, INS, NOTHING, OUTS, RESID, W


class BackwardWalk:
    """The backwards of :class:`~pipeflow.sim.device_walk.DeviceWalk` (a mixin on its state)."""

    # a first stage's I ----------------------------------------------------------------
    def empty_input(self, e) -> None:
        """A first stage's empty I: the gradient that arrived for it waits for the W."""
        self.waiting.add(((e.pipe, e.stage), e.microbatch, e.segment))
        self.emit(self.piece("waiting", e, True))

    def _waiting(self, pipe: int, stage: int, seg: int, start: bool) -> list:
        """From an empty I to its W (``start``; else back): the arrived gradients as the one fp32 copy
        restored at I, a temporary, the messages let go."""
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
        """B, a non-empty I, or a first stage's W: the working set at its peak, then what it held for its
        microbatch let go and the gradients it hands on held."""
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
        """I's peak: what it has kept (less what it freed) held with the activations for that instant, the
        rest of its working set temporary."""
        kept, freed = ("input_kept_bytes", stage, seg), ("input_freed_bytes", stage, seg)
        return [(ACTS, freed, -1), (RESID, kept, 1), (-1, ("during_input", stage, seg), 0), (RESID, kept, -1),
                (ACTS, freed, 1)]

    def _working_set(self, pipe: int, stage: int, seg: int, fresh: bool, through: bool) -> list:
        """B's peaks: its own (``fresh``: with the gradients made by then), and ``through`` casts an earlier
        forward made two more (the blocks' attention, and near its end)."""
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
        """The output a forward sent elsewhere goes at its backward, with its sent copies."""
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
        """The gradients it sends back held until proven arrived, Seq1F1B's key/value gradients
        (:func:`pipeflow.sim.engine._kv_gradient`'s rule), its activations and (asynchronous) its own
        casts gone."""
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
        """W of a stage with an input gradient: its products with I's residuals held, then those go."""
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
        """After a backward: an I keeps what its W needs; a B or W's stage holds its gradients from its
        first; then an instant."""
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
