"""Every byte a rank allocates during one step, by what holds it (``runtime.memory=profile``):
on CPU from PyTorch's profiler (``profile_memory=True``), on CUDA from the caching
allocator's history. :func:`tag` names what the runtime holds; every other allocation is
a temporary; the peak is the most bytes live at one instant (docs/runtime.md, "Memory")."""

from __future__ import annotations

import contextlib
import os

import torch

from ..device_paths import cuda_path
from ..topology.kernel_scratch import quiet_stderr
from . import watch
from .memory_replay import (_FROM_SEND, _FROM_TAG, _PRIORITY, StepMemory, as_allocator_history, block_bytes,
                            frees_of_released, replay, replay_history)

_PREFIX = "pipeflow::tag::"
_active = False  # tags are recorded only while a step is profiled
_cuda = None  # the step's _CudaLog while a CUDA step is profiled


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
_RELEASE = "pipeflow::release"


def released(*tensors) -> None:
    """The caller is done with these storages, which gloo may free on its own thread unseen by
    the profiler: the CPU replay ends each here unless a later free is recorded. A no-op
    unless a step is being profiled on CPU."""
    if not _active or _cuda is not None:
        return
    with torch.profiler.record_function(_RELEASE), torch.no_grad():
        for t in tensors:
            torch.ops.aten.alias(t)


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
    """The live bytes per category over a profile's allocations on ``device``. Allocations pair
    with frees by address; a tag names the allocation live at its address for its whole life
    (but outputs and residuals, from their tag on); a storage found live counts from the
    step's start. With ``runtime.cuda_paths=[memory]``, replayed as the allocator's history
    (:func:`as_allocator_history`)."""
    dump = os.environ.get("PIPEFLOW_MEMORY_DUMP")  # a path: what is live at the peak, with its operators
    events, actions, made_by = _events(result, device, dump)
    if cuda_path("memory", device):
        return as_allocator_history(events, actions)
    out = replay(events, actions, per_action=bool(dump))
    if dump:
        from .memory_dump import dump_cpu_peak

        dump_cpu_peak(f"{dump}.cpu.{os.getpid()}.json", events, made_by, out, actions,
                      (_PRIORITY, _FROM_TAG, _FROM_SEND))
    return out


def _events(result, device: torch.device, dump=None) -> tuple[list, list, dict]:
    """A CPU profile's allocations, frees and tags on ``device`` (``(time, order, kind, ptr,
    size or category, nbytes)``), the actions the executor named (``(start, end, name)``)
    and, with ``dump``, the operators each allocation was made in."""
    from torch.profiler._memory_profiler import OpTree, _EventType

    events, actions, made_by = [], [], {}
    if dump:
        from .memory_dump import operators
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
        elif ev.name == _RELEASE:
            events += [(ev.start_time_ns, 1, "release", ptr, None, 0) for ptr in _storages(ev, device)]
        elif ev.name.startswith(_PREFIX):
            category, nbytes = ev.name[len(_PREFIX):].split("::")
            events += [(ev.start_time_ns, 1, "tag", ptr, category, int(nbytes)) for ptr in _storages(ev, device)]
    return frees_of_released(events), actions, made_by


def _storages(ev, device: torch.device) -> list:
    """The storages on ``device`` a tag's or a release's range names (its aliases' inputs)."""
    out = []
    for child in ev.children:
        for meta in getattr(child.typed[1], "inputs", ()):
            ptr = getattr(meta, "storage_data_ptr", None)
            if ptr and _same(getattr(meta, "device", None), device):
                out.append(ptr)
    return out


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

    def replay(self, trace: list, live_at_start: int | None) -> StepMemory:
        """The step from the allocator's ``trace`` (its entries since the log began), this
        log's tags and actions placed in it (:func:`~.memory_replay.replay_history`)."""
        return replay_history(trace, self.tags, self.actions, self.start, live_at_start)


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
    # the watchdog takes no frame of the main thread meanwhile: one that outlived its call
    # would free the call's tensors on the watchdog's thread, whose frees are not recorded
    with watch.paused():
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
    """Profile a step on CUDA from the caching allocator's own history;
    ``result.allocator_peak_bytes`` is ``max_memory_allocated`` over the step."""
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
        from .memory_dump import dump_cuda_peak

        dump_cuda_peak(f"{dump}.{device.index}.{os.getpid()}.json", trace, log.tags, measured, block_bytes)

