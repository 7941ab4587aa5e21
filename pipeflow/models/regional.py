"""Regional compilation (``compile=true``): each transformer block of a stage compiled on
its own, as torchtitan does, rather than the stage whole. A stage's embedding, head and
loss stay eager; the blocks, one class repeated, compile once and share the code (their
weights are the compiled code's inputs, not constants), so a stage of many layers costs
one compile, and a pipeline's stages cut the model anywhere between blocks."""

from __future__ import annotations

from torch import nn


def blocks(stage: nn.Module) -> list[nn.Module]:
    """The stage's transformer blocks: the modules of the types its family built it with
    (``stage.block_types``, set by :func:`pipeflow.models.recompute.apply_recompute`)."""
    types = getattr(stage, "block_types", ())
    if not types:
        raise ValueError(f"{type(stage).__name__}: its family did not name its blocks (block_types)")
    return [m for m in stage.modules() if isinstance(m, types)]


def compile_blocks(stage: nn.Module) -> int:
    """Compile each block of ``stage`` in place (``nn.Module.compile``: the module, its
    parameters and their names stay as they are, so optimizers, checkpoints and tied
    weights see the same tensors). The number of blocks compiled."""
    found = blocks(stage)
    for block in found:
        block.compile()
    return len(found)


def is_compiled(block: nn.Module) -> bool:
    """``block`` runs through torch.compile (compile_blocks compiled it)."""
    return getattr(block, "_compiled_call_impl", None) is not None
