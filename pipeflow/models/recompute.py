"""Activation recomputation (``model.recompute``), for every model family.

- ``none``: every block keeps what its backward needs.
- ``full``: each block keeps only its input; its backward first recomputes the block's
  forward (torchtitan's and Megatron's full recomputation).
- ``selective``: each block's attention sub-layer keeps only its input and is
  recomputed in the backward. The MLP's activations are kept. Attention holds the
  largest activations per token, the T x T scores.

A recomputed region runs under PyTorch's non-reentrant checkpoint, which replays the
region's random state, so dropout draws the same masks twice. Non-reentrant checkpoints
also work with the zero-bubble split: I and W unpack the recomputed tensors like any
saved ones. The region's input is saved through :class:`_Keep`, an identity whose
backward needs nothing. A checkpoint holds that input outside autograd's saved-tensor
hooks, and the saved-bytes meter (:mod:`pipeflow.runtime.memory`) counts only what
passes through those hooks; _Keep puts the input through them, so the meter counts
what recomputation really keeps.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


class _Keep(torch.autograd.Function):
    """Identity that saves its input for the backward (where it is not needed): the
    saved-bytes meter then counts the tensor a recomputed region keeps."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _kept(value, seen: dict):
    """``value`` through _Keep, once per tensor: an argument passed twice stays one
    tensor (self-attention's query, key and value; MultiheadAttention takes its packed
    projection only when they are the same object)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
        if id(value) not in seen:
            seen[id(value)] = _Keep.apply(value)
        return seen[id(value)]
    return value


def recomputed(fn):
    """``fn`` as a recomputed region: only its (floating, differentiable) inputs are kept."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        seen: dict = {}
        args = tuple(_kept(a, seen) for a in args)
        kwargs = {k: _kept(v, seen) for k, v in kwargs.items()}
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run


def _regions(block: nn.Module, mode: str) -> list[tuple[object, str]]:
    """The (object, method name) pairs of one transformer block that a mode recomputes."""
    if mode == "full":
        return [(block, "forward")]
    # selective: the attention sub-layers. CBM's blocks name theirs as methods of one
    # tensor each (self_attend, cross_attend); GPT-2's and BERT's are modules
    if hasattr(block, "self_attend"):
        return [(block, name) for name in ("self_attend", "cross_attend")]
    # (transformers' Llama, Qwen2 and Mistral layers call theirs self_attn)
    return [(getattr(block, name), "forward") for name in ("attn", "attention", "self_attn") if hasattr(block, name)]


def apply_recompute(stage: nn.Module, mode: str, block_types: tuple[type, ...]) -> nn.Module:
    """Make every block of ``stage`` (the modules of ``block_types``) recompute as
    ``mode`` says; ``stage.recompute`` records the mode (GPT's segment path reads it)."""
    if mode not in MODES:
        raise ValueError(f"model.recompute={mode}: allowed values: {', '.join(MODES)}")
    stage.recompute = mode
    if mode == "none":
        return stage
    for block in [m for m in stage.modules() if isinstance(m, block_types)]:
        for owner, name in _regions(block, mode):
            setattr(owner, name, recomputed(getattr(owner, name)))
    return stage
