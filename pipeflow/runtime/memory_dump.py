"""Debugging aids of ``runtime.memory=profile``: ``PIPEFLOW_MEMORY_DUMP=<prefix>`` (CPU) and
``PIPEFLOW_CUDA_MEMORY_DUMP`` write what was live at a rank's step peak and what made it;
``PIPEFLOW_MEMORY_DUMP_ACTION=<action>[@<j>]`` dumps at that action's most instead."""

from __future__ import annotations

import os

from ..formats.files import write_aside


def operators(ev, depth: int = 12) -> list[str]:
    """The names of the operators (and ranges) an event ran in, innermost first."""
    names = []
    p = ev.parent
    while p is not None and len(names) < depth:
        shapes = [list(getattr(m, "sizes", ()) or ()) for m in getattr(p.typed[1], "inputs", ()) or ()
                  if getattr(m, "sizes", None) is not None] if not names else []
        names.append(p.name + (str(shapes) if shapes else ""))
        p = p.parent
    return names


def dump_cpu_peak(path: str, events: list, made_by: dict, step, actions: list, rules: tuple) -> None:
    """Every allocation live at a CPU step's (a ``StepMemory``'s) peak: its size, the last tag at
    its address, the operators that made it, largest first; ``rules``: the profile's naming
    (its categories' priority, those held from their tag on, those from their send on)."""
    priority, from_tag, from_send = rules
    import json

    # PIPEFLOW_MEMORY_DUMP_ACTION=<action> ("2B1"): what is live at that action's own most instead
    when = step.action_peaks.get("probe", step.action_peaks.get(
        os.environ.get("PIPEFLOW_MEMORY_DUMP_ACTION", "").partition("@")[0], (0, 0, step.peak_time)))[2]
    live: dict = {}
    named: dict = {}  # ptr -> its category at the peak, as the replay names it (a later tag names a whole life)
    freed: dict = {}  # ptr -> the action running when what was live at the peak is freed
    for e in events:  # in time order (the replay sorted them)
        t, _, kind, ptr, x, _ = e
        after = when is not None and t > when
        if kind == "tag":
            if ptr in freed:
                continue
            was = named.get(ptr)
            if (was is not None and x in from_tag or x in from_send) and was != x:
                if not after:  # held for this from the tag on
                    named[ptr] = x
            elif was is None or priority[x] < priority[was]:
                named[ptr] = x
        elif after:
            if x < 0 and ptr in live and ptr not in freed:
                freed[ptr] = next((name for start, end, name in actions if start <= t <= end), "between actions")
        elif x > 0:
            live[ptr] = (x, made_by.get(id(e), []))
            named.pop(ptr, None)
        else:
            live.pop(ptr, None)
    rows = [{"bytes": size, "tag": named.get(ptr), "operators": ops, "freed_in": freed.get(ptr)}
            for ptr, (size, ops) in live.items()]
    rows.sort(key=lambda r: -r["bytes"])
    # and, with PIPEFLOW_MEMORY_DUMP_ACTION, that action's allocations and frees in order:
    # (bytes, +size or -size, the operators that made what is allocated or freed)
    span = next(((s, e) for s, e, name in actions
                 if name == os.environ.get("PIPEFLOW_MEMORY_DUMP_ACTION", "").partition("@")[0]), None)
    timeline, total, made = [], 0, {}
    for e in events:
        t, _, kind, ptr, x, _ = e
        if kind == "tag":
            continue
        total += x
        if x > 0:
            made[ptr] = made_by.get(id(e), [])[:3]
        if span is not None and span[0] <= t <= span[1]:
            timeline.append((total, x, made.get(ptr, [])))
    write_aside(path, json.dumps({"peak_bytes": step.peak_bytes, "at_peak": step.at_peak,
                                  "peak_action": step.peak_action, "action_peaks": step.action_peaks,
                                  "live": rows, "timeline": timeline}, indent=1))


def dump_cuda_peak(path: str, trace: list, tags: list, step, block) -> None:
    """Every allocation of a CUDA step (a ``StepMemory``) live at its peak: its block's
    bytes (``block`` of the size asked for), the last tag at its address, the Python and
    C++ frames that made it, largest first (``PIPEFLOW_CUDA_MEMORY_DUMP``)."""
    import json

    steps = [e for e in trace if e.get("action") in ("alloc", "free_requested")]
    live = {}
    for k, e in enumerate(steps):
        if step.peak_time is not None and k > step.peak_time:
            break
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    named = {ptr: category for _, _, ptr, category, _ in tags}
    rows = [{"bytes": block(int(e["size"])), "tag": named.get(addr),
             "frames": [f"{f.get('filename', '').rsplit('/', 2)[-1]}:{f.get('line')}:{f.get('name')}"
                        for f in e.get("frames", [])[:48]]}
            for addr, e in live.items()]
    rows.sort(key=lambda r: -r["bytes"])
    write_aside(path, json.dumps({"peak_bytes": step.peak_bytes, "at_peak": step.at_peak,
                                  "peak_action": step.peak_action, "action_peaks": step.action_peaks,
                                  "live": rows}, indent=1))
