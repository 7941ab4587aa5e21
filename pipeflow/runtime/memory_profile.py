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
  segments; ``outputs``: a stage's output and the copy it is sent as, from the moment
  it is sent (a gradient sent back was the backward's until then); ``inputs``: the
  buffers messages are received into;
- ``temporaries``: every other allocation (a backward's intermediate gradients, the
  optimizer's foreach buffers, a recomputed layer, autocast's casts before a save).

On CUDA the caching allocator keeps its own history of every allocation and free
(``torch.cuda.memory._record_memory_history``), in the order they happened, with the
block sizes its peak statistic counts; there a tag is not a profiler event but an entry
in a log that notes how many allocations and frees the allocator had made when the tag
ran (its counters), which places the tag exactly in that history. What was live when
the step began and was never tagged (cuBLAS's workspaces, say) counts as temporaries
from the start, so the step's peak is the allocator's own ``max_memory_allocated``.

The peak is the most bytes live at one instant (the sum over categories at that
instant, not a sum of each category's own peak). torch's own memory profile classifies
by data flow instead, and gives up (an assertion) on the graphs the zero-bubble split
keeps, which is why the runtime names its tensors itself. It costs time (the profiler
records every operator), so it runs for one step, the run's last.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from ..topology.host import quiet_stderr

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
# held for this from the tag on, whatever the allocation was until then: what a stage
# sends is an output from the moment it is sent (the gradient a last stage sends back is
# the residual stream's, which its backward made at the head's and carried through
# every block as a temporary)
_FROM_SEND = {"outputs"}
_PREFIX = "pipeflow::tag::"
_active = False  # tags are recorded only while a step is profiled
_cuda = None  # the step's _CudaLog while a CUDA step is profiled


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


def tag(t, category: str) -> None:
    """Name ``t``'s storage as held for ``category`` in the step's profile (a no-op
    unless a step is being profiled)."""
    if not _active or not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return
    nbytes = t.untyped_storage().nbytes()
    if _cuda is not None and t.device.type == "cuda":
        _cuda.tag(t.untyped_storage().data_ptr(), category, nbytes)
        return
    with torch.profiler.record_function(f"{_PREFIX}{category}::{nbytes}"), torch.no_grad():
        torch.ops.aten.alias(t)


_ACTION = "pipeflow::action::"


def action(a):
    """Name the schedule's action ``a`` for the step's profile (which one holds the
    peak: ``StepMemory.peak_action``); nothing unless a step is being profiled."""
    if not _active:
        return contextlib.nullcontext()
    if _cuda is not None:
        return _cuda.action(str(a))
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
        if p.untyped_storage().nbytes():  # (a fully sharded stage's, let go: its shard below)
            tag(p, "parameters")
        if p.grad is not None:
            tag(p.grad, "gradients")
    for b in module.buffers():
        tag(b, "parameters")
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                tag(v, "optimizer_state")
        for g in getattr(optimizer, "gradients", None) or ():  # ZeRO-2: its slices of the gradients
            if g is not None:
                tag(g, "gradients")
        for w in getattr(optimizer, "shards", None) or ():  # ZeRO-3: its share of the parameters
            if w is not None:
                tag(w, "parameters")


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
    tagged at the optimizer step was a gradient from the start), except what a stage
    sends and what I hands to W, which are held for that from their tag on. A tag, or a free, at an
    address with nothing allocated there in the step is a storage the step found live:
    it counts from the step's start."""
    from torch.profiler._memory_profiler import OpTree, _EventType

    events = []  # (time, order, kind, ptr, size or category, nbytes)
    actions = []  # (start, end, name) of each action the executor named
    dump = os.environ.get("PIPEFLOW_MEMORY_DUMP")  # a path: what is live at the peak, with its operators
    made_by: dict = {}  # id of an allocation event -> the operators it was made in (dump only)
    if dump:
        from .memory_dump import dump_cpu_peak, operators
    for ev in OpTree(result).dfs():
        if ev.name.startswith(_ACTION):
            actions.append((ev.start_time_ns, ev.end_time_ns, ev.name[len(_ACTION):]))
            continue
        kind, fields = ev.typed
        if kind == _EventType.Allocation:
            if _same(fields.device, device):
                events.append((ev.start_time_ns, 0, "alloc", fields.ptr, fields.alloc_size, 0))
                if dump:
                    made_by[id(events[-1])] = operators(ev)
        elif ev.name.startswith(_PREFIX):
            category, nbytes = ev.name[len(_PREFIX):].split("::")
            for child in ev.children:
                for meta in getattr(child.typed[1], "inputs", ()):
                    ptr = getattr(meta, "storage_data_ptr", None)
                    if ptr and _same(getattr(meta, "device", None), device):
                        events.append((ev.start_time_ns, 1, "tag", ptr, category, int(nbytes)))
    out = _replay(events, actions, per_action=bool(dump))
    if dump:
        dump_cpu_peak(f"{dump}.cpu.{os.getpid()}.json", events, made_by, out, actions,
                      (_PRIORITY, _FROM_TAG, _FROM_SEND))
    return out


def _replay(events: list, actions: list, live_at_start: int | None = None, per_action: bool = False) -> StepMemory:
    """Walk a step's allocations, frees and tags (``(time, order, kind, ptr, size or
    category, nbytes)``) in time order: the live bytes per category at each instant. An
    allocation at an address still live was freed unseen (the profiler records no free
    made on another thread, as gloo's are when its work outlives the caller's tensor):
    it ends there at the latest.
    ``live_at_start``: where the allocator says how much was live when the step began,
    what of it no event names counts as temporaries from the start. ``per_action``: each
    action's own most too (``StepMemory.action_peaks``; a debugging aid)."""
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


def _block_bytes(nbytes: int) -> int:
    """The block the CUDA caching allocator serves ``nbytes`` from (its sizes are
    multiples of 512 bytes, at least 512), which its statistics count."""
    return max(512, -(-nbytes // 512) * 512)


class _CudaLog:
    """A CUDA step's tags and actions, each placed in the allocator's history by the
    allocator's counters of allocations and frees at that moment."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self._counts()
        self.tags = []  # (allocs, frees, ptr, category, nbytes)
        self.actions = []  # (allocs, frees) at start and end, name

    def _counts(self) -> tuple[int, int]:
        stats = torch.cuda.memory.memory_stats_as_nested_dict(self.device)["allocation"]["all"]
        return int(stats["allocated"]), int(stats["freed"])

    def tag(self, ptr: int, category: str, nbytes: int) -> None:
        if ptr:
            self.tags.append((*self._counts(), ptr, category, nbytes))

    @contextlib.contextmanager
    def action(self, name: str):
        begin = self._counts()
        try:
            yield
        finally:
            self.actions.append((begin, self._counts(), name))

    def replay(self, trace: list, live_at_start: int) -> StepMemory:
        """The step from the allocator's ``trace`` (its entries since the log began):
        each allocation ("alloc") and free ("free_requested", where the allocator's
        statistics count it freed) in order, the tags and actions placed among them.
        The trace gives the size asked for; a block is that rounded up to 512 bytes
        (a cached block reused without a split can be larger still: the allocator's
        peak counts that slack, this replay does not)."""
        a0, f0 = self.start
        events, alloc_at, free_at = [], [], []  # alloc_at[k]: index of the step's k-th allocation
        for entry in trace:
            act = entry.get("action")
            if act == "alloc":
                alloc_at.append(len(events))
                events.append((len(events), 0, "alloc", entry["addr"], _block_bytes(int(entry["size"])), 0))
            elif act == "free_requested":
                free_at.append(len(events))
                events.append((len(events), 0, "alloc", entry["addr"], -_block_bytes(int(entry["size"])), 0))

        def place(counts: tuple[int, int]) -> float:
            # just after the last allocation and free the counters had seen
            a, f = counts[0] - a0, counts[1] - f0
            last = max(alloc_at[min(a, len(alloc_at)) - 1] if a > 0 and alloc_at else -1,
                       free_at[min(f, len(free_at)) - 1] if f > 0 and free_at else -1)
            return last + 0.5

        for a, f, ptr, category, nbytes in self.tags:
            events.append((place((a, f)), 1, "tag", ptr, category, _block_bytes(nbytes)))
        actions = [(place(begin), place(end), name) for begin, end, name in self.actions]
        return _replay(events, actions, live_at_start)


@contextlib.contextmanager
def profile_step(device: torch.device, enabled: bool = True):
    """Run the block under the memory profiler; yields a :class:`StepMemory` filled on exit."""
    global _active
    result = StepMemory()
    if not enabled:
        yield result
        return
    if device.type == "cuda":
        with _profile_cuda(device, result):
            yield result
        return
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
    with quiet_stderr():  # kineto announces its start and stop on stderr, once per rank
        prof.start()
    _active = True
    try:
        yield result
    finally:
        _active = False
        with quiet_stderr():
            prof.stop()
    measured = analyse(prof.profiler.kineto_results, device)
    result.peak_bytes, result.at_peak, result.category_peaks, result.peak_action = \
        measured.peak_bytes, measured.at_peak, measured.category_peaks, measured.peak_action


@contextlib.contextmanager
def _profile_cuda(device: torch.device, result: StepMemory):
    """Profile a step on CUDA from the caching allocator's own history (see the module's
    text); ``result.allocator_peak_bytes`` is ``max_memory_allocated`` over the step,
    which the replayed peak equals when every allocation is accounted for."""
    global _active, _cuda
    from torch.cuda import memory as cm

    dump = os.environ.get("PIPEFLOW_CUDA_MEMORY_DUMP")  # a path: what is live at the peak, with its Python stack
    # the dump's stacks: C++ frames too (a backward allocates on autograd's thread, with no Python frames)
    context, stacks = ("alloc", "all") if dump else (None, "python")
    torch.cuda.synchronize(device)
    try:
        cm._record_memory_history("all", context=context, stacks=stacks, max_entries=1 << 24, device=device,
                                  clear_history=True)
    except TypeError:  # an older torch without clear_history: nothing was recorded before anyway
        cm._record_memory_history("all", context=context, stacks=stacks, max_entries=1 << 24, device=device)
    torch.cuda.reset_peak_memory_stats(device)
    start = int(torch.cuda.memory_allocated(device))
    _cuda = _CudaLog(device)
    _active = True
    try:
        yield result
    finally:
        _active = False
        log, _cuda = _cuda, None
        torch.cuda.synchronize(device)
        result.allocator_peak_bytes = int(torch.cuda.max_memory_allocated(device))
        index = device.index if device.index is not None else torch.cuda.current_device()
        trace = cm._snapshot(device)["device_traces"][index]
        cm._record_memory_history(None, device=device)
    measured = log.replay(trace, start)
    result.peak_bytes, result.at_peak, result.category_peaks, result.peak_action = \
        measured.peak_bytes, measured.at_peak, measured.category_peaks, measured.peak_action
    if dump:
        _dump_peak(f"{dump}.{device.index}.{os.getpid()}.json", trace, log, measured)


def _dump_peak(path: str, trace: list, log: "_CudaLog", step: StepMemory) -> None:
    """Debugging aid: every allocation of the step live at its peak (its size, the last
    tag at its address, the Python and C++ frames that made it), largest first."""
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
    named = {ptr: category for _, _, ptr, category, _ in log.tags}
    rows = [{"bytes": _block_bytes(int(e["size"])), "tag": named.get(addr),
             "frames": [f"{f.get('filename', '').rsplit('/', 2)[-1]}:{f.get('line')}:{f.get('name')}"
                        for f in e.get("frames", [])[:48]]}
            for addr, e in live.items()]
    rows.sort(key=lambda r: -r["bytes"])
    with open(path, "w") as f:
        json.dump({"peak_bytes": step.peak_bytes, "at_peak": step.at_peak, "peak_action": step.peak_action,
                   "action_peaks": step.action_peaks, "live": rows}, f, indent=1)
