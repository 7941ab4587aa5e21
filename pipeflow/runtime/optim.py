"""A rank's optimizer and learning-rate policy: AdamW with decoupled weight decay on
matrices only, linear warm-up then cosine decay to ``lr * min_lr_ratio`` (the ``optim``
config group).
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, optim: dict, steps: int) -> float:
    """Linear warm-up to optim.lr over warmup_steps, then cosine decay to lr*min_lr_ratio at the last step."""
    lr, warmup = float(optim["lr"]), int(optim["warmup_steps"])
    if warmup and step <= warmup:
        return lr * step / warmup
    low = lr * float(optim["min_lr_ratio"])
    progress = (step - warmup) / max(1, steps - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (lr - low)


def make_optimizer(module: torch.nn.Module, optim: dict, params: list | None = None) -> torch.optim.Optimizer:
    """AdamW over the module's parameters (or the given subset of them)."""
    chosen = [p for p in module.parameters() if p.requires_grad] if params is None else params
    # weight decay on matrices only (GPT-2 / nanoGPT practice): not on biases or norms
    decay = [p for p in chosen if p.dim() >= 2]
    rest = [p for p in chosen if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(optim["weight_decay"])}, {"params": rest, "weight_decay": 0.0}],
        lr=float(optim["lr"]),
        betas=(float(optim["beta1"]), float(optim["beta2"])),
        eps=float(optim["eps"]),
    )
