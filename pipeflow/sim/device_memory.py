"""Each device's memory over a simulated step, by what holds it, and its peak.

The peak is the most bytes live at one instant: the sum over the categories at that
instant, not the sum of each category's own peak (under GPipe the last stage peaks at
the end of its forwards, before any gradient exists). The categories are the ones the
runtime's memory profile measures (``runtime.memory=profile``,
:mod:`pipeflow.runtime.memory_profile`), so the two compare term by term:

- ``parameters`` and ``optimizer_state``: every stage the device holds, for the whole run
  (AMDP's ZeRO: the optimizer state of the stages it owns; ``pipeline.shard``: a slice of
  the state, ZeRO-3's parameters a slice but from a GATHER to its FREE); ``weight_versions``:
  the extra weight copies an asynchronous policy keeps at its most;
- ``gradients``: a stage's, from its first backward (B or W) to its optimizer step (ZeRO-2/3:
  to its REDUCE, then a slice); ``casts``: at 16 bits, the 16-bit copy of the weights a
  stage's matrix products use, from its first forward to its step;
- ``activations``: what forwards keep for their backwards (a segment's keys and values
  included), as the engine walks them; ``residuals``: what a zero-bubble I keeps for its
  W, from I (what it has kept by its peak, at that instant) until W;
- ``outputs``: a stage's output, from its forward until its backward is done (at 16
  bits the copy it was sent as goes earlier), and a gradient it sent back: a send is
  held until a message from the peer, made by an action after the one that consumed the
  send, proves it arrived (the runtime's rule, :mod:`pipeflow.runtime.messages`);
- ``inputs``: a message's receive buffer, from the action before the one that needs it
  (the runtime posts receives one action ahead) until its forward starts or its
  backward is done;
- ``temporaries``: a forward's on top of what it keeps (``forward_workspace_bytes``: a
  concurrent-branch head's loss operands); a backward's gradients made and freed as it
  goes and the layer it rebuilds (``workspace_bytes``; a zero-bubble I's
  ``input_workspace_bytes`` also moves as I trades activations for what W keeps); an
  optimizer step's buffers (``step_workspace_bytes``); a replicated stage's gradients
  laid end to end for their REDUCE, to the step.

The walk that records which terms each action holds is :mod:`pipeflow.sim.device_walk`
(one device's :class:`~pipeflow.sim.device_walk.DeviceWalk`, one method per kind of
action); its tape (:class:`~pipeflow.sim.memory_tape.Tape`) is priced by the cost model's
terms (:mod:`pipeflow.sim.memory_terms`: every term priced or declared absent, none at
zero by default) and walked here.
"""

from __future__ import annotations

import numpy as np

from .device_walk import tapes
from .memory_peaks import NotPeriodic, Peaks
from .memory_terms import term_value
from .periodic_memory import PeriodicTape, walked_actions

# the measured categories (pipeflow.runtime.memory_profile) and the simulated ones they
# compare with: what the benchmark and the tests set side by side. One by one, but for
# a Seq1F1B segment's keys and values, which the profile names apart (the runtime holds
# them by hand) and the cost model counts within the activations of the segment
COMPARED = {c: ((c,), (c,)) for c in ("parameters", "weight_versions", "optimizer_state", "gradients", "casts")}
COMPARED["activations"] = (("activations", "kv"), ("activations",))
COMPARED.update({c: ((c,), (c,)) for c in ("residuals", "outputs", "inputs", "temporaries")})


def library_workspace(topology, num_devices: int) -> list[float]:
    """Each of the first ``num_devices`` devices' :meth:`Topology.workspace_bytes`: what
    its math libraries keep for the whole run (a temporary at every instant)."""
    return [topology.workspace_bytes(d) for d in range(num_devices)]


def device_peaks(schedule, cost, per_device: list, topology, walks: Peaks | None = None) -> list[float]:
    """Each device's peak bytes as pipeflow-simulate counts them: its categories walked
    (:func:`device_memory`), its math libraries' workspace on top. What "does it fit"
    compares with a device's memory, for the simulator, the planner and BAPP's
    coordinator alike. ``walks``: the schedule's walks as arrays
    (:class:`~pipeflow.sim.memory_peaks.Peaks`), for a caller that prices one schedule
    under many costs (the planner's partitions): the same peaks, without a walk each."""
    workspace = library_workspace(topology, schedule.num_devices)
    if walks is None:
        return [m["peak_bytes"] for m in device_memory(schedule, cost, per_device, workspace)]
    cache: dict = {}
    values = np.array([term_value(k, cost, per_device, cache) for k in walks.terms], dtype=float)
    return (walks.peaks(values) + np.asarray(workspace, dtype=float)).tolist()


def device_memory(schedule, cost, per_device: list, workspace=None, actions: list | None = None,
                  periods: tuple | None = None) -> list[dict]:
    """Per device: ``peak_bytes``, ``at_peak`` (category -> bytes at that instant),
    ``peak_action`` (the action running then, as the runtime names it: "1I3") and
    ``category_peaks`` (each category's own most). ``per_device`` is the engine's
    :class:`DeviceStats` list (the weight versions an asynchronous policy keeps);
    ``workspace``: per device, what its math libraries keep for the whole run
    (:attr:`~pipeflow.topology.topology.Device.workspace_bytes`), a temporary at every
    instant. ``actions`` (per device, an action's name or None) adds ``at_action``: that
    action's own most and what holds it then (the benchmark reads what the simulator
    says of the action where a rank measured its peak). ``periods``: (the schedule two
    short sizes, a period apart twice, as (small, big), and k) where ``schedule`` is k
    periods past the small one (:mod:`pipeflow.schedules.periods`): each device's walk
    then follows from the two short ones (:mod:`.periodic_memory`), the same bytes."""
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
    """Each device's walk from the two short walks; a device whose short walks are not a
    period apart as the rule says (or whose action count would differ) is walked whole."""
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
