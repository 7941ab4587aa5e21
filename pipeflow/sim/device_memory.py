"""Each device's memory over a simulated step by category
(:data:`pipeflow.formats.memory_categories.MEANINGS`, as the runtime's profile measures it) and its peak:
the most bytes live at one instant, not the sum of each category's own peak. The walk's tape
(:mod:`pipeflow.sim.device_walk`) priced by the cost model's terms (:mod:`pipeflow.sim.memory_terms`) and
walked here."""

from __future__ import annotations

import numpy as np

from ..formats.memory_categories import APART, CATEGORIES
from .device_walk import tapes
from .memory_peaks import NotPeriodic, Peaks
from .memory_terms import term_value
from .periodic_memory import PeriodicTape, walked_actions

# category -> (the measured categories, the simulated ones) it sets side by side, for the
# benchmark and the tests: one by one, a category with what the runtime measures apart
# within it (APART: a Seq1F1B segment's keys and values, within the activations)
COMPARED = {c: ((c, *(t for t, within in APART.items() if within == c)), (c,)) for c in CATEGORIES}


def library_workspace(topology, num_devices: int) -> list[float]:
    """Each device's bytes its math libraries keep for the whole run."""
    return [topology.workspace_bytes(d) for d in range(num_devices)]


def device_peaks(schedule, cost, per_device: list, topology, walks: Peaks | None = None) -> list[float]:
    """Each device's peak bytes as pipeflow-simulate counts them (:func:`device_memory` plus its libraries'
    workspace): what "does it fit" compares. ``walks`` (:class:`~pipeflow.sim.memory_peaks.Peaks`): one
    schedule's walks as arrays, priced under many costs."""
    workspace = library_workspace(topology, schedule.num_devices)
    if walks is None:
        return [m["peak_bytes"] for m in device_memory(schedule, cost, per_device, workspace)]
    cache: dict = {}
    values = np.array([term_value(k, cost, per_device, cache) for k in walks.terms], dtype=float)
    return (walks.peaks(values) + np.asarray(workspace, dtype=float)).tolist()


def device_memory(schedule, cost, per_device: list, workspace=None, actions: list | None = None,
                  periods: tuple | None = None) -> list[dict]:
    """Per device: ``peak_bytes``, ``at_peak`` (category -> bytes then), ``peak_action`` ("1I3") and
    ``category_peaks``. ``per_device``: the engine's :class:`~.results.DeviceStats`; ``workspace``: per
    device, bytes held as temporaries throughout; ``actions`` (per device, a name or None) adds
    ``at_action``; ``periods`` walks a long schedule from two short ones (:mod:`.periodic_memory`), the
    same bytes."""
    cache: dict = {}
    if periods is not None and not actions:
        out = _periodic(schedule, cost, per_device, periods, cache)
    else:
        out = [t.walk(t.values(cost, per_device, cache), actions[d] if actions and d < len(actions) else None)
               for d, t in enumerate(tapes(schedule))]
    for d, mem in enumerate(out):
        held = float(workspace[d]) if workspace is not None and d < len(workspace) else 0.0
        if held:
            mem["peak_bytes"] += held
            mem["at_peak"]["temporaries"] += held
            mem["category_peaks"]["temporaries"] += held
            if "at_action" in mem:  # (its most is one of its instants: the same dict)
                at = mem["at_action"]
                at["instants"] = [(b + held, {**split, "temporaries": split["temporaries"] + held})
                                  for b, split in at["instants"]]
                at["bytes"] += held
                at["at"] = {**at["at"], "temporaries": at["at"]["temporaries"] + held}
    return out


def _periodic(schedule, cost, per_device: list, periods: tuple, cache: dict) -> list[dict]:
    """Each device's walk from the two short walks; walked whole where they are not a period apart."""
    (small, big), k = periods
    out: list = []
    for d, (a, b) in enumerate(zip(tapes(small), tapes(big))):
        actions = walked_actions(schedule, d)
        try:
            walk = PeriodicTape(a, b)
        except NotPeriodic:
            walk = None
        if walk is None or walk.actions_at(k) != len(actions):
            tape = tapes(schedule, devices=[d])[0]
            out.append(tape.walk(tape.values(cost, per_device, cache)))
            continue
        values = np.array([term_value(t, cost, per_device, cache) for t in walk.terms], dtype=float)
        out.append(walk.walk(values, k, actions))
    return out
