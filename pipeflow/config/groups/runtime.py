"""The ``runtime`` group of pipeflow-train: backend, device, loss scale, message matching, timeouts, threads
and the failure test hooks.
"""

from __future__ import annotations


from omegaconf import DictConfig

from pipeflow.numbers import is_whole
from pipeflow.device_paths import check as check_paths

from ..values import ConfigError, at_least, number

BACKENDS = ("auto", "gloo", "nccl")

RUNTIME_DEVICES = ("auto", "cpu", "cuda")

P2P_MODES = ("tagged", "ordered")  # runtime.p2p: messages matched by tag, or per pair in order (as NCCL does)

FAIL_MODES = ("raise", "kill", "collective")

MEMORY_MODES = ("count", "profile")  # runtime.memory: the saved-bytes count, or every allocation of the last step


def _cuda_devices() -> int:
    # torch is imported only when a config asks for CUDA, so checking a CPU config stays fast
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0

def check_runtime(rt: DictConfig, world_size: int) -> None:
    if rt.backend not in BACKENDS:
        raise ConfigError(f"runtime.backend={rt.backend}: unknown backend; allowed values: {', '.join(BACKENDS)}")
    if rt.device not in RUNTIME_DEVICES:
        raise ConfigError(f"runtime.device={rt.device}: unknown device; allowed values: {', '.join(RUNTIME_DEVICES)}")
    number("runtime.loss_scale", rt.loss_scale, "must be > 0", rt.loss_scale > 0)
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
    number("runtime.timeout_s", rt.timeout_s, "must be > 0 seconds", rt.timeout_s > 0)
    number("runtime.hang_timeout_s", rt.hang_timeout_s, "must be >= 0 seconds (0: never)", rt.hang_timeout_s >= 0)
    at_least("runtime.threads_per_rank", rt.threads_per_rank, 1)
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
