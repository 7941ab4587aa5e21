"""Dependencies between actions, derived from the stage graph and placement, never listed.

F(s, mb, seg)      needs F(p, mb, seg) for every predecessor p of s   (activation)
                   and F(s, mb, seg-1)                                (earlier segment)
B|I(s, mb, seg)    needs B|I(t, mb, seg) for every successor t of s   (gradient)
                   and F(s, mb, seg), and B|I(s, mb, seg+1)           (segments in reverse)
W(s, mb, seg)      needs I(s, mb, seg)
REDUCE(s, j, k)    needs every weight-gradient action (B or W) of stage s on pipe j
                   for the microbatches of update k
STEP(s, j, k)      needs REDUCE(s, j, k) when the stage is replicated, else the same
                   weight-gradient actions REDUCE would have needed.
F|B|I|W of a fully sharded stage (pipeline.shard=full) also needs the GATHER of its
                   stage and pipe that precedes it on its device
                   (pipeflow.schedules.sharding); GATHER and FREE wait for their
                   device's previous action only.

A dependency *carries a tensor* when it is an activation or a gradient between
stages; on different devices that is a message, which the lowering pass turns into
send/recv and the simulator into a transfer.
"""

from __future__ import annotations

from typing import NamedTuple

from .ir import Action, Kind, Schedule


class Dep(NamedTuple):
    action: Action
    carries_tensor: bool  # activation (F->F) or gradient (B|I -> B|I) between stages


class DepResolver:
    """Answers "what does this action wait for" for one schedule.

    Built once per schedule: an index of which actions exist, so a backward can be
    matched to the B or the I that produced its successor's input gradient.
    """

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.graph = schedule.graph
        self.nseg = schedule.num_segments
        self.split = schedule.uses_split_backward()
        self.replicated = schedule.placement.num_pipes > 1
        self.has_reduce = any(a.kind == Kind.REDUCE for o in schedule.orders for a in o)
        # weight-gradient producers per (stage, pipe, update) for REDUCE/STEP
        self._wgrad: dict[tuple[int, int, int], list[Action]] = {}
        self._backward_kind: dict[tuple[int, int, int], str] = {}
        upd = schedule.update_of_microbatch
        for order in schedule.orders:
            for a in order:
                k = a.kind
                if k == Kind.B or k == Kind.W:
                    key = (a.stage, a.pipe, upd[a.microbatch] if 0 <= a.microbatch < len(upd) else -1)
                    self._wgrad.setdefault(key, []).append(a)
                if k == Kind.B or k == Kind.I:
                    self._backward_kind[(a.stage, a.microbatch, a.segment)] = k
        # Nearly every schedule uses one backward kind throughout; then no per-action
        # look-up is needed (this method runs once per action in the simulator's compile).
        kinds = set(self._backward_kind.values())
        self._only_kind = kinds.pop() if len(kinds) == 1 else None
        # pipeline.shard=full: each compute action of a sharded stage -> its GATHER
        self._gathered_by: dict[Action, Action] = {}
        for order in schedule.orders:
            held: dict[tuple[int, int], Action] = {}
            for a in order:
                if a.kind == Kind.GATHER:
                    held[(a.pipe, a.stage)] = a
                elif a.kind == Kind.FREE:
                    held.pop((a.pipe, a.stage), None)
                elif a.kind in Kind.COMPUTE and (a.pipe, a.stage) in held:
                    self._gathered_by[a] = held[(a.pipe, a.stage)]

    def backward_of(self, stage: int, mb: int, pipe: int, seg: int) -> Action:
        """The action producing the input gradient of (stage, mb, seg): its B or its I."""
        kind = self._only_kind or self._backward_kind.get((stage, mb, seg), Kind.I if self.split else Kind.B)
        return Action(kind, stage, mb, pipe, seg)

    def deps(self, a: Action) -> list[Dep]:
        out = self._deps(a)
        if self._gathered_by:
            g = self._gathered_by.get(a)
            if g is not None:
                out = [*out, Dep(g, False)]
        return out

    def _deps(self, a: Action) -> list[Dep]:
        k, s, mb, pipe, seg, version = a
        new = tuple.__new__  # plain tuple construction: this runs once per action
        if k == Kind.F:
            out = [new(Dep, (new(Action, (Kind.F, p, mb, pipe, seg, -1)), True)) for p in self.graph.preds[s]]
            if seg > 0:
                out.append(new(Dep, (new(Action, (Kind.F, s, mb, pipe, seg - 1, -1)), False)))
            return out
        if k == Kind.B or k == Kind.I:
            bkind = self._only_kind
            if bkind is None:
                out = [new(Dep, (self.backward_of(t, mb, pipe, seg), True)) for t in self.graph.succs[s]]
            else:
                out = [new(Dep, (new(Action, (bkind, t, mb, pipe, seg, -1)), True)) for t in self.graph.succs[s]]
            out.append(new(Dep, (new(Action, (Kind.F, s, mb, pipe, seg, -1)), False)))
            if seg + 1 < self.nseg:
                out.append(new(Dep, (self.backward_of(s, mb, pipe, seg + 1), False)))
            return out
        if k == Kind.W:
            return [new(Dep, (new(Action, (Kind.I, s, mb, pipe, seg, -1)), False))]
        if k == Kind.REDUCE:
            return [Dep(w, False) for w in self._wgrad.get((s, pipe, version), ())]
        if k == Kind.STEP:
            if self.has_reduce and self.replicated:
                return [Dep(Action(Kind.REDUCE, s, -1, pipe, 0, version), False)]
            return [Dep(w, False) for w in self._wgrad.get((s, pipe, version), ())]
        return []

    def reduce_group(self, a: Action) -> list[Action]:
        """All the actions that form one collective with ``a``: a REDUCE's of the same
        stage and update, a GATHER's of the same stage and count, on every pipe."""
        return [
            Action(a.kind, a.stage, -1, pipe, 0, a.version)
            for pipe in range(self.schedule.placement.num_pipes)
        ]
