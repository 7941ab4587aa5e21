"""The top-level ``precision`` of every app (train, simulate, plan, search): one key, one default."""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

from pipeflow.schedules.ir import WeightPolicy

from ..values import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")  # precision: the compute dtype under autocast

PRECISION_KEY = ("auto", *PRECISIONS)  # auto: fp32 on CPUs, bf16 on GPUs (checks.resolve_precision)

def resolve_precision(cfg: DictConfig, topology) -> str:
    """The run's precision: ``auto`` becomes its topology's devices' (fp32 on CPUs, bf16 on GPUs),
    written back into ``cfg`` so the ranks, config.json and the run key carry it; anything
    else outside PRECISION_KEY: ConfigError."""
    asked = cfg.get("precision") or "auto"
    if asked not in PRECISION_KEY:
        raise ConfigError(f"precision={asked}: unknown precision; allowed values: {', '.join(PRECISION_KEY)} "
                          f"(auto: fp32 on CPUs, bf16 on GPUs)")
    if asked == "auto":
        asked = "bf16" if topology.on_gpus else "fp32"
    with open_dict(cfg):
        cfg.precision = asked
    return asked

def check_precision(cfg: DictConfig, schedule) -> None:
    """fp16's loss scaling skips an overflowing step on every rank at once, at the
    synchronous step's flush; an asynchronous schedule updates stage by stage without one."""
    if cfg.precision == "fp16" and schedule.policy != WeightPolicy.SYNC:
        raise ConfigError(f"precision=fp16: loss scaling skips an overflowing step on every rank at a flush, "
                          f"which asynchronous schedules (schedule={cfg.schedule.name}) do not have; use "
                          f"precision=bf16 (no scaling needed)")
