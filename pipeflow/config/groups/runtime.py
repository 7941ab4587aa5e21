"""The ``runtime`` group of pipeflow-train: backend, device, loss scale, message matching,
timeouts, threads and the failure test hooks."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from pipeflow.numbers import is_whole
from pipeflow.device_paths import check as check_paths

from ..values import ConfigError, at_least, number

BACKENDS = ("auto", "gloo", "nccl")

RUNTIME_DEVICES = ("auto", "cpu", "cuda")

P2P_MODES = ("tagged", "ordered")  # runtime.p2p: messages matched by tag, or per pair in order (as NCCL does)

FAIL_MODES = ("raise", "kill", "collective")

MEMORY_MODES = ("count", "profile")  # runtime.memory: the saved-bytes count, or every allocation of the last step

# The launcher's limits the timeouts meet (the config cannot import the runtime: a test
# holds these equal to pipeflow.runtime.supervise.BEAT and the launcher's store wait).
BEAT_S = 0.5  # seconds between a rank's heartbeats
SILENT_S = 3 * BEAT_S + 1.0  # the launcher calls a rank silent after three missed beats and a second's slack
STORE_WAITS = 4  # the launcher's rendezvous store waits 4 x runtime.timeout_s (a calibration's ranks too)
# torch's TCPStore hands poll() what is left of its wait in milliseconds, cast to a C int;
# past 2**31 - 1 ms the cast wraps, and a client's connect times out at once (timeout_s=1e12:
# "timed out after 4000000000000000ms" as it starts)
POLL_MS = 2**31 - 1
MAX_TIMEOUT_S = math.floor(POLL_MS / 1000 / STORE_WAITS)  # 536,870 s, about 6.2 days
TIMEOUT_RANGE = f"use {SILENT_S:g}..{MAX_TIMEOUT_S} seconds"
MAX_THREADS = 4096


def _cuda_devices() -> int:
    # torch is imported only when a config asks for CUDA, so checking a CPU config stays fast
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0

def check_runtime(rt: DictConfig, world_size: int) -> None:
    if rt.backend not in BACKENDS:
        raise ConfigError(f"runtime.backend={rt.backend}: unknown backend; allowed values: {', '.join(BACKENDS)}")
    if rt.device not in RUNTIME_DEVICES:
        raise ConfigError(f"runtime.device={rt.device}: unknown device; allowed values: {', '.join(RUNTIME_DEVICES)}")
    number("runtime.loss_scale", rt.loss_scale, "fp16's first loss scale must be a finite number > 0 (halving an "
           "infinite one leaves it infinite: every step would be skipped)", 0 < rt.loss_scale < math.inf)
    if rt.p2p not in P2P_MODES:
        raise ConfigError(f"runtime.p2p={rt.p2p}: unknown matching; allowed values: {', '.join(P2P_MODES)}")
    if rt.memory not in MEMORY_MODES:
        raise ConfigError(f"runtime.memory={rt.memory}: allowed values: {', '.join(MEMORY_MODES)} (count: what "
                          "autograd saves, always on; profile: every allocation of the last step, by category)")
    if rt.backend == "nccl" and rt.device == "cpu":
        raise ConfigError("runtime.backend=nccl: NCCL moves CUDA tensors only; use runtime.backend=gloo (or auto) "
                          "with runtime.device=cpu")
    if rt.backend == "nccl" or rt.device == "cuda":
        key, value = ("runtime.backend", rt.backend) if rt.backend == "nccl" else ("runtime.device", rt.device)
        gpus = _cuda_devices()
        if gpus == 0:
            raise ConfigError(f"{key}={value}: no CUDA device is available here; use {key}=auto (gloo on CPU)")
        if gpus < world_size and rt.backend != "gloo":
            # NCCL refuses two ranks on one GPU; gloo shares them (messages through host memory)
            raise ConfigError(
                f"{key}={value}: the schedule needs {world_size} ranks but only {gpus} CUDA devices are visible "
                f"(NCCL puts each rank on its own GPU); use fewer pipeline.stages, runtime.backend=gloo (ranks "
                f"share the GPUs, messages pass through host memory) or runtime.device=cpu"
            )
    if rt.get("sync_check") and (rt.device == "cpu" or (rt.device == "auto" and not _cuda_devices())):
        where = "cpu" if rt.device == "cpu" else "auto, CPU ranks here (no CUDA device is visible)"
        raise ConfigError(f"runtime.sync_check=true: checks that a CUDA rank's step makes no host synchronisation, "
                          f"and runtime.device={where}; use it on a GPU (runtime.device=cuda or auto), or "
                          f"runtime.sync_check=false")
    try:
        check_paths(list(rt.get("cuda_paths") or []))
    except ValueError as err:
        raise ConfigError(f"{err} (CUDA's code paths, taken on CPU ranks: pipeflow.device_paths)") from None
    check_timeouts(rt)
    # more threads than cores only run slowly (and a cluster's hosts may have more than
    # this one); torch's thread pool crashes at 100,000 here, and 4,096 still ran
    number("runtime.threads_per_rank", rt.threads_per_rank, f"must be a whole number in 1..{MAX_THREADS} (this host "
           f"has {os.cpu_count() or 1} cores, which the ranks share)",
           is_whole(rt.threads_per_rank) and 1 <= rt.threads_per_rank <= MAX_THREADS)
    trace = rt.get("trace_steps", 0)
    number("runtime.trace_steps", trace, "must be a whole number >= 0 (0: no trace; N: the last N steps "
           "under torch's profiler, written to op_trace.json)", is_whole(trace) and trace >= 0)
    if rt.master_port is not None:
        number("runtime.master_port", rt.master_port, "must be null (a free port) or in 1..65535",
                is_whole(rt.master_port) and 1 <= rt.master_port <= 65535)
    if (rt.fail_at_step is None) != (rt.fail_rank is None):
        unset = "runtime.fail_rank" if rt.fail_rank is None else "runtime.fail_at_step"
        raise ConfigError(f"{unset}=null: the failure test hook needs both runtime.fail_rank and runtime.fail_at_step")
    if rt.fail_rank is not None:
        number("runtime.fail_rank", rt.fail_rank, f"must be a rank in 0..{world_size - 1}",
                is_whole(rt.fail_rank) and 0 <= rt.fail_rank < world_size)
        at_least("runtime.fail_at_step", rt.fail_at_step, 1)
        if rt.fail_mode not in FAIL_MODES:
            raise ConfigError(f"runtime.fail_mode={rt.fail_mode}: allowed values: {', '.join(FAIL_MODES)}")


def check_timeouts(rt: DictConfig) -> None:
    """runtime.timeout_s within what the launcher can wait and tell apart (see the module's
    constants), runtime.hang_timeout_s 0 or longer than a healthy rank's silences."""
    t = rt.timeout_s
    number("runtime.timeout_s", t, f"not a number; {TIMEOUT_RANGE}", t == t)  # (nan)
    number("runtime.timeout_s", t, f"too long: at most {MAX_TIMEOUT_S} seconds (about {MAX_TIMEOUT_S / 86400:.1f} "
           f"days): the launcher's rendezvous store waits {STORE_WAITS} times it, and torch's TCPStore hands that wait "
           f"to poll() in milliseconds as a C int (at most {POLL_MS:,}); {TIMEOUT_RANGE}", not t > MAX_TIMEOUT_S)
    number("runtime.timeout_s", t, f"too short: every wait on another rank ends there (at 0.1 s the ranks waiting "
           f"while rank 0 builds the data set fail), and under {SILENT_S:g} s a stopped rank's peers time out before "
           f"the launcher hears it fall silent (three missed heartbeats of {BEAT_S:g} s and 1 s), so a waiting rank "
           f"is blamed; {TIMEOUT_RANGE}", t >= SILENT_S)
    hang = rt.hang_timeout_s
    number("runtime.hang_timeout_s", hang, f"must be 0 (never) or at least {SILENT_S:g} seconds: a healthy rank beats "
           f"every {BEAT_S:g} s, and the launcher calls a rank silent only after {SILENT_S:g} s (three missed beats "
           f"and 1 s), so a shorter wait fails a run that is only busy", hang == 0 or hang >= SILENT_S)


def rank_memory(rt: DictConfig) -> tuple[int, str, bool] | None:
    """The memory of the devices the ranks run on: (bytes, its words, whether every rank shares
    it), or None where unknown. CPU ranks: the host's (or its container's limit), shared where
    started here; CUDA ranks: the smallest visible GPU's (torch imported only with a driver)."""
    if rt.device == "cuda" or (rt.device == "auto" and _gpu_driver_here() and _cuda_devices() > 0):
        import torch

        sizes = [(torch.cuda.get_device_properties(i).total_memory, i) for i in range(torch.cuda.device_count())]
        if sizes:
            size, i = min(sizes)
            return int(size), f"GPU {i}'s memory", False
    host = host_memory()
    # torchrun's ranks, or a Slurm step's (as pipeflow.runtime.cluster adopts them), may sit on other hosts
    env = os.environ
    elsewhere = {"RANK", "WORLD_SIZE"} <= env.keys() or env.get("SLURM_STEP_NUM_TASKS", "1") not in ("", "0", "1")
    return None if host is None else (*host, not elsewhere)


def host_memory() -> tuple[int, str] | None:
    """This host's memory (bytes, words), or a lower cgroup limit (a container's)."""
    try:
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < size:
            return int(text), "this container's memory limit"
    return size, "this host's memory"


def _gpu_driver_here() -> bool:
    """A GPU driver's device files (NVIDIA's, ROCm's): without them torch finds no CUDA
    device, so runtime.device=auto means CPU ranks without torch being asked."""
    return "torch" in sys.modules or any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))
