"""What this host's math library allocates inside a 16-bit matrix product on the CPU.

On a CPU with bf16 instructions (AVX512-BF16, AMX), torch runs a bf16 product through
oneDNN, which asks torch's CPU allocator for a scratch buffer for the product's
duration: its blocks of the operands, repacked, one set per thread. Where the peak of a
rank falls inside such a product (a backward's weight gradient, most often) that
scratch is part of it: 401 KiB for GPT-tiny's MLP down projection (512 x 512 by
512 x 128, the first operand transposed) on one thread, twice that on two, and nothing
on a CPU without those instructions, where the product takes another path. The size is
the library's blocking, not a formula of the shapes, so it is measured here, once per
shape and process, by running the product under torch's profiler (it sees each
allocation; the first use costs the profiler's start, about two seconds).
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
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import OpTree, _EventType

    dt = getattr(torch, dtype)
    if dt.itemsize >= 4:
        return 0
    a = torch.zeros(k, m, dtype=dt).t() if transposed else torch.zeros(m, k, dtype=dt)
    b = torch.zeros(k, n, dtype=dt)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.mm(a, b)
    finally:
        torch.set_num_threads(old)
    sizes = [f.alloc_size for ev in OpTree(prof.profiler.kineto_results).dfs()
             for kind, f in [ev.typed] if kind == _EventType.Allocation and f.alloc_size > 0]
    if m * n * dt.itemsize in sizes:  # the result itself
        sizes.remove(m * n * dt.itemsize)
    return int(max(sizes, default=0))


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
