"""A rank's optimizer and learning-rate policy: AdamW with decoupled weight decay on
matrices only, linear warm-up then cosine decay to ``lr * min_lr_ratio`` (the ``optim``
config group).

``optim.impl`` picks torch's implementation of the update: ``fused`` (one kernel over
every tensor of a group, in place: no temporaries; torch has it for CPU and CUDA
tensors), ``foreach`` (the group's tensors a list at a time: the square root of every
second moment in a new buffer), ``single`` (a tensor at a time: each tensor's two
temporaries), or ``auto``: fused where the device has the kernel, else torch's own
default for the device. The three give the same update to rounding (fused against
single: a few 1e-9 after five steps of a unit-scale tensor); the memory model prices each
one's temporaries (:mod:`pipeflow.planning.optimizer_step`) and the time model each one's
measured step (a device profile's ``adamw`` rows).
"""

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
    """The sum of ``t``'s squared elements as a float64 scalar, without a float64 copy of
    ``t``: float32 dot products over rows of ``chunk`` elements (one batched product),
    summed in float64 (within 1e-6 of the float64 sum; 2e-8 at 40 million random elements).

    The clip norm's sum. ``t.double().pow(2).sum()`` made two float64 copies of every
    gradient on the way: for GPT-2's 50257 x 768 embedding 617 MB at once, between the
    last backward and the optimizer step, a first stage's peak at real widths (measured:
    1310 MiB where the step itself holds 1016)."""
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
