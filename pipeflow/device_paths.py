"""Which device's code paths run: CUDA's where a tensor is on a GPU, and on CPU the ones
a test (or a user chasing a GPU-only failure on a laptop) asks for.

Some of pipeflow's code differs by device, and CI has no GPU. Each such branch has a
name here, and ``runtime.cuda_paths`` (a rank's setting, from the config) or
:func:`cuda_paths` (a block of one process) makes a CPU run take it, so that its
arithmetic runs in CI, at fp32 and under CPU autocast:

- ``attention``: the fused attention's CUDA branches (:mod:`pipeflow.models.attention`):
  a later Seq1F1B segment's lower-right causal bias (``causal_lower_right``, which
  torch's kernels take without a materialised mask), a sliding window's mask with K and
  V repeated to every query head, and K and V repeated at fp32 for grouped-query
  attention, which torch's fp32 CUDA kernel declines;
- ``staging``: a GPU rank's messages under gloo (:mod:`pipeflow.runtime.messages`): each
  send a host copy, each receive into host memory copied to the device buffer when
  waited for, and messages matched in the order posted (NCCL ignores tags);
- ``memory``: ``runtime.memory=profile`` read as the CUDA caching allocator's history
  is (:mod:`pipeflow.runtime.memory_profile`): the step's allocations as the allocator's
  trace (blocks of 512 bytes), each tag and action placed by the allocator's counts of
  allocations and frees at that moment;
- ``reads``: a GPU rank's step, which reads no device value before its work is launched
  (:class:`pipeflow.runtime.executor.Executor`): the clip's factor computed and applied on
  the device, the gradient norm and the loss read at the step's end (a CPU rank reads
  them mid-step, which costs it no wait).

What stays CUDA's alone (the kernels themselves, the caching allocator's blocks, CUDA's
random generators) is what the ``cuda`` tests run where a GPU is lent
(``tests/test_cuda.py``). Torch-free: a device is anything with a ``type`` (a
``torch.device``) or its name.
"""

from __future__ import annotations

import contextlib

PATHS = ("attention", "staging", "memory", "reads")

_emulated: frozenset = frozenset()


def check(paths) -> tuple[str, ...]:
    """``runtime.cuda_paths`` as a tuple of names (``all``: every one), or ValueError
    naming the key and the allowed values."""
    if paths is None:
        return ()
    names = [paths] if isinstance(paths, str) else list(paths)
    if "all" in names:
        return PATHS
    bad = [n for n in names if n not in PATHS]
    if bad:
        raise ValueError(f"runtime.cuda_paths={bad[0]}: allowed values: {', '.join(PATHS)}, all")
    return tuple(n for n in PATHS if n in names)


def emulate(paths) -> None:
    """Take CUDA's ``paths`` on CPU from now on, in this process (a rank at its start)."""
    global _emulated
    _emulated = frozenset(check(paths))


@contextlib.contextmanager
def cuda_paths(*paths: str):
    """Take CUDA's ``paths`` (all where none is named) on CPU inside the block."""
    global _emulated
    was = _emulated
    _emulated = frozenset(check(paths or "all"))
    try:
        yield
    finally:
        _emulated = was


def cuda_path(name: str, device) -> bool:
    """The CUDA branch ``name`` runs for ``device``: it is a GPU, or CUDA's path is emulated here."""
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    return kind == "cuda" or name in _emulated


def emulated() -> tuple[str, ...]:
    """The paths taken on CPU as CUDA takes them, here and now."""
    return tuple(n for n in PATHS if n in _emulated)
