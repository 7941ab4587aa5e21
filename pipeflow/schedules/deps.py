"""Dependencies between actions, derived from the stage graph and placement, never listed.

F(s, mb, seg)      needs F(p, mb, seg) for every predecessor p of s, and F(s, mb, seg-1)
B|I(s, mb, seg)    needs B|I(t, mb, seg) for every successor t, F(s, mb, seg), B|I(s, mb, seg+1)
W(s, mb, seg)      needs I(s, mb, seg)
REDUCE(s, j, k)    needs the weight-gradient actions (B or W) of stage s, pipe j, update k
STEP(s, j, k)      needs REDUCE(s, j, k) when replicated, else those same actions
A fully sharded stage's compute also needs its preceding GATHER on the device
(pipeflow.schedules.sharding); GATHER and FREE wait for their device's previous action.

A dependency between stages *carries a tensor* (an activation or a gradient): a message
when on different devices."""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import itemgetter
from typing import NamedTuple, Sequence

import numpy as np

from .ir import Action, Kind, Schedule


class Dep(NamedTuple):
    action: Action
    carries_tensor: bool  # activation (F->F) or gradient (B|I -> B|I) between stages


class DepResolver:
    """Answers "what does this action wait for" for one schedule (built once: an index of the
    actions, matching a backward to the B or I that made its successor's input gradient)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.graph = schedule.graph
        self.nseg = schedule.num_segments
        every = list(chain.from_iterable(schedule.orders))
        kinds = set(map(itemgetter(0), every))
        self.split = Kind.I in kinds
        self.replicated = schedule.placement.num_pipes > 1
        self.has_reduce = Kind.REDUCE in kinds
        # weight-gradient producers per (stage, pipe, update) for REDUCE/STEP
        self._wgrad: dict[tuple[int, int, int], list[Action]] = {}
        if Kind.REDUCE in kinds or Kind.STEP in kinds:
            update = dict(enumerate(schedule.update_of_microbatch))  # -1 for a microbatch out of range
            wgrads = list(compress(every, map(Kind.WEIGHT_GRAD.__contains__, map(itemgetter(0), every))))
            keys = zip(map(itemgetter(1), wgrads), map(itemgetter(3), wgrads),
                       map(update.get, map(itemgetter(2), wgrads), repeat(-1)))
            for key, a in zip(keys, wgrads):
                self._wgrad.setdefault(key, []).append(a)
        # Nearly every schedule uses one backward kind throughout; then no per-action
        # look-up per dependency is needed
        self._backward_kind: dict[tuple[int, int, int], str] = {}
        self._only_kind = None
        if kinds >= Kind.BACKWARD:
            self._backward_kind = {(a[1], a[2], a[4]): a[0] for a in every if a[0] in Kind.BACKWARD}
        elif kinds & Kind.BACKWARD:
            self._only_kind = min(kinds & Kind.BACKWARD)
        # pipeline.shard=full: each compute action of a sharded stage -> its GATHER
        self._gathered_by: dict[Action, Action] = {}
        for order in schedule.orders if Kind.GATHER in kinds else ():
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
        if k == Kind.REDUCE or k == Kind.STEP:
            return [Dep(w, False) for w in self._update_deps(a)]
        return []

    def _update_deps(self, a: Action) -> list[Action]:
        """What a REDUCE or a STEP waits for (no tensor): the weight gradients of its
        stage, pipe and update, or, for a replicated stage's STEP, its REDUCE."""
        _, s, _, pipe, _, version = a
        if a[0] == Kind.STEP and self.has_reduce and self.replicated:
            return [Action(Kind.REDUCE, s, -1, pipe, 0, version)]
        return self._wgrad.get((s, pipe, version), [])

    def numbered_deps(self, actions: Sequence[Action], index: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """deps() of every action in ``actions`` at once, numbered by ``index`` (action -> number;
        -1 for a dependency it does not hold): (position of the waiting action, the dependency's
        number, whether it carries a tensor) per dependency, in the order of ``actions`` and of
        deps(). One pass per action kind, no call per action."""
        kinds = np.array(list(map(itemgetter(0), actions)))
        batches = []  # (positions, dependencies (plain tuples hash and compare as Actions), carries)
        for kind in np.unique(kinds).tolist():
            positions = np.flatnonzero(kinds == kind).tolist()
            of_kind = list(zip(positions, map(actions.__getitem__, positions)))
            if kind == Kind.F:
                batches += self._forward_deps(of_kind)
            elif kind in Kind.BACKWARD:
                batches += self._backward_deps(of_kind)
            elif kind == Kind.W:
                batches.append((positions, [(Kind.I, a[1], a[2], a[3], a[4], -1) for _, a in of_kind], False))
            elif kind == Kind.REDUCE or kind == Kind.STEP:
                lists = [self._update_deps(a) for _, a in of_kind]
                batches.append((list(chain.from_iterable(map(repeat, positions, map(len, lists)))),
                                list(chain.from_iterable(lists)), False))
        if self._gathered_by:
            gathers = [(i, self._gathered_by.get(a)) for i, a in enumerate(actions)]
            gathers = [(i, g) for i, g in gathers if g is not None]
            batches.append(([i for i, _ in gathers], [g for _, g in gathers], False))
        where = np.fromiter(chain.from_iterable(b[0] for b in batches), dtype=np.intp)
        numbers = np.fromiter(map(index.get, chain.from_iterable(b[1] for b in batches), repeat(-1)), dtype=np.intp,
                              count=len(where))
        carries = np.repeat(np.array([b[2] for b in batches], dtype=bool), [len(b[0]) for b in batches])
        order = np.argsort(where, kind="stable")  # batch after batch, then each action's in order
        return where[order], numbers[order], carries[order]

    def _forward_deps(self, fwd: list[tuple[int, Action]]) -> list[tuple]:
        """numbered_deps' batches of the forwards ``fwd`` (position, action): their inputs
        from the stage's predecessors, then the earlier segment."""
        preds, F = self.graph.preds, Kind.F
        later = [(i, a) for i, a in fwd if a[4] > 0]
        return [([i for i, a in fwd for _ in preds[a[1]]],
                 [(F, p, a[2], a[3], a[4], -1) for _, a in fwd for p in preds[a[1]]], True),
                ([i for i, _ in later], [(F, a[1], a[2], a[3], a[4] - 1, -1) for _, a in later], False)]

    def _backward_deps(self, bwd: list[tuple[int, Action]]) -> list[tuple]:
        """numbered_deps' batches of the backwards (B or I) ``bwd``: the input gradients from
        the stage's successors, the forward, then the later segment's backward."""
        succs, only = self.graph.succs, self._only_kind
        if only is not None:
            grads = [(only, t, a[2], a[3], a[4], -1) for _, a in bwd for t in succs[a[1]]]
        else:
            grads = [self.backward_of(t, a[2], a[3], a[4]) for _, a in bwd for t in succs[a[1]]]
        later = [(i, a) for i, a in bwd if a[4] + 1 < self.nseg]
        return [([i for i, a in bwd for _ in succs[a[1]]], grads, True),
                ([i for i, _ in bwd], [(Kind.F, a[1], a[2], a[3], a[4], -1) for _, a in bwd], False),
                ([i for i, _ in later], [self.backward_of(a[1], a[2], a[3], a[4] + 1) for _, a in later], False)]

    def reduce_group(self, a: Action) -> list[Action]:
        """All the actions that form one collective with ``a``: a REDUCE's of the same
        stage and update, a GATHER's of the same stage and count, on every pipe."""
        return [
            Action(a.kind, a.stage, -1, pipe, 0, a.version)
            for pipe in range(self.schedule.placement.num_pipes)
        ]
