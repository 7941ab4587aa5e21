"""Activation recomputation (``model.recompute``: ``none``, ``full`` per block, ``selective``
the attention sub-layer). A region is pipeflow's own non-reentrant checkpoint
(:class:`_Region`): the first unpack in a backward reruns it with its forward's random and
autocast state; unlike ``torch.utils.checkpoint`` a saved tensor may be read twice in one
backward, as the zero-bubble I does (docs/training.md, "Activation recomputation")."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

MODES = ("none", "full", "selective")


class _Keep(torch.autograd.Function):
    """Identity that saves its input (and the region's other ``held`` tensors) for a backward
    that needs none: the saved-bytes meter then counts what a recomputed region keeps."""

    @staticmethod
    def forward(ctx, x, *held):
        ctx.save_for_backward(x, *held)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad, *_):
        return (grad, *(None for _ in ctx.saved_tensors[1:]))


def _kept(value, seen: dict, held: list):
    """``value`` through _Keep, once per tensor (an argument passed twice stays one object, as
    MultiheadAttention's packed projection needs); the first one kept also saves ``held``
    (emptied)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
        if id(value) not in seen:
            seen[id(value)] = _Keep.apply(value, *held)
            held.clear()
        return seen[id(value)]
    return value


def _held(args: tuple, kwargs: dict) -> list:
    """The floating tensors a region holds that need no gradient, one level into tuples and
    lists too (a rotary ``position_embeddings`` pair): kept for its rerun, outside autograd."""
    out, seen = [], set()
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


class _Stop(Exception):
    """Ends a rerun once it has rebuilt every tensor the forward saved."""


class _Slot:
    """What the graph keeps of one tensor a region saved: its position in the region's
    saves. When the graph lets it go, so does a rerun's copy."""

    __slots__ = ("region", "index", "__weakref__")

    def __init__(self, region: "_Region", index: int) -> None:
        self.region, self.index = region, index

    def __del__(self) -> None:
        values = self.region.values
        if values is not None and self.index < len(values):
            values[self.index] = None


class _Region:
    """One call of a recomputed region: its detached inputs, the random and autocast states of
    its forward, and its latest rerun's tensors with the backward they were for."""

    def __init__(self, fn, args: tuple, kwargs: dict) -> None:
        self.fn = fn
        self.args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self.grads = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        self.kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.kwgrads = {k: isinstance(v, torch.Tensor) and v.requires_grad for k, v in kwargs.items()}
        self.count = 0  # tensors the forward saved
        self.values: list | None = None
        self.task = None
        self.rng = torch.get_rng_state()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.cuda = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda]
        self.autocast = [(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
                         for dt in ("cpu", "cuda") if torch.is_autocast_enabled(dt)]
        self.autocast_cache = torch.is_autocast_cache_enabled()

    def forget_unused_rng(self) -> None:
        """After the forward: let go of the state of each generator it drew nothing from (5056
        bytes for the CPU's, per region and microbatch in flight)."""
        if self.rng is not None and torch.equal(self.rng, torch.get_rng_state()):
            self.rng = None
        kept = [(d, s) for d, s in zip(self.cuda, self.cuda_rng) if not torch.equal(s, torch.cuda.get_rng_state(d))]
        self.cuda, self.cuda_rng = [d for d, _ in kept], [s for _, s in kept]

    def pack(self, tensor: torch.Tensor) -> _Slot:
        self.count += 1
        return _Slot(self, self.count - 1)

    def unpack(self, slot: _Slot) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if self.values is None or self.task != task or task == -1:
            self._rerun(task)
        got = self.values[slot.index]
        if got is None:  # let go by a slot that is reading it: cannot happen while it is alive
            raise RuntimeError("model.recompute: a recomputed tensor was read after it was freed")
        return got

    def _rerun(self, task: int) -> None:
        values: list = []

        def capture(t: torch.Tensor) -> None:
            # a detached alias, and nothing left in the rerun's own graph: a tensor saved
            # by the node that made it would otherwise hold that node, a reference cycle
            # that kept every rerun alive until Python's cyclic collector ran
            values.append(t.detach())
            if len(values) == self.count:  # the last one the backward can ask for: stop here
                raise _Stop

        args = tuple(a.detach().requires_grad_(g) if isinstance(a, torch.Tensor) else a
                     for a, g in zip(self.args, self.grads))
        kwargs = {k: v.detach().requires_grad_(self.kwgrads[k]) if isinstance(v, torch.Tensor) else v
                  for k, v in self.kwargs.items()}
        with contextlib.ExitStack() as stack:
            # autocast's cache of weight casts is one for the process, its nesting depth
            # one per thread; on CUDA a backward, and so this rerun, runs on autograd's
            # device thread, where the rerun's autocast context would be the outermost
            # and its exit would clear the cache: the step's shared casts
            # (Precision.shared_casts) too, so that every later microbatch cast the
            # weights anew and kept its own copies (measured on an H200: gpt ZB-H1 bf16,
            # selective, held two copies of each MLP weight's cast, interleaved Seq1F1B
            # thirteen). One level more on this thread keeps the cache; the rerun adds
            # nothing to it (its casts bypass it)
            torch.autocast_increment_nesting()
            stack.callback(torch.autocast_decrement_nesting)
            if self.rng is not None or self.cuda:
                stack.enter_context(torch.random.fork_rng(devices=self.cuda))
            if self.rng is not None:
                torch.set_rng_state(self.rng)
            for d, state in zip(self.cuda, self.cuda_rng):
                torch.cuda.set_rng_state(state, d)
            for dt, enabled, dtype in self.autocast:
                # without autocast's cache (as the forward ran it): the cache keeps its cast
                # of a leaf that requires grad (meant for weights) until the outermost
                # autocast context ends, the step's (Precision.shared_casts), and the
                # rerun's inputs are such leaves: every microbatch's recomputed input and
                # its 16-bit casts stayed to the end of the step (measured: BERT's last
                # stage at bf16 with full recomputation held all 8 microbatches' block
                # inputs). A recomputed region casts its weights anew in its forward and
                # in its rerun, one block at a time, freed with it: a stage keeps no 16-bit
                # copy of what it recomputes
                stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled, cache_enabled=False))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(capture, lambda t: t))  # never unpacked
            try:
                self.fn(*args, **kwargs)
            except _Stop:  # what follows the last save (the block's output) is not needed
                pass
        if len(values) != self.count:
            raise RuntimeError(f"model.recompute: the recomputed region saved {len(values)} tensors where its "
                               f"forward saved {self.count}: it does not run the same operations twice")
        self.values, self.task = values, task
        if task != -1:  # gone at the end of this backward, if its slots have not gone first
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._drop, task))

    def _drop(self, task: int) -> None:
        if self.task == task:
            self.values, self.task = None, None


def recomputed(fn):
    """``fn`` as a recomputed region: only its (floating, differentiable) inputs are kept."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        seen: dict = {}
        held = _held(args, kwargs)
        args = tuple(_kept(a, seen, held) for a in args)
        kwargs = {k: _kept(v, seen, held) for k, v in kwargs.items()}
        region = _Region(fn, args, kwargs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack))
            for dt, enabled, dtype in region.autocast:  # the region's casts its own: see _Region._rerun
                stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled, cache_enabled=False))
            out = fn(*args, **kwargs)
        region.forget_unused_rng()
        return out

    run.recomputes = fn  # (what the region reruns: regional compile compiles it inside the region)
    return run


def _regions(block: nn.Module, mode: str) -> list[tuple[object, str]]:
    """The (object, method name) pairs of one transformer block that a mode recomputes."""
    if mode == "full":
        return [(block, "forward")]
    # selective: the attention sub-layers. CBM's blocks name theirs as methods of one
    # tensor each (self_attend, cross_attend); GPT-2's and BERT's are modules
    if hasattr(block, "self_attend"):
        return [(block, name) for name in ("self_attend", "cross_attend")]
    # (transformers' Llama, Qwen2 and Mistral layers call theirs self_attn)
    return [(getattr(block, name), "forward") for name in ("attn", "attention", "self_attn") if hasattr(block, name)]


def apply_recompute(stage: nn.Module, mode: str, block_types: tuple[type, ...]) -> nn.Module:
    """Make every block of ``stage`` (the modules of ``block_types``) recompute as
    ``mode`` says; ``stage.recompute`` records the mode (GPT's segment path reads it),
    ``stage.block_types`` the blocks' types."""
    if mode not in MODES:
        raise ValueError(f"model.recompute={mode}: allowed values: {', '.join(MODES)}")
    stage.recompute = mode
    stage.block_types = tuple(block_types)  # the family's blocks (pipeflow.models.regional reads them too)
    if mode == "none":
        return stage
    for block in [m for m in stage.modules() if isinstance(m, block_types)]:
        for owner, name in _regions(block, mode):
            setattr(owner, name, recomputed(getattr(owner, name)))
    return stage
