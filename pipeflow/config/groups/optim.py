"""The ``optim`` group: AdamW and its learning-rate schedule (the runtime's
pipeflow.runtime.optimizer)."""

from __future__ import annotations


from omegaconf import DictConfig

from ...planning.optimizer_step import IMPLS
from ..values import ConfigError, at_least, number

OPTIMIZERS = ("adamw",)


def check_optim(optim: DictConfig) -> None:
    if optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={optim.name}: unknown optimizer; allowed values: {', '.join(OPTIMIZERS)}")
    number("optim.lr", optim.lr, "the learning rate must be > 0", optim.lr > 0)
    number("optim.weight_decay", optim.weight_decay, "must be >= 0", optim.weight_decay >= 0)
    for key in ("beta1", "beta2"):
        number(f"optim.{key}", optim[key], "must be in [0, 1)", 0 <= optim[key] < 1)
    number("optim.eps", optim.eps, "must be > 0", optim.eps > 0)
    at_least("optim.warmup_steps", optim.warmup_steps, 0)
    number("optim.min_lr_ratio", optim.min_lr_ratio, "must be in [0, 1]", 0 <= optim.min_lr_ratio <= 1)
    impl = optim.get("impl", "auto")
    if impl not in IMPLS:
        raise ConfigError(f"optim.impl={impl}: unknown AdamW implementation; allowed values: {', '.join(IMPLS)}")
    if optim.grad_clip is not None:
        number("optim.grad_clip", optim.grad_clip, "must be >= 0, or null for no clipping", optim.grad_clip >= 0)
