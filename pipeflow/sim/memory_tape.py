"""One device's memory over a simulated step as a tape of terms (:class:`Tape`): what
:func:`pipeflow.sim.device_memory.tapes` records and walks, and the categories it holds."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..schedules.ir import Kind
from .memory_terms import term_value

CATEGORIES = ("parameters", "optimizer_state", "weight_versions", "gradients", "casts", "activations", "residuals",
              "outputs", "inputs", "temporaries")
_CAT = {c: i for i, c in enumerate(CATEGORIES)}
_TEMP = _CAT["temporaries"]



@dataclass
class Tape:
    """One device's memory over a step, without its bytes: the terms it holds (keys such
    as ``("activation_bytes", stage, segment)``, valued by :func:`term_value`) and the
    walk as a list of steps, each ``(category, term, count)`` (that many of the term
    join the category, or leave it when negative) or ``(-1, extra, 0)``, an instant
    that may be the peak, with ``extra`` a term held on top of the level for that
    instant only (a backward's workspace, an optimizer step's buffers; -1: none)."""

    terms: list[tuple]
    steps: list[tuple[int, int, int]]
    # (the step each action's walk starts at, the action: str() names it as the runtime does, "1I3")
    starts: list[tuple] = field(default_factory=list)

    def values(self, cost, per_device=None, cache: dict | None = None) -> np.ndarray:
        cache = {} if cache is None else cache
        return np.array([term_value(k, cost, per_device, cache) for k in self.terms], dtype=float)

    def walk(self, values: np.ndarray, action: str | None = None, every: bool = False) -> dict:
        """The bytes: ``peak_bytes``, ``at_peak``, ``peak_action`` and ``category_peaks``
        (see :func:`device_memory`); with ``action`` (a name such as "1I3") also
        ``at_action``: that action's own most and what holds it then, and ``instants``,
        each instant of it (bytes, category -> bytes then; a host's kernels can tip a
        rank's peak between two of them a few hundred bytes apart); with ``every``,
        ``action_peaks``: each action's own most, name -> (bytes, category -> bytes then)."""
        values = [float(v) for v in values]
        live = [0.0] * len(CATEGORIES)
        own = [0.0] * len(CATEGORIES)
        best, at, best_action = -1.0, live, None
        most: dict = {}  # action -> (its most, what holds it then), for the actions asked for
        instants: list = []  # the asked action's, (bytes, category -> bytes)
        track = every or action is not None  # (else the action names matter only at a new peak)
        starts = self.starts
        nstarts, si, current = len(starts), 0, None
        upcoming = starts[0][0] if nstarts else None
        # each category's own most is taken at instants, as the level then; a category
        # unchanged since the last instant cannot have a new most (but temporaries, with
        # the instant's extra), so only those changed since are compared
        changed: set = set()
        temp = _TEMP
        for i, (cat, term, n) in enumerate(self.steps):
            while upcoming is not None and upcoming <= i:
                current = starts[si][1]
                si += 1
                upcoming = starts[si][0] if si < nstarts else None
            if cat >= 0:
                live[cat] += n * values[term]
                changed.add(cat)
                continue
            extra = values[term] if term >= 0 else 0.0
            total = sum(live) + extra
            if total > best:
                best, at, best_action = total, list(live), current
                at[temp] += extra
            if track and current is not None:
                name = str(current)
                if every or name == action:
                    mine, higher = name == action, total > most.get(name, (-1.0,))[0]
                    if mine or higher:
                        held = list(live)
                        held[temp] += extra
                        split = dict(zip(CATEGORIES, held))
                        if mine:
                            instants.append((total, split))
                        if higher:
                            most[name] = (total, split)
            changed.discard(temp)
            for c in changed:
                if live[c] > own[c]:
                    own[c] = live[c]
            changed.clear()
            t = live[temp] + extra
            if t > own[temp]:
                own[temp] = t
        best_action = str(best_action) if best_action is not None else None
        out = {"peak_bytes": best, "at_peak": dict(zip(CATEGORIES, at)), "peak_action": best_action,
               "category_peaks": dict(zip(CATEGORIES, own))}
        if action in most:
            out["at_action"] = {"action": action, "bytes": most[action][0], "at": most[action][1],
                                "instants": instants}
        if every:
            out["action_peaks"] = most
        return out

    def action_peaks(self, values: np.ndarray) -> dict:
        """Each action's own most: name -> (bytes, category -> bytes then) (a debugging
        aid, beside the runtime's ``StepMemory.action_peaks``)."""
        return self.walk(values, every=True)["action_peaks"]


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


def library_workspace(topology, num_devices: int) -> list[float]:
    """Each of the first ``num_devices`` devices' :meth:`Topology.workspace_bytes`."""
    return [topology.workspace_bytes(d) for d in range(num_devices)]
