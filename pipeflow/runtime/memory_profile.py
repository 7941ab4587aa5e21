"""Every byte a rank allocates during one step, by what holds it (``runtime.memory=profile``).

The saved-bytes meter (:mod:`pipeflow.runtime.memory`) is always on and cheap, but it
sees only what autograd saves and what the schedules hold by hand. This measurement
sees every tensor allocation and free on the rank's device: the step runs under
PyTorch's profiler with ``profile_memory=True`` (on CPU it records each allocation of
the CPU allocator with its size and the storage it makes; on CUDA, the caching
allocator's), and the runtime names what it holds by passing each such tensor through
a recorded no-op (:func:`tag`, an ``aten::alias`` inside a ``pipeflow::tag::<category>``
range; only while profiling) so that the profile links the storage to its role:

- ``parameters`` and ``optimizer_state`` (tagged at each optimizer step; those the step
  never allocates or frees count from its start), ``gradients`` (each ``.grad``, tagged
  before it is cleared), ``weight_versions`` (the copies an asynchronous policy stashes);
- ``casts``: at 16 bits, autocast's cast of a weight, which the step's products share
  and save (the meter's pack hook tags it, as below);
- ``activations``: what autograd saves for a backward (the meter's pack hook tags it);
  ``residuals``: what the zero-bubble split
  holds from I until W; ``kv``: a Seq1F1B segment's keys and values held for later
  segments; ``outputs``: a stage's output and the copy it is sent as; ``inputs``: the
  buffers messages are received into;
- ``temporaries``: every other allocation (a backward's intermediate gradients, the
  optimizer's foreach buffers, a recomputed layer, autocast's casts before a save).

The peak is the most bytes live at one instant (the sum over categories at that
instant, not a sum of each category's own peak). torch's own memory profile classifies
by data flow instead, and gives up (an assertion) on the graphs the zero-bubble split
keeps, which is why the runtime names its tensors itself. It costs time (the profiler
records every operator), so it runs for one step, the run's last.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

CATEGORIES = ("parameters", "weight_versions", "optimizer_state", "gradients", "casts", "activations", "residuals",
              "kv", "outputs", "inputs", "temporaries")

# a storage tagged twice counts where it is held most specifically (a residual W keeps
# may have been saved by autograd first)
_PRIORITY = {c: n for n, c in enumerate(("parameters", "weight_versions", "optimizer_state", "gradients", "casts",
                                         "residuals", "kv", "outputs", "activations", "inputs"))}
# held for this from the tag on, where the allocation was named before (an operand a
# zero-bubble I takes for W was an activation until then); any other tag names the
# allocation's whole life (a gradient I makes for W is a residual from the start)
_FROM_TAG = {"residuals"}
_PREFIX = "pipeflow::tag::"
_active = False  # tags are recorded only while a step is profiled


@dataclass
class StepMemory:
    """One step's allocations on one device."""

    peak_bytes: int = 0  # the most bytes live at one instant
    at_peak: dict = field(default_factory=dict)  # category -> bytes live at that instant
    category_peaks: dict = field(default_factory=dict)  # category -> its own most bytes live
    allocator_peak_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated over the step
    peak_action: str | None = None  # the schedule's action running at the peak ("1B3": stage 1, B, microbatch 3)

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "at_peak": self.at_peak, "category_peaks": self.category_peaks,
                **({"peak_action": self.peak_action} if self.peak_action else {}),
                **({"allocator_peak_bytes": self.allocator_peak_bytes} if self.allocator_peak_bytes is not None
                   else {})}


def tag(t, category: str) -> None:
    """Name ``t``'s storage as held for ``category`` in the step's profile (a no-op
    unless a step is being profiled)."""
    if not _active or not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return
    nbytes = t.untyped_storage().nbytes()
    with torch.profiler.record_function(f"{_PREFIX}{category}::{nbytes}"), torch.no_grad():
        torch.ops.aten.alias(t)


_ACTION = "pipeflow::action::"


def action(a):
    """Name the schedule's action ``a`` for the step's profile (which one holds the
    peak: ``StepMemory.peak_action``); nothing unless a step is being profiled."""
    if not _active:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"{_ACTION}{a}")


_VIEWS = ("TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0")


def is_weight_cast(t: torch.Tensor) -> bool:
    """``t`` is autocast's 16-bit cast of a parameter (a cast whose backward feeds a
    leaf's gradient accumulator): a stage keeps one per weight for the step."""
    fn = t.grad_fn
    for _ in range(3):  # what a product saves may be a transposed view of the cast
        if fn is None or not fn.next_functions:
            return False
        name = type(fn).__name__
        if name == "ToCopyBackward0":
            nxt = fn.next_functions[0][0]
            return nxt is not None and type(nxt).__name__ == "AccumulateGrad"
        if name not in _VIEWS:
            return False
        fn = fn.next_functions[0][0]
    return False


def tag_stage(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Tag a stage's parameters, gradients and optimizer state (at its optimizer step)."""
    if not _active:
        return
    for p in module.parameters():
        tag(p, "parameters")
        if p.grad is not None:
            tag(p.grad, "gradients")
    for b in module.buffers():
        tag(b, "parameters")
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                tag(v, "optimizer_state")


def _same(d, device: torch.device) -> bool:
    """``d`` is ``device`` (an event may name a CUDA device without its index)."""
    if d is None or torch.device(d).type != device.type:
        return False
    d = torch.device(d)
    return d.index is None or device.index is None or d.index == device.index


def analyse(result, device: torch.device) -> StepMemory:
    """The live bytes per category over a profile's allocations on ``device``.

    Allocations are paired with their frees by address (an allocator never hands out an
    address that is still live), and a tag names the allocation live at its address at
    the tag's time, for the allocation's whole life (a gradient made in a backward and
    tagged at the optimizer step was a gradient from the start). A tag, or a free, at an
    address with nothing allocated there in the step is a storage the step found live:
    it counts from the step's start."""
    from torch.profiler._memory_profiler import OpTree, _EventType

    events = []  # (time, order, kind, ptr, size or category, nbytes)
    actions = []  # (start, end, name) of each action the executor named
    for ev in OpTree(result).dfs():
        if ev.name.startswith(_ACTION):
            actions.append((ev.start_time_ns, ev.end_time_ns, ev.name[len(_ACTION):]))
            continue
        kind, fields = ev.typed
        if kind == _EventType.Allocation:
            if _same(fields.device, device):
                events.append((ev.start_time_ns, 0, "alloc", fields.ptr, fields.alloc_size, 0))
        elif ev.name.startswith(_PREFIX):
            category, nbytes = ev.name[len(_PREFIX):].split("::")
            for child in ev.children:
                for meta in getattr(child.typed[1], "inputs", ()):
                    ptr = getattr(meta, "storage_data_ptr", None)
                    if ptr and _same(getattr(meta, "device", None), device):
                        events.append((ev.start_time_ns, 1, "tag", ptr, category, int(nbytes)))
    events.sort(key=lambda e: (e[0], e[1]))
    # pass 1: the allocations' lives and categories
    lives = []  # [size, category, preexisting]
    live_at: dict = {}  # ptr -> index into lives
    order = []  # (time, +1/-1, life index) in time order
    for t, _, kind, ptr, x, nbytes in events:
        if kind == "tag":
            i = live_at.get(ptr)
            if i is None:  # found live: counts from the start until its free, if any
                i = live_at[ptr] = len(lives)
                lives.append([nbytes, x, True])
            elif x in _FROM_TAG and lives[i][1] is not None and lives[i][1] != x:
                # held for this from now: what it was named until then
                order.append((t, 0, (i, x)))
            elif lives[i][1] is None or _PRIORITY[x] < _PRIORITY[lives[i][1]]:
                lives[i][1] = x
        elif x > 0:
            live_at[ptr] = len(lives)
            order.append((t, 1, len(lives)))
            lives.append([x, None, False])
        else:
            i = live_at.pop(ptr, None)
            if i is None:  # freed, never allocated in the step: it was live at the start
                i = len(lives)
                lives.append([-x, None, True])
            order.append((t, -1, i))
    live = dict.fromkeys(CATEGORIES, 0)
    for size, category, pre in lives:
        if pre:
            live[category or "temporaries"] += size
    out = StepMemory(peak_bytes=sum(live.values()), at_peak=dict(live), category_peaks=dict(live))
    total = out.peak_bytes
    n, k, peak_at = len(order), 0, None
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
        if total > out.peak_bytes:
            out.peak_bytes, out.at_peak, peak_at = total, dict(live), t
        for c in CATEGORIES:
            out.category_peaks[c] = max(out.category_peaks[c], live[c])
    if peak_at is not None:
        out.peak_action = next((name for start, end, name in actions if start <= peak_at <= end), None)
    return out


@contextlib.contextmanager
def _quiet_stderr():
    """Send the process's stderr (file descriptor 2, where C++ libraries write) to
    /dev/null for the block: only around the profiler's start and stop."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def profile_step(device: torch.device, enabled: bool = True):
    """Run the block under the memory profiler; yields a :class:`StepMemory` filled on exit."""
    global _active
    result = StepMemory()
    if not enabled:
        yield result
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    prof = profile(activities=activities, profile_memory=True, record_shapes=True)
    with _quiet_stderr():  # kineto announces its start and stop on stderr, once per rank
        prof.start()
    _active = True
    try:
        yield result
    finally:
        _active = False
        with _quiet_stderr():
            prof.stop()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        result.allocator_peak_bytes = int(torch.cuda.max_memory_allocated(device))
    measured = analyse(prof.profiler.kineto_results, device)
    result.peak_bytes, result.at_peak, result.category_peaks, result.peak_action = \
        measured.peak_bytes, measured.at_peak, measured.category_peaks, measured.peak_action
