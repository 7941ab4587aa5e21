"""A rank's device: which one and which backend, its peak memory, and the allocator
setting every rank runs with."""

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
    NCCL puts each rank on its own GPU; gloo with ``device=cuda`` shares the GPUs among
    the ranks and passes messages through host memory
    (:class:`~pipeflow.runtime.messages.MessageIO`)."""
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
    """Turn on the CUDA caching allocator's expandable segments (``runtime.expandable_segments``)
    before this rank's first allocation, unless ``PYTORCH_CUDA_ALLOC_CONF`` names them.
    Without them a cached block up to 1 MiB larger than asked for is held, and counted,
    whole (docs/runtime.md, "The caching allocator's slack")."""
    if not expandable or "expandable_segments" in os.environ.get(
            "PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # a torch without them, or a platform that lacks them
        pass


_timeout: list[timedelta] = []  # the job's runtime.timeout_s, which every group of it gets


def new_group(ranks: list[int]):
    """``dist.new_group(ranks)`` under the job's ``runtime.timeout_s`` (torch otherwise gives a
    group made after the world group its own 30 minutes on gloo)."""
    return dist.new_group(ranks, timeout=_timeout[0] if _timeout else None)


def join_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the job's process group: through the launcher's store where it hosts one
    (``HOSTED_STORE``), else by torch's env:// rendezvous. ``timeout_s`` in seconds."""
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
    """Raise glibc's mmap and trim thresholds so large freed blocks stay in the process;
    True where both took. A no-op returning False where mallopt is missing (not Linux)."""
    # glibc unmaps every freed block above its mmap threshold, so a backward that keeps its
    # graph (the zero-bubble I) page-faults its blocks in again each step
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
