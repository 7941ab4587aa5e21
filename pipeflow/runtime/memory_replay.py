"""A step's live bytes by category from its allocations, frees and tags in order: the replay both of
:mod:`pipeflow.runtime.memory_profile`'s profiles walk (CPU and CUDA). Torch-free: events are tuples."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# what a step's bytes are counted in: the simulator's categories and the one tag measured
# apart within them (a Seq1F1B segment's keys and values: memory_categories.APART)
from ..formats.memory_categories import MEASURED as CATEGORIES

# a storage tagged twice counts where it is held most specifically (a residual W keeps
# may have been saved by autograd first)
_PRIORITY = {c: n for n, c in enumerate(("parameters", "weight_versions", "optimizer_state", "gradients", "casts",
                                         "residuals", "kv", "outputs", "activations", "inputs"))}
# held for this from the tag on, where the allocation was named before (an operand a
# zero-bubble I takes for W was an activation until then); any other tag names the
# allocation's whole life (a gradient I makes for W is a residual from the start)
_FROM_TAG = {"residuals"}
# held for this from the tag on, whatever the allocation was until then: what a stage
# sends is an output from the moment it is sent (the gradient a last stage sends back is
# the stream's, which its backward made at the head's and carried through
# every block as a temporary)
_FROM_SEND = {"outputs"}


@dataclass
class StepMemory:
    """One step's allocations on one device."""

    peak_bytes: int = 0  # the most bytes live at one instant
    at_peak: dict = field(default_factory=dict)  # category -> bytes live at that instant
    category_peaks: dict = field(default_factory=dict)  # category -> its own most bytes live
    allocator_peak_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated over the step
    peak_action: str | None = None  # the schedule's action running at the peak ("1B3": stage 1, B, microbatch 3)
    peak_time: float | None = None  # when the peak was (the event's time), not reported
    # with PIPEFLOW_MEMORY_DUMP: each action's own most, (bytes, category -> bytes then, when)
    action_peaks: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "at_peak": self.at_peak, "category_peaks": self.category_peaks,
                **({"peak_action": self.peak_action} if self.peak_action else {}),
                **({"allocator_peak_bytes": self.allocator_peak_bytes} if self.allocator_peak_bytes is not None
                   else {})}


def _lives(events: list) -> tuple[list, list]:
    """Pass 1 of :func:`replay` over time-sorted ``events``: (lives, each [size, category or None, live at
    the step's start]; order, each life's (time, +1 or -1, index) and each category switch (time, 0,
    (index, category)))."""
    lives = []  # [size, category, preexisting]
    live_at: dict = {}  # ptr -> index into lives
    order = []  # (time, +1/-1, life index) in time order
    for t, _, kind, ptr, x, nbytes in events:
        if kind == "tag":
            i = live_at.get(ptr)
            if i is None:  # found live: counts from the start until its free, if any
                i = live_at[ptr] = len(lives)
                lives.append([nbytes, x, True])
            elif (x in _FROM_TAG and lives[i][1] is not None or x in _FROM_SEND) and lives[i][1] != x:
                # held for this from now: what it was named until then
                order.append((t, 0, (i, x)))
            elif lives[i][1] is None or _PRIORITY[x] < _PRIORITY[lives[i][1]]:
                lives[i][1] = x
        elif x > 0:
            was = live_at.get(ptr)
            if was is not None:  # its address handed out again: freed unseen, on a thread the
                order.append((t, -1, was))  # profiler does not record (gloo's, after a collective)
            live_at[ptr] = len(lives)
            order.append((t, 1, len(lives)))
            lives.append([x, None, False])
        else:
            i = live_at.pop(ptr, None)
            if i is None:  # freed, never allocated in the step: it was live at the start
                i = len(lives)
                lives.append([-x, None, True])
            order.append((t, -1, i))
    return lives, order


def replay(events: list, actions: list, live_at_start: int | None = None, per_action: bool = False) -> StepMemory:
    """A :class:`StepMemory` of a step's ``(time, order, kind, ptr, size or category, nbytes)`` events
    walked in time order (an allocation at a live address ends the earlier one). ``live_at_start``: the
    allocator's live bytes at the start, the unnamed rest counted as temporaries. ``per_action``: each
    action's own most too."""
    events.sort(key=lambda e: (e[0], e[1]))
    lives, order = _lives(events)
    live = dict.fromkeys(CATEGORIES, 0)
    for size, category, pre in lives:
        if pre:
            live[category or "temporaries"] += size
    if live_at_start is not None:
        live["temporaries"] += max(0, live_at_start - sum(live.values()))
    out = StepMemory(peak_bytes=sum(live.values()), at_peak=dict(live), category_peaks=dict(live))
    total = out.peak_bytes
    n, k, peak_at = len(order), 0, None
    spans = sorted(actions) if per_action else []
    # PIPEFLOW_MEMORY_DUMP_ACTION=<action>@<j> (with per_action): the split after the j-th
    # allocation or free of that action (the dump's timeline numbers them from 0)
    probe_name, _, probe_j = (os.environ.get("PIPEFLOW_MEMORY_DUMP_ACTION", "") if per_action else "").partition("@")
    probe_span = next(((s, e) for s, e, name in actions if name == probe_name), None) if probe_j else None
    seen = 0
    while k < n:
        t = order[k][0]
        while k < n and order[k][0] == t:  # an instant is whole once every event at its time is in
            _, sign, i = order[k]
            k += 1
            if sign == 0:  # a switch: (life, its category from now)
                i, category = i
                size, was, _ = lives[i]
                live[was or "temporaries"] -= size
                live[category] += size
                lives[i][1] = category
                continue
            size, category, _ = lives[i]
            live[category or "temporaries"] += sign * size
            total += sign * size
            if probe_span is not None and probe_span[0] <= t <= probe_span[1]:
                if seen == int(probe_j):
                    out.action_peaks["probe"] = (total, dict(live), t)
                seen += 1
        if total > out.peak_bytes:
            out.peak_bytes, out.at_peak, peak_at = total, dict(live), t
        if per_action:
            while spans and spans[0][1] < t:
                spans.pop(0)
            if spans and spans[0][0] <= t:
                name = spans[0][2]
                if total > out.action_peaks.get(name, (-1,))[0]:
                    out.action_peaks[name] = (total, dict(live), t)
        for c in CATEGORIES:
            out.category_peaks[c] = max(out.category_peaks[c], live[c])
    out.peak_time = peak_at
    if peak_at is not None:
        out.peak_action = next((name for start, end, name in actions if start <= peak_at <= end), None)
    return out


def frees_of_released(events: list) -> list:
    """``events`` with each release (:func:`~.memory_profile.released`) made a free where its allocation has
    no recorded free before its address is reused, and dropped otherwise."""
    events.sort(key=lambda e: (e[0], e[1]))
    following: dict = {}  # index of a release -> the next allocation or free at its address
    pending: dict = {}  # ptr -> indices of its releases not yet followed
    size: dict = {}  # index of a release -> the bytes of what was allocated at its address then
    last: dict = {}  # ptr -> the bytes of its latest allocation
    for i, e in enumerate(events):
        if e[2] == "release":
            pending.setdefault(e[3], []).append(i)
            size[i] = last.get(e[3], 0)
        elif e[2] == "alloc":
            if e[4] > 0:
                last[e[3]] = e[4]
            for j in pending.pop(e[3], ()):
                following[j] = e
    out = []
    for i, e in enumerate(events):
        if e[2] != "release":
            out.append(e)
        elif following.get(i) is None or following[i][4] > 0:  # never freed, or its address reused first
            out.append((e[0], 0, "alloc", e[3], -size[i], 0))
    return out



def block_bytes(nbytes: int) -> int:
    """The block the CUDA caching allocator serves ``nbytes`` from (multiples of 512, at least 512)."""
    return max(512, -(-nbytes // 512) * 512)



def replay_history(trace: list, tags: list, actions: list, start: tuple[int, int], live_at_start: int | None,
                   block=None) -> StepMemory:
    """A :class:`StepMemory` of a CUDA allocator's ``trace``: allocations and requested frees as blocks
    (``block``: :func:`block_bytes`), ``tags`` (allocations, frees, ptr, category, nbytes) and
    ``actions`` placed by the counters, ``start`` the counters when it began."""
    block = block or block_bytes
    a0, f0 = start
    events, alloc_at, free_at = [], [], []  # alloc_at[k]: index of the step's k-th allocation
    for entry in trace:
        act = entry.get("action")
        if act == "alloc":
            alloc_at.append(len(events))
            events.append((len(events), 0, "alloc", entry["addr"], block(int(entry["size"])), 0))
        elif act == "free_requested":
            free_at.append(len(events))
            events.append((len(events), 0, "alloc", entry["addr"], -block(int(entry["size"])), 0))

    def place(counts: tuple[int, int]) -> float:
        # just after the last allocation and free the counters had seen
        a, f = counts[0] - a0, counts[1] - f0
        last = max(alloc_at[min(a, len(alloc_at)) - 1] if a > 0 and alloc_at else -1,
                   free_at[min(f, len(free_at)) - 1] if f > 0 and free_at else -1)
        return last + 0.5

    for a, f, ptr, category, nbytes in tags:
        events.append((place((a, f)), 1, "tag", ptr, category, block(nbytes)))
    placed = [(place(begin), place(end), name) for begin, end, name in actions]
    return replay(events, placed, live_at_start)


def as_allocator_history(events: list, actions: list, block=None) -> StepMemory:
    """A CPU step's events replayed as a CUDA allocator's history (:func:`replay_history`)."""
    import bisect

    allocs = sorted((e for e in events if e[2] == "alloc"), key=lambda e: e[0])
    made = [e[0] for e in allocs if e[4] > 0]
    gone = [e[0] for e in allocs if e[4] <= 0]

    def counts(t, before: bool = False) -> tuple[int, int]:  # made and freed by time t (before it)
        cut = bisect.bisect_left if before else bisect.bisect_right
        return cut(made, t), cut(gone, t)

    tags = [(*counts(t), ptr, category, nbytes) for t, _, kind, ptr, category, nbytes in events if kind == "tag"]
    placed = [(counts(start, before=True), counts(end), name) for start, end, name in actions]
    trace = [{"action": "alloc" if e[4] > 0 else "free_requested", "addr": e[3], "size": abs(e[4])} for e in allocs]
    return replay_history(trace, tags, placed, (0, 0), None, block)
