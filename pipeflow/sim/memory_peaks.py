"""Every device's memory peak for many cost models at once (the planner's and the
search's pricing): the tapes of :mod:`pipeflow.sim.device_memory` as arrays."""

from __future__ import annotations

import numpy as np


class NotPeriodic(ValueError):
    """Two walks of a schedule do not differ by one repeated block of steps."""


def encoded(tape, index: dict) -> np.ndarray:
    """A tape's steps as an array of rows (category, term, count), its term indices replaced by
    each term's number in ``index`` (which it grows), so that two walks compare step by step."""
    ids = np.array([index.setdefault(k, len(index)) for k in tape.terms] + [-1], dtype=float)
    steps = tape.rows().copy()
    steps[:, 1] = ids[steps[:, 1].astype(np.int64)]  # (-1, no term, stays -1)
    return steps


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading rows ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero((a[:n] != b[:n]).any(axis=1))
    return int(differ[0]) if len(differ) else n


def split_periods(small: np.ndarray, big: np.ndarray) -> list[tuple[np.ndarray, bool]]:
    """``small`` as blocks (steps, repeated), where ``big``, the walk two periods later, is
    ``small`` with each repeated block inserted twice where it stands (docs/planning.md,
    "Periodic walks"); NotPeriodic when it is not."""
    n, extra = len(small), len(big) - len(small)
    if extra <= 0 or extra % 2:
        raise NotPeriodic(f"the larger walk has {len(big)} steps, the smaller {n}")

    tries = [4096]  # (a walk the blocks do not fit is given up on, not searched through)

    def rest(i: int, j: int) -> list[tuple[int, int, int]] | None:  # the insertions (i, j, half) from (i, j)
        tries[0] -= 1
        if tries[0] < 0:
            return None
        run = _common(small[i:], big[j:])
        i, j = i + run, j + run
        if i == n and j == len(big):
            return []
        left = extra - (j - i)  # of the inserted steps
        # the halves' lengths worth a look: the second half starts as the first does, and
        # the walks agree again on the step after the block
        halves = np.arange(1, left // 2 + 1)
        near = big[j:j + left + 1]
        maybe = (near[halves] == big[j]).all(axis=1)
        maybe &= (near[2 * halves] == small[i]).all(axis=1) if i < n else 2 * halves == left
        for half in halves[maybe].tolist():
            if np.array_equal(big[j:j + half], big[j + half:j + 2 * half]):
                after = rest(i, j + 2 * half)
                if after is not None:
                    return [(i, j, half), *after]
        return None

    found = rest(0, 0)
    if found is None:
        raise NotPeriodic("the walks part and no doubled blocks bring them together")
    blocks: list[tuple[np.ndarray, bool]] = []
    start = 0
    for i, j, half in found:
        blocks += [(small[start:i], False), (big[j:j + half], True)]
        start = i
    blocks.append((small[start:], False))
    return blocks


class Periodic:
    """Every device's peak at k more periods of a schedule than a walked size, without walking
    them: each repeated block (:func:`split_periods`) stands k times, and its copies peak at
    the first or the last, so the peak is exact for any k. ``small`` and ``big`` (two periods
    later) are each device's steps :func:`encoded` over ``terms``."""

    def __init__(self, small: list, big: list, terms: list) -> None:
        self._build([split_periods(a, b) for a, b in zip(small, big)], terms)

    def _build(self, blocks: list[list[tuple[np.ndarray, bool]]], terms: list) -> None:
        """The arrays :meth:`peaks` reads, from each device's blocks (steps, repeated)."""
        rows, device, repeated = [], [], []
        for d, own in enumerate(blocks):
            for block, again in own:
                rows.append(block)
                device.append(d)
                repeated.append(again)
        self.terms = list(terms)
        self.devices = len(blocks)
        self._device = np.array(device, dtype=np.int64)
        self._repeated = np.array(repeated, dtype=bool)
        self._first = np.concatenate(([0], np.flatnonzero(np.diff(self._device)) + 1)) if rows else np.zeros(0, int)
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        steps = np.concatenate(rows) if len(rows) else np.zeros((0, 3))
        row = np.repeat(np.arange(len(rows)), lengths)
        adds = steps[:, 0] >= 0
        term = steps[:, 1].astype(np.int64)
        # the levels as Peaks keeps them: a cumulative sum over every add; an instant's
        # level is its block's part of that sum, plus the term held for the instant only
        self.idx, self.coef = term[adds], steps[adds, 2]
        counted = np.cumsum(adds)
        first_add = np.concatenate(([0], np.cumsum(np.bincount(row[adds], minlength=len(rows)))))[:-1]
        at = ~adds
        self.pos, self.base, self.extra = counted[at], first_add[row[at]], term[at]
        per_row = np.bincount(row[at], minlength=len(rows))
        self._empty = per_row == 0
        self.starts = np.concatenate(([0], np.cumsum(per_row)))[:-1]
        # each block's net change, per term (the level at a block's start is a sum of
        # them), as (block, term, count) with each pair once; none where every device's
        # walk is one block (each starts at nothing)
        self._single = len(rows) == self.devices and not self._repeated.any()
        if self._single:
            self._net = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
        else:
            pair = row[adds] * (len(self.terms) + 1) + self.idx
            pairs, inverse = np.unique(pair, return_inverse=True)
            self._net = (pairs // (len(self.terms) + 1), pairs % (len(self.terms) + 1),
                         np.bincount(inverse, self.coef, minlength=len(pairs)))

    def peaks(self, values, k: int = 0) -> np.ndarray:
        """Each device's peak bytes at k periods past the smaller walk (k >= 0), with
        ``values[i]`` the bytes of ``terms[i]``."""
        v = np.append(np.asarray(values, dtype=float), 0.0)  # index -1: no extra term
        level = np.empty(len(self.idx) + 1)
        level[0] = 0.0
        np.multiply(self.coef, v[self.idx], out=level[1:])
        np.cumsum(level[1:], out=level[1:])
        at = level[self.pos] - level[self.base] + v[self.extra]
        top = np.full(len(self._device), -np.inf)  # each block's highest instant, from its start
        full = ~self._empty
        top[full] = np.maximum.reduceat(at, self.starts[full])
        if self._single:  # (each device's one block: its highest instant)
            return np.maximum.reduceat(top, self._first) if len(top) else top
        block, term, count = self._net
        net = np.bincount(block, count * v[term], minlength=len(self._device))
        added = np.where(self._repeated, k * net, net)  # what each block adds at k periods
        ends = np.cumsum(added)
        start = ends - added - np.repeat((ends - added)[self._first], np.diff(np.append(self._first, len(added))))
        high = start + top + np.where(self._repeated, max(k - 1, 0) * np.maximum(net, 0.0), 0.0)
        if k == 0:
            high[self._repeated] = -np.inf
        return np.maximum.reduceat(high, self._first)


class Peaks(Periodic):
    """Every device's peak for many cost models at once: a walk without a period (each device's
    tape one block) as arrays over ``terms``, so a cost's peaks are a few array operations
    (:meth:`peaks`, k = 0)."""

    def __init__(self, tapes: list) -> None:  # pipeflow.sim.device_walk.tapes(schedule)
        index: dict = {}
        self._build([[(encoded(t, index), False)] for t in tapes], list(index))
