"""One device's memory over a simulated step as a tape of terms (:class:`Tape`), recorded by
:mod:`pipeflow.sim.device_walk` and walked by :mod:`pipeflow.sim.device_memory`."""

from __future__ import annotations

from dataclasses import dataclass, field
from array import array

import numpy as np

from ..formats.memory_categories import CATEGORIES
from .memory_terms import term_value

_CAT = {c: i for i, c in enumerate(CATEGORIES)}
_TEMP = _CAT["temporaries"]


@dataclass
class Tape:
    """One device's memory over a step without its bytes: the ``terms`` it holds (keys valued by
    :func:`term_value`) and ``steps``, flat triples ``(category, term, count)`` (count of the term joins
    the category, or leaves it when negative) or ``(-1, extra, 0)``: an instant that may be the peak,
    ``extra`` held on top for it alone (-1: none)."""

    terms: list[tuple]
    steps: array  # of doubles: category, term, count, category, ...
    # (the step each action's walk starts at, the action: str() names it as the runtime does, "1I3")
    starts: list[tuple] = field(default_factory=list)

    def values(self, cost, per_device=None, cache: dict | None = None) -> np.ndarray:
        cache = {} if cache is None else cache
        return np.array([term_value(k, cost, per_device, cache) for k in self.terms], dtype=float)

    def rows(self) -> np.ndarray:
        """The steps as an array of rows (category, term, count), read in place."""
        return np.frombuffer(self.steps, dtype=float).reshape(-1, 3)

    def named(self) -> list[tuple]:
        """The steps as (category's number, the term's key or None, count)."""
        return [(int(c), self.terms[int(k)] if k >= 0 else None, n) for c, k, n in self.rows().tolist()]

    def walk(self, values: np.ndarray, action: str | None = None, every: bool = False) -> dict:
        """The bytes: ``peak_bytes``, ``at_peak``, ``peak_action`` and ``category_peaks`` (see
        :func:`~.device_memory.device_memory`); with ``action`` (a name such as "1I3") also
        ``at_action``, its own most and each of its instants; with ``every``, ``action_peaks`` (name ->
        (bytes, category -> bytes then))."""
        rows = self.rows()
        v = np.append(np.asarray(values, dtype=float), 0.0)  # (term -1: nothing on top)
        cat, term = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
        adds = np.flatnonzero(cat >= 0)
        at = np.flatnonzero(cat < 0)  # the instants
        level = np.zeros((len(CATEGORIES), len(rows)))
        level[cat[adds], adds] = rows[adds, 2] * v[term[adds]]
        np.cumsum(level, axis=1, out=level)
        held = level[:, at]  # (category, instant): each category's level at each instant
        extra = v[term[at]]
        total = held[0].copy()
        for c in range(1, len(CATEGORIES)):
            total += held[c]
        total += extra
        held[_TEMP] += extra  # (what holds each instant: its extra is temporary)
        own = np.maximum(held.max(axis=1), 0.0) if len(at) else np.zeros(len(CATEGORIES))
        starts = np.array([s for s, _ in self.starts], dtype=np.int64)
        running = np.searchsorted(starts, at, side="right") - 1  # the action running at each instant (-1: none)
        if len(at) and total.max() > -1.0:
            p = int(np.argmax(total))
            best, split = float(total[p]), held[:, p].tolist()
            best_action = str(self.starts[running[p]][1]) if running[p] >= 0 else None
        else:  # (no instant: nothing to compare)
            best, split, best_action = -1.0, level[:, -1].tolist() if len(rows) else [0.0] * len(CATEGORIES), None
        out = {"peak_bytes": best, "at_peak": dict(zip(CATEGORIES, split)), "peak_action": best_action,
               "category_peaks": dict(zip(CATEGORIES, own.tolist()))}
        if action is not None or every:
            most: dict = {}  # name -> (its most, what holds it then), for the actions asked for
            instants: list = []  # the asked action's, (bytes, category -> bytes)
            names = [str(a) for _, a in self.starts]
            for j in np.flatnonzero(running >= 0).tolist():
                name = names[running[j]]
                if not every and name != action:
                    continue
                t = float(total[j])
                if name == action or t > most.get(name, (-1.0,))[0]:
                    then = dict(zip(CATEGORIES, held[:, j].tolist()))
                    if name == action:
                        instants.append((t, then))
                    if t > most.get(name, (-1.0,))[0]:
                        most[name] = (t, then)
            if action in most:
                out["at_action"] = {"action": action, "bytes": most[action][0], "at": most[action][1],
                                    "instants": instants}
            if every:
                out["action_peaks"] = most
        return out

    def action_peaks(self, values: np.ndarray) -> dict:
        """Each action's own most: name -> (bytes, category -> bytes then)."""
        return self.walk(values, every=True)["action_peaks"]
