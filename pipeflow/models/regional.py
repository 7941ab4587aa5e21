"""Regional compilation (``compile=true``): each transformer block of a stage compiled on
its own, as torchtitan does; embedding, head and loss stay eager. Under recomputation the
compiled code goes inside the recomputed regions; under the zero-bubble split
(``eager_products``) each weight product stays eager, so its backward is the node the
split does by hand (docs/training.md, "Compiled blocks")."""

from __future__ import annotations

import torch
from torch import nn


def blocks(stage: nn.Module) -> list[nn.Module]:
    """The stage's transformer blocks: the modules of the types its family built it with
    (``stage.block_types``, set by :func:`pipeflow.models.recompute.apply_recompute`)."""
    types = getattr(stage, "block_types", ())
    if not types:
        raise ValueError(f"{type(stage).__name__}: its family did not name its blocks (block_types)")
    return [m for m in stage.modules() if isinstance(m, types)]


def _regions(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """The recomputed regions in ``block``: (module, attribute) whose value is a
    :func:`~pipeflow.models.recompute.recomputed` wrapper."""
    return [(m, "forward") for m in block.modules() if hasattr(m.__dict__.get("forward"), "recomputes")]


def weight_products(block: nn.Module) -> list[nn.Module]:
    """The sub-modules of ``block`` that multiply by a weight matrix: ``nn.Linear``,
    transformers' ``Conv1D`` (GPT-2), a tensor-parallel rank's cut of either."""
    from transformers.pytorch_utils import Conv1D

    from .tensor_parallel import ParallelLinear

    return [m for m in block.modules() if isinstance(m, (nn.Linear, Conv1D, ParallelLinear))]


def compile_blocks(stage: nn.Module, eager_products: bool = False) -> int:
    """Compile each block of ``stage`` in place (``nn.Module.compile``: parameters and their
    names unchanged); a recomputed block inside its regions, and with ``eager_products`` the
    weight products left eager. Returns the number of blocks compiled."""
    from .recompute import recomputed

    found = blocks(stage)
    for block in found:
        if eager_products:
            for product in weight_products(block):
                product.forward = torch.compiler.disable(product.forward, recursive=True)
        regions = _regions(block)
        if not regions:
            block.compile()
            continue
        owners = set()
        for owner, name in regions:
            inner = getattr(owner, name).recomputes
            setattr(owner, name, recomputed(torch.compile(inner)))
            owners.add(owner)
        if block not in owners:  # selective: the sub-modules beside the attention
            for child in block.children():
                if owners.isdisjoint(child.modules()):
                    child.compile()
    return len(found)


def is_compiled(block: nn.Module) -> bool:
    """``block`` runs through torch.compile (compile_blocks compiled it, or what it recomputes)."""
    if getattr(block, "_compiled_call_impl", None) is not None:
        return True
    return any(hasattr(getattr(o, n).recomputes, "_torchdynamo_orig_callable") for o, n in _regions(block))
