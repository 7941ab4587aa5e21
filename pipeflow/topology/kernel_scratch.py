"""What this host's kernels allocate beyond their results on the CPU: the math library
inside a 16-bit matrix product, and the fused attention's backward.

On a CPU with bf16 instructions (AVX512-BF16, AMX), torch runs a bf16 product through
oneDNN, which asks torch's CPU allocator for a scratch buffer for the product's
duration: its blocks of the operands, repacked, one set per thread. Where the peak of a
rank falls inside such a product (a backward's weight gradient, most often) that
scratch is part of it: 401 KiB for GPT-tiny's MLP down projection (512 x 512 by
512 x 128, the first operand transposed) on one thread, twice that on two. On a CPU
with AVX2 alone the product takes another path and allocates nothing; with AVX-512 but
no AVX512-BF16 oneDNN emulates bf16 and holds an fp32 image of the product's output
(4 m n bytes). The size is the library's choice, not one formula of the shapes across
hosts, so it is measured here, once per shape and process, by running the product under
torch's profiler (it sees each allocation; the first use costs the profiler's start,
about two seconds).

The fused attention's backward (:func:`attention_scratch`) holds, beside the gradients of
Q, K and V it returns, a contiguous copy of the output's gradient, the kernel's blocks
of scores and their gradients, and, where a call needs a mask (a later Seq1F1B segment),
the ``T x P`` mask it rebuilds: 149 KiB for Llama-tiny's last segment (4 x 32 queries
over 128 keys, bf16), a third of what the gradients themselves hold.
"""

from __future__ import annotations

import contextlib
import functools
import os


@functools.lru_cache(maxsize=None)
def product_scratch(m: int, k: int, n: int, transposed: bool, dtype: str = "bfloat16", threads: int = 1) -> int:
    """The most bytes one ``(m x k) @ (k x n)`` product in ``dtype`` allocates on this host
    beyond its result (``transposed``: the first operand is a transposed view, as in a
    weight gradient's ``input.t() @ grad``), on ``threads`` threads; 0 where nothing."""
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
    """The most bytes the backward of one fused attention call allocates on this host
    beyond the gradients of Q, K and V it returns, on ``threads`` threads: ``queries`` over
    ``keys``, the earlier segments' keys first, as :mod:`pipeflow.models.attention` runs
    it on CPU (a whole sequence: torch's kernel through autograd; a later Seq1F1B segment:
    its mask rebuilt, the output's gradient made contiguous, the kernel's backward
    called; ``tests/test_attention.py`` checks the two agree). Q (and over a whole sequence K
    and V) are the views the models' projections make (``[b, s, heads, d]`` transposed),
    as is the output's gradient (the output projection's input gradient); a later
    segment's K and V are the prefix's concatenation."""
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
