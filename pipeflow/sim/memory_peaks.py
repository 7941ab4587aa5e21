"""Every device's memory peak for many cost models at once (the planner's and the
search's pricing): the tapes of :mod:`pipeflow.sim.memory` as arrays."""

from __future__ import annotations

import numpy as np

class Peaks:
    """Every device's peak for many cost models at once: the tapes' walks as arrays
    over one list of terms (``terms``), so that a cost's peaks are a few array
    operations (:meth:`peaks`) rather than a walk."""

    def __init__(self, tapes: list) -> None:  # pipeflow.sim.memory.tapes(schedule)
        index: dict[tuple, int] = {}
        idx, coef, pos, base, extra, starts = [], [], [], [], [], []
        n = 0  # adds so far, over every device
        for t in tapes:
            remap = np.array([index.setdefault(k, len(index)) for k in t.terms] + [-1], dtype=np.int64)
            steps = np.array(t.steps, dtype=float).reshape(-1, 3)
            adds = steps[:, 0] >= 0
            term = steps[:, 1].astype(np.int64)  # -1 (no extra term) maps to -1
            starts.append(sum(len(x) for x in pos))
            idx.append(remap[term[adds]])
            coef.append(steps[adds, 2])
            pos.append(n + np.cumsum(adds)[~adds])
            base.append(np.full(int((~adds).sum()), n, dtype=np.int64))
            extra.append(remap[term[~adds]])
            n += int(adds.sum())
        self.terms = list(index)
        self.idx, self.coef = np.concatenate(idx), np.concatenate(coef)
        self.pos, self.base, self.extra = np.concatenate(pos), np.concatenate(base), np.concatenate(extra)
        self.starts = np.array(starts, dtype=np.int64)

    def peaks(self, values: np.ndarray) -> np.ndarray:
        """Each device's peak bytes, with ``values[i]`` the bytes of ``terms[i]``."""
        v = np.append(np.asarray(values, dtype=float), 0.0)  # index -1: no extra term
        level = np.concatenate(([0.0], np.cumsum(self.coef * v[self.idx])))
        return np.maximum.reduceat(level[self.pos] - level[self.base] + v[self.extra], self.starts)


class NotPeriodic(ValueError):
    """Two walks of a schedule do not differ by one repeated block of steps."""


def encoded(tape, index: dict) -> np.ndarray:
    """A tape's steps as an array of rows (category, term, count), its own term indices
    replaced by each term's number in ``index`` (shared by the walks to compare, which
    it grows), so that the tapes of one schedule at two sizes compare step by step."""
    ids = np.array([index.setdefault(k, len(index)) for k in tape.terms] + [-1], dtype=float)
    steps = np.array(tape.steps, dtype=float).reshape(-1, 3)
    steps[:, 1] = ids[steps[:, 1].astype(np.int64)]  # (-1, no term, stays -1)
    return steps


def split_period(small: np.ndarray, big: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P, X, S) with ``small == P + S`` and ``big == P + X + S`` (encoded steps): the
    block that one more period of the schedule inserts, found as the longest common
    prefix. Raises NotPeriodic when the two differ otherwise."""
    n, extra = len(small), len(big) - len(small)
    if extra <= 0:
        raise NotPeriodic(f"the larger walk has {len(big)} steps, the smaller {n}")
    differ = np.flatnonzero((small != big[:n]).any(axis=1))
    i = int(differ[0]) if len(differ) else n
    if not np.array_equal(small[i:], big[i + extra:]):
        raise NotPeriodic(f"the walks part at step {i} and do not meet again")
    return small[:i], big[i:i + extra], small[i:]


class Periodic:
    """Every device's peak at k more periods of a schedule than a walked size, without
    walking them: each device's walk at that size is P + S and one period later
    P + X + S (:func:`split_period`), so at k periods more it is P + X (k times) + S.
    Within the j-th copy of X the level is P's end plus j times X's net change, so the
    copies' highest instant is the first's or the last's: the peak is the most of P's
    instants, X's (raised by (k - 1) net changes where they grow) and S's (raised by k),
    exact for any k. The walks are :func:`encoded` over ``terms`` (the index's keys, in
    order); ``check`` (the walk two periods later) must be P + X + X + S, or NotPeriodic
    is raised: the period the caller assumed does not hold at this size."""

    def __init__(self, small: list, big: list, check: list | None, terms: list) -> None:
        rows = []  # per device: P, X, S
        for d, (a, b) in enumerate(zip(small, big)):
            P, X, S = split_period(a, b)
            if check is not None and not np.array_equal(check[d], np.concatenate((P, X, X, S))):
                raise NotPeriodic(f"device {d}: two periods more is not the block repeated")
            rows += [P, X, S]
        self.terms = list(terms)
        self.devices = len(small)
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        steps = np.concatenate(rows) if len(rows) else np.zeros((0, 3))
        row = np.repeat(np.arange(len(rows)), lengths)
        adds = steps[:, 0] >= 0
        term = steps[:, 1].astype(np.int64)
        # the levels as Peaks keeps them: a cumulative sum over every add; an instant's
        # level is its row's part of that sum, plus the term held for the instant only
        self.idx, self.coef = term[adds], steps[adds, 2]
        counted = np.cumsum(adds)
        first_add = np.concatenate(([0], np.cumsum(np.bincount(row[adds], minlength=len(rows)))))[:-1]
        at = ~adds
        self.pos, self.base, self.extra = counted[at], first_add[row[at]], term[at]
        per_row = np.bincount(row[at], minlength=len(rows))
        self._empty = per_row == 0
        self.starts = np.concatenate(([0], np.cumsum(per_row)))[:-1]
        # each row's net change, per term: the level at P's end and X's change are products
        self._net = np.zeros((len(rows), len(self.terms) + 1))
        np.add.at(self._net, (row[adds], self.idx), self.coef)

    def peaks(self, values, k: int) -> np.ndarray:
        """Each device's peak bytes at k periods past the smaller walk (k >= 0)."""
        v = np.append(np.asarray(values, dtype=float), 0.0)  # index -1: no extra term
        level = np.concatenate(([0.0], np.cumsum(self.coef * v[self.idx])))
        at = level[self.pos] - level[self.base] + v[self.extra]
        top = np.full(len(self.starts), -np.inf)
        full = ~self._empty
        top[full] = np.maximum.reduceat(at, self.starts[full])
        top = top.reshape(self.devices, 3)
        net = (self._net @ v).reshape(self.devices, 3)
        start_x, grow = net[:, 0], net[:, 1]
        in_x = start_x + top[:, 1] + max(k - 1, 0) * np.maximum(grow, 0.0) if k > 0 else np.full(self.devices, -np.inf)
        in_s = start_x + k * grow + top[:, 2]
        return np.maximum(np.maximum(top[:, 0], in_x), in_s)
