"""Regional compilation (``compile=true``): each transformer block of a stage compiled on
its own, as torchtitan does, rather than the stage whole. A stage's embedding, head and
loss stay eager; the blocks, one class repeated, compile once and share the code (their
weights are the compiled code's inputs, not constants), so a stage of many layers costs
one compile, and a pipeline's stages cut the model anywhere between blocks.

Under recomputation (``model.recompute``) the compiled code goes inside pipeflow's
recomputed regions (:mod:`pipeflow.models.recompute`), not around them: the region's
saved-tensor hooks, random state and rerun stay eager Python, and what they wrap is
compiled, so the rerun in the backward runs the same compiled forward. ``full``: the
block's forward, inside its region. ``selective``: the attention, inside its region,
and each of the block's other sub-modules (its norms and MLP) on its own.

Under the zero-bubble split (``eager_products``) a block's weight products stay out of
the compiled code: a compiled graph's backward is one autograd node that computes every
gradient of its graph at once, so I would make the weight gradients W is there to
defer (torch's pipelining refuses compile with its split schedules for this). Each
product with a weight (``nn.Linear``, GPT-2's ``Conv1D``, a tensor-parallel rank's cut)
runs eagerly, a graph break around it, so its backward is the matrix-product node that
the split's walk (:mod:`pipeflow.runtime.backward`) does by hand, its input gradient in I
and its weight gradient in W; what lies between the products (the norms, the residual
adds, the attention's kernel, the activation) is compiled. A compiled piece that holds
a norm's weight hands its gradient to I, which takes norms' with the input gradient
anyway (the walk's "direct" parameters), so nothing is computed twice.
"""

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
    """Compile each block of ``stage`` in place (``nn.Module.compile``: the module, its
    parameters and their names stay as they are, so optimizers, checkpoints and tied
    weights see the same tensors); a recomputed block, and with ``eager_products`` the
    weight products, as the module's docstring says. The number of blocks compiled."""
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
