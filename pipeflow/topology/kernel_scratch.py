"""What this host's kernels allocate beyond their results on the CPU (*scratch*,
docs/memory_terms.md): oneDNN's inside a 16-bit matrix product and the fused attention's
backward. The size is the library's choice, so it is measured once per shape and process
under torch's profiler (its first use costs about two seconds); docs/runtime.md has the
figures."""

from __future__ import annotations

import contextlib
import functools
import os


@functools.lru_cache(maxsize=None)
def product_scratch(m: int, k: int, n: int, transposed: bool, dtype: str = "bfloat16", threads: int = 1) -> int:
    """The most bytes one ``(m x k) @ (k x n)`` product in ``dtype`` allocates on this host beyond
    its result, on ``threads`` threads (``transposed``: the first operand a transposed view, as
    in a weight gradient); 0 where nothing."""
    import torch

    dt = getattr(torch, dtype)
    if dt.itemsize >= 4:
        return 0
    a = torch.zeros(k, m, dtype=dt).t() if transposed else torch.zeros(m, k, dtype=dt)
    b = torch.zeros(k, n, dtype=dt)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with quiet_stderr(), profile_allocations() as events:
            torch.mm(a, b)
    finally:
        torch.set_num_threads(old)
    sizes = [size for size in events if size > 0]
    if m * n * dt.itemsize in sizes:  # the result itself
        sizes.remove(m * n * dt.itemsize)
    return int(max(sizes, default=0))


@functools.lru_cache(maxsize=None)
def attention_scratch(batch: int, heads: int, kv_heads: int, queries: int, keys: int, head_dim: int,
                      causal: bool = True, dtype: str = "float32", threads: int = 1) -> int:
    """The most bytes the backward of one fused attention call (``queries`` over ``keys``, the
    earlier segments' keys first) allocates on this host beyond the gradients of Q, K and V, on
    ``threads`` threads, with the views and calls :mod:`pipeflow.models.attention` makes on CPU."""
    import torch
    import torch.nn.functional as F

    dt = getattr(torch, dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def view(s, h):  # a projection's output as the attention reads it
            return torch.zeros(batch, s, h, head_dim, dtype=dt).transpose(1, 2)

        q, grad = view(queries, heads).requires_grad_(), view(queries, heads)
        whole = keys == queries
        k, v = (view(keys, kv_heads) if whole else view(keys, kv_heads).contiguous() for _ in range(2))
        if whole:
            k.requires_grad_(), v.requires_grad_()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
            with quiet_stderr(), profile_allocations() as sizes:
                grads = torch.autograd.grad(out, (q, k, v), grad)
        else:
            def mask():  # as the backward rebuilds it (only its size matters here)
                return torch.where(torch.ones(queries, keys, dtype=torch.bool), torch.zeros((), dtype=dt),
                                   torch.finfo(dt).min)

            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.detach(), k, v, 0.0, False, attn_mask=mask())
            with quiet_stderr(), profile_allocations() as sizes:
                grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad.contiguous(), q.detach(), k, v, out, lse, 0.0, False, attn_mask=mask())
    finally:
        torch.set_num_threads(old)
    return int(max(0, most_live(sizes) - sum(g.numel() * g.element_size() for g in grads)))


def most_live(sizes: list[int]) -> int:
    """The most bytes live at once over :func:`profile_allocations`' sizes (allocations
    positive, frees negative, in order), counted from the block's start."""
    live = peak = 0
    for size in sizes:
        live += size
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def profile_allocations():
    """The sizes of every CPU allocation (positive) and free (negative) in the block, in
    order (a list, filled when the block ends)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import OpTree, _EventType

    sizes: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield sizes
    events = [(ev.start_time_ns, f.alloc_size) for ev in OpTree(prof.profiler.kineto_results).dfs()
              for kind, f in [ev.typed] if kind == _EventType.Allocation]
    sizes.extend(size for _, size in sorted(events, key=lambda e: e[0]))


@contextlib.contextmanager
def quiet_stderr():
    """Send the process's stderr (file descriptor 2, where C++ libraries write) to
    /dev/null for the block: kineto announces the profiler's start and stop there."""
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
