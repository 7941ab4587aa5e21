"""Each device's memory over a simulated step, by what holds it, and its peak.

The peak is the most bytes live at one instant: the sum over the categories at that
instant, not the sum of each category's own peak (under GPipe the last stage peaks at
the end of its forwards, before any gradient exists). The categories are the ones the
runtime's memory profile measures (``runtime.memory=profile``,
:mod:`pipeflow.runtime.memory_profile`), so the two compare term by term:

- ``parameters`` and ``optimizer_state``: every stage the device holds, for the whole run
  (with ZeRO, the optimizer state of the stages it owns); ``weight_versions``: the extra
  weight copies an asynchronous policy keeps at its most;
- ``gradients``: a stage's, from its first backward (B or W) to its optimizer step;
- ``casts``: at 16 bits, the 16-bit copy of the weights a stage's matrix products use,
  from its first forward to its step;
- ``activations``: what forwards keep for their backwards (the I-to-W residuals and a
  segment's keys and values included), as the engine walks them;
- ``outputs``: a stage's output, from its forward until its backward is done, and a
  gradient it sent back, until its next backward (the runtime keeps a send until a
  later message from the peer proves it arrived);
- ``inputs``: a message's receive buffer, from the action before the one that needs it
  (the runtime posts receives one action ahead) until its forward starts or its
  backward is done;
- ``temporaries``: while a backward runs, the gradients it makes and frees as it goes
  and the layer it rebuilds (recomputation): ``workspace_bytes``; while an optimizer
  step runs, its buffers (``step_workspace_bytes``).

Terms come from the cost model (:meth:`~pipeflow.planning.cost.CostModel.state_bytes`,
``activation_bytes``, ``output_bytes``, ``workspace_bytes``...): a cost model without
them contributes zeros, never a guess.
"""

from __future__ import annotations

from ..schedules.ir import Kind
from ..schedules.zero import zero_owners

CATEGORIES = ("parameters", "optimizer_state", "weight_versions", "gradients", "casts", "activations", "outputs",
              "inputs", "temporaries")


# the measured categories (pipeflow.runtime.memory_profile) and the simulated ones they
# compare with, in groups: what the benchmark and the tests set side by side
COMPARED = {
    "weights": (("parameters", "weight_versions"), ("parameters", "weight_versions")),
    "optimizer": (("optimizer_state",), ("optimizer_state",)),
    "gradients": (("gradients",), ("gradients",)),
    "activations": (("activations", "residuals", "kv"), ("activations", "casts")),
    "messages": (("outputs", "inputs"), ("outputs", "inputs")),
    "temporaries": (("temporaries",), ("temporaries",)),
}


def device_memory(schedule, cost, per_device: list) -> list[dict]:
    """Per device: ``peak_bytes``, ``at_peak`` (category -> bytes at that instant) and
    ``category_peaks`` (each category's own most), walking the device's actions in its
    order (a device runs them one at a time, so the order is the time order; no
    timeline is needed). ``per_device`` is the engine's :class:`DeviceStats` list (the
    weight versions an asynchronous policy keeps)."""
    placement, graph = schedule.placement, schedule.graph
    nseg = max(1, schedule.num_segments)
    owners = zero_owners(placement) if getattr(schedule, "zero", False) else None
    events: dict[int, list] = {d: [a for a in order if a.kind in ("F", "B", "I", "W", "S")]
                               for d, order in enumerate(schedule.orders)}
    cache: dict = {}

    def term(name, *args) -> float:
        key = (name, *args)
        v = cache.get(key)
        if v is None:
            fn = getattr(cost, name, None)
            v = cache[key] = float(fn(*args)) if fn is not None else 0.0
        return v

    def state(stage: int) -> dict:
        key = ("state", stage)
        if key not in cache:
            cache[key] = cost.state_bytes(stage) if hasattr(cost, "state_bytes") else {
                "parameters": float(cost.param_bytes(stage)), "gradients": 0.0, "optimizer_state": 0.0, "casts": 0.0}
        return cache[key]

    def _kv_gradient(stage: int, seg: int) -> float:
        # the engine's rule (sim.engine._kv_gradient): a microbatch's first backward on a
        # stage (its last segment's) allocates the K/V gradients of every earlier
        # segment, each earlier segment's backward frees its own
        if nseg <= 1:
            return 0.0
        if seg == nseg - 1:
            return sum(term("kv_gradient_bytes", stage, j) for j in range(seg))
        return -term("kv_gradient_bytes", stage, seg)

    def _during_backward(stage: int, seg: int) -> float:
        # a cost model that prices the backward's working set as a whole (workspace_bytes
        # includes the rebuilt layer) or only the rebuilt layer (transient_bytes)
        ws = term("workspace_bytes", stage, seg)
        return ws if ws or not hasattr(cost, "transient_bytes") else term("transient_bytes", stage, seg)

    out = []
    for d in range(schedule.num_devices):
        reps = placement.stages_on(d)
        live = dict.fromkeys(CATEGORIES, 0.0)
        for pipe, s in reps:
            live["parameters"] += state(s)["parameters"]
            if owners is None or owners[s] == d:
                live["optimizer_state"] += state(s)["optimizer_state"]
        stats = per_device[d] if d < len(per_device) else None
        versions = getattr(stats, "peak_weight_versions", 1) or 1
        live["weight_versions"] = (versions - 1) * sum(state(s)["parameters"] for _, s in reps) / max(1, len(reps))
        own = dict(live)
        best = {"peak_bytes": sum(live.values()), "at_peak": dict(live)}

        def settle(extra: float = 0.0) -> None:
            total = sum(live.values()) + extra
            if total > best["peak_bytes"]:
                at = dict(live)
                at["temporaries"] += extra
                best["peak_bytes"], best["at_peak"] = total, at
            for c in CATEGORIES:
                own[c] = max(own[c], live[c] + (extra if c == "temporaries" else 0.0))

        grads_on: set = set()
        casts_on: set = set()
        held_out: dict = {}
        mine = events.get(d, [])
        # a message from another device lands in a buffer posted before the action ahead
        # of the one that needs it; a gradient's buffer lives until its backward is done,
        # an activation's becomes the stage's input (an activation) when its forward starts
        posted = [0.0] * (len(mine) + 1)
        landed = [0.0] * (len(mine) + 1)
        for i, e in enumerate(mine):
            if e.kind in (Kind.F, Kind.B, Kind.I):
                peers = graph.preds[e.stage] if e.kind == Kind.F else graph.succs[e.stage]
                for t in peers:
                    if placement.device(e.pipe, t) != d:
                        edge = (t, e.stage) if e.kind == Kind.F else (e.stage, t)
                        nbytes = term("message_bytes", *edge, e.segment)
                        posted[max(0, i - 1)] += nbytes
                        landed[i] += nbytes
        sent_grads = 0.0  # a gradient sent back, until the peer's next message proves it arrived
        for i, e in enumerate(mine):
            k, rep, seg = e.kind, (e.pipe, e.stage), e.segment
            st = state(e.stage)
            if posted[i]:
                live["inputs"] += posted[i]
                settle()
            if k == "S":
                settle(term("step_workspace_bytes", e.stage))  # the optimizer's buffers, with the gradients
                if rep in grads_on:
                    live["gradients"] -= st["gradients"]
                    grads_on.discard(rep)
                if rep in casts_on:
                    live["casts"] -= st["casts"]
                    casts_on.discard(rep)
                continue
            act = term("activation_bytes", e.stage, seg)
            if k == Kind.F:
                live["inputs"] -= landed[i]
                live["activations"] += act
                if rep not in casts_on:
                    casts_on.add(rep)
                    live["casts"] += st["casts"]
                settle()
                if any(placement.device(e.pipe, t) != d for t in graph.succs[e.stage]):
                    o = term("output_bytes", e.stage, seg)
                    held_out[(rep, e.microbatch, seg)] = o
                    live["outputs"] += o
                    settle()
                continue
            if k in (Kind.B, Kind.I):
                settle(_during_backward(e.stage, seg))
                live["outputs"] -= held_out.pop((rep, e.microbatch, seg), 0.0) + sent_grads  # kept through its backward
                live["inputs"] -= landed[i]
                sent_grads = sum(term("message_bytes", p, e.stage, seg) for p in graph.preds[e.stage]
                                 if placement.device(e.pipe, p) != d)
                live["outputs"] += sent_grads
                kvg = _kv_gradient(e.stage, seg)
                if k == Kind.B:
                    live["activations"] += kvg - act
                else:
                    live["activations"] += term("weight_residual_bytes", e.stage, seg) - act + kvg
            else:  # W
                live["activations"] -= term("weight_residual_bytes", e.stage, seg)
            if k in (Kind.B, Kind.W) and rep not in grads_on:
                grads_on.add(rep)
                live["gradients"] += st["gradients"]
            settle()
        out.append({"peak_bytes": best["peak_bytes"], "at_peak": best["at_peak"], "category_peaks": own})
    return out
