"""A rank's device: which one and which backend, its peak memory, and the allocator
setting every rank runs with.
"""

from __future__ import annotations

import os
import resource
from datetime import timedelta

import torch
import torch.distributed as dist

# set by the launcher: it hosts the job's rendezvous store itself, on a port the system
# gave it and it holds, and every rank joins it as a client (HOSTED_STORE)
HOSTED_STORE = "PIPEFLOW_HOSTED_STORE"


def device_and_backend(runtime, rank: int) -> tuple[torch.device, str]:
    """This rank's device and process-group backend (``runtime.device``, ``runtime.backend``).

    NCCL puts each rank on its own GPU. gloo with ``runtime.device=cuda`` computes on the
    GPUs too, several ranks to a GPU where there are more ranks than GPUs (each process
    its own CUDA context and caching allocator, so each rank's memory is its own), and
    moves messages through host memory (:class:`~pipeflow.runtime.messages.MessageIO`)."""
    backend, wanted = runtime.backend, runtime.device
    cuda = torch.cuda.is_available() and wanted in ("auto", "cuda")
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" or (cuda and wanted == "cuda"):
        _allocator_settings(runtime.expandable_segments)
        local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
        return torch.device("cuda", local), backend
    return torch.device("cpu"), backend


def _allocator_settings(expandable: bool) -> None:
    """The CUDA caching allocator's expandable segments (``runtime.expandable_segments``),
    before this rank's first allocation, unless ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise.

    Without them a large block (over 1 MiB) is split only where more than 1 MiB would be
    left over: a tensor served from a cached block up to 1 MiB larger than asked for
    holds the whole block, and ``max_memory_allocated`` counts it. At 4k tokens, where
    most of a step's tensors are several MiB of varied sizes, each rank's peak on an
    H200 stood 37-100 MiB above what its allocations asked for (the allocator's history
    records the sizes asked for). With expandable segments every block is split to its
    size rounded to 512 bytes: the peak is what the tensors need, the simulator's
    count (read from the allocator's source: ``should_split``; a ``cuda`` test checks it
    where a GPU is lent), and fragmentation across steps falls too."""
    if not expandable or "expandable_segments" in os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # a torch without them, or a platform that lacks them
        pass


_timeout: list[timedelta] = []  # the job's runtime.timeout_s, which every group of it gets


def new_group(ranks: list[int]):
    """``dist.new_group(ranks)`` under the job's timeout. torch gives a group made after
    the world group a default of its own (30 minutes on gloo, not the world group's
    ``runtime.timeout_s``): a stage's replicas stuck in an all-gather waited that long."""
    return dist.new_group(ranks, timeout=_timeout[0] if _timeout else None)


def join_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the job's process group: through the launcher's store where it hosts one
    (local ranks: no port picked free and bound again later, which two jobs starting
    at once on one host could both pick), else by torch's env:// rendezvous (torchrun,
    Slurm, runtime.master_port)."""
    timeout = timedelta(seconds=timeout_s)
    _timeout[:] = [timeout]
    if os.environ.get(HOSTED_STORE) == "1":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)


def peak_memory(device: torch.device) -> int:
    """The most bytes this rank held: CUDA's allocator peak, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def keep_freed_memory() -> bool:
    """Let glibc keep large freed blocks in the process instead of unmapping them.

    By default glibc serves every block above its mmap threshold with a fresh mmap and
    unmaps it on free, so each new tensor of a step page-faults its memory in again.
    A backward that frees as it goes mostly reuses blocks below the threshold, but one
    that keeps its graph (the zero-bubble I, which retains it for W) holds many large
    blocks at once and pays the faults on every step: measured here, autograd.grad
    with retain_graph=True took 14.8 ms where the same pass without it took 11.0, and
    10.4 with the threshold raised. Raising the thresholds removes that churn for every
    schedule. A no-op where glibc's mallopt is missing (not Linux)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # glibc caps the mmap threshold at 32 MiB on 64-bit systems (HEAP_MAX / 2)
    ok = mallopt(m_mmap_threshold, 32 * 2**20) == 1
    return mallopt(m_trim_threshold, 1 << 30) == 1 and ok
