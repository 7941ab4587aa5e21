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
