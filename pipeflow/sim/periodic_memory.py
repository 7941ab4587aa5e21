"""A long schedule's memory from two short walks (:mod:`pipeflow.schedules.periods`): what
:meth:`Tape.walk <pipeflow.sim.memory_tape.Tape.walk>` says of a device k periods on follows
from each repeated block's own walk and net change, a block's copies peaking in the first
or, where it grows, the last."""

from __future__ import annotations

import numpy as np

from .tape_steps import WALKED
from .memory_peaks import encoded, split_periods
from .memory_tape import _TEMP, CATEGORIES, Tape

NCAT = len(CATEGORIES)


class _Block:
    """A stretch of a walk: each instant's levels from its start (category x instant, the extra
    term among the temporaries), the totals, the net change per category, how many actions
    started before each instant (``passed``) and its own action starts (``actions``)."""

    def __init__(self, steps: np.ndarray, values: np.ndarray, passed: np.ndarray, repeated: bool) -> None:
        self.repeated = repeated
        cat, term = steps[:, 0].astype(np.int64), steps[:, 1].astype(np.int64)
        adds = np.flatnonzero(cat >= 0)
        at = np.flatnonzero(cat < 0)
        level = np.zeros((NCAT, len(steps)))
        level[cat[adds], adds] = steps[adds, 2] * values[term[adds]]
        np.cumsum(level, axis=1, out=level)
        self.net = level[:, -1].copy() if len(steps) else np.zeros(NCAT)
        self.held = level[:, at]
        extra = values[term[at]]
        self.total = self.held.sum(axis=0) + extra
        self.held[_TEMP] += extra
        self.passed = passed[at]


class PeriodicTape:
    """One device's walk at k periods past ``small``, from ``small`` and ``big`` (the walk
    two periods on). Raises :class:`~pipeflow.sim.memory_peaks.NotPeriodic` where ``big``
    is not ``small`` with doubled blocks."""

    def __init__(self, small: Tape, big: Tape) -> None:
        index: dict = {}
        a, b = encoded(small, index), encoded(big, index)
        self.terms = list(index)
        self._blocks = split_periods(a, b)
        # where each block stands in the walk it came from (the small one's, a repeated
        # block's in the big one), to count the actions started before each of its steps
        starts_small = np.array([s for s, _ in small.starts], dtype=np.int64)
        starts_big = np.array([s for s, _ in big.starts], dtype=np.int64)
        self._passed = []
        self.actions_per_copy = []  # each repeated block's actions (it adds that many per period)
        i = 0  # into small
        inserted = 0  # the steps big holds before this point that small does not
        for steps, repeated in self._blocks:
            if repeated:
                j = i + inserted
                here = np.arange(j, j + len(steps))
                self._passed.append(np.searchsorted(starts_big, here, side="right") - 1)
                count = int(np.searchsorted(starts_big, j + len(steps)) - np.searchsorted(starts_big, j))
                self.actions_per_copy.append(count)
                inserted += 2 * len(steps)
            else:
                here = np.arange(i, i + len(steps))
                self._passed.append(np.searchsorted(starts_small, here, side="right") - 1)
                i += len(steps)
        self.small_actions = len(small.starts)

    def actions_at(self, k: int) -> int:
        """How many actions the device walks at k periods past the small walk."""
        return self.small_actions + k * sum(self.actions_per_copy)

    def walk(self, values: np.ndarray, k: int, actions: list) -> dict:
        """What :meth:`Tape.walk <pipeflow.sim.memory_tape.Tape.walk>` says of the walk at k >= 1
        periods past the small one (``peak_bytes``, ``at_peak``, ``peak_action``,
        ``category_peaks``); ``values``: the bytes of :attr:`terms`; ``actions``: the device's
        walked actions at that size, in order."""
        v = np.append(np.asarray(values, dtype=float), 0.0)  # (term -1: nothing on top)
        start = np.zeros(NCAT)
        best, best_split, best_action = -1.0, None, None
        own = np.full(NCAT, -np.inf)
        added = 0  # the actions one copy of each repeated block before this point adds
        per = iter(self.actions_per_copy)
        for (steps, repeated), passed in zip(self._blocks, self._passed):
            block = _Block(steps, v, passed, repeated)
            copies, n = (k, next(per)) if repeated else (1, 0)
            # the actions passed before an instant: a small walk's block counts none of the
            # copies, a repeated block (from the big walk) two of each before it
            shift = (k - 2 if repeated else k) * added
            if len(block.total):
                # its highest instant: in the first copy, or in the last where the block grows
                j = copies - 1 if repeated and block.net.sum() > 0 else 0
                p = int(np.argmax(block.total))
                total = float(block.total[p] + start.sum() + j * block.net.sum())
                if total > best:
                    best = total
                    best_split = (start + j * block.net + block.held[:, p]).tolist()
                    running = int(block.passed[p]) + shift + j * n
                    best_action = str(actions[running]) if running >= 0 else None
                top = block.held.max(axis=1)
                own = np.maximum(own, start + np.where(block.net > 0, copies - 1, 0) * block.net + top)
            start = start + copies * block.net
            added += n
        if best_split is None:  # (no instant: nothing to compare)
            best, best_split = -1.0, start.tolist()
        own = np.where(np.isfinite(own), np.maximum(own, 0.0), 0.0)
        return {"peak_bytes": best, "at_peak": dict(zip(CATEGORIES, best_split)), "peak_action": best_action,
                "category_peaks": dict(zip(CATEGORIES, own.tolist()))}


def walked_actions(schedule, d: int) -> list:
    """Device ``d``'s actions that a memory walk visits, in order."""
    return [a for a in schedule.orders[d] if a.kind in WALKED]
