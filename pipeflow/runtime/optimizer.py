"""A rank's optimizer and learning-rate policy (the ``optim`` config group): AdamW with
decoupled weight decay on matrices only, in the implementation ``optim.impl`` picks
(``fused``, ``foreach``, ``single``, ``auto``: fused where the device has it), and linear
warm-up then cosine decay to ``lr * min_lr_ratio``."""

from __future__ import annotations

import math

import torch

from ..formats.settings import AdamWConfig
from ..planning.optimizer_step import step_impl


def lr_at(step: int, optim: AdamWConfig, steps: int) -> float:
    """Linear warm-up to optim.lr over warmup_steps, then cosine decay to lr*min_lr_ratio at the last step."""
    lr, warmup = optim.lr, optim.warmup_steps
    if warmup and step <= warmup:
        return lr * step / warmup
    low = lr * optim.min_lr_ratio
    progress = (step - warmup) / max(1, steps - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (lr - low)


def square_sum(t: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The sum of ``t``'s squared elements as a float64 scalar (the clip norm's), within 1e-6 of
    the float64 sum: float32 dot products over rows of ``chunk`` elements summed in float64,
    with no float64 copy of ``t`` (for GPT-2's embedding such copies were 617 MB at once)."""
    flat = t.detach().reshape(-1)
    if not flat.is_floating_point() or flat.element_size() < 4:
        flat = flat.float()
    whole = flat.numel() // chunk * chunk
    total = flat.new_zeros((), dtype=torch.float64)
    if whole:
        rows = flat[:whole].view(-1, chunk)
        total = torch.bmm(rows.unsqueeze(1), rows.unsqueeze(2)).double().sum()
    tail = flat[whole:].double()  # (under a row: a float64 copy of it is nothing)
    return total + torch.dot(tail, tail) if tail.numel() else total


def make_optimizer(module: torch.nn.Module, optim: AdamWConfig, params: list | None = None) -> torch.optim.Optimizer:
    """AdamW over the module's parameters (or the given subset of them), in the
    implementation ``optim.impl`` picks for their device (:func:`step_impl`)."""
    chosen = [p for p in module.parameters() if p.requires_grad] if params is None else params
    # weight decay on matrices only (GPT-2 / nanoGPT practice): not on biases or norms
    decay = [p for p in chosen if p.dim() >= 2]
    rest = [p for p in chosen if p.dim() < 2]
    device = chosen[0].device.type if chosen else "cpu"
    impl = step_impl(getattr(optim, "impl", "auto"), device)
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        **kind,
    )
