"""A stage's actions as operators: F, B, I and W over its blocks for one segment, and its optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

from .layer_operators import (block_forward, block_input_backward, block_weight_backward, embedding_backward,
                              embedding_forward, head_forward, head_input_backward, head_weight_backward,
                              recompute_forward)
from .operators import GradNorm, Operator, Pointwise, Shape, Step, times
from .transformer import RESIDUAL_BYTES


@dataclass(frozen=True)
class StageOperators:
    """The operators of each action kind on a stage of ``layers`` blocks, for one segment."""

    shape: Shape
    layers: int
    first: bool
    last: bool

    def action(self, kind: str) -> list[Operator]:
        """F, B, I or W: the operators in the order the runtime launches them."""
        sh, n = self.shape, self.layers
        if kind == "F":
            return [*(embedding_forward(sh) if self.first else []), *times(block_forward(sh), n),
                    *(head_forward(sh) if self.last else [])]
        head_i = head_input_backward(sh) if self.last else []
        head_w = head_weight_backward(sh) if self.last else []
        rerun = times(recompute_forward(sh), n)
        inputs = times(block_input_backward(sh), n)
        weights = times(block_weight_backward(sh), n)
        embed = embedding_backward(sh) if self.first else []
        if kind == "B":
            return [*head_i, *head_w, *rerun, *inputs, *weights, *embed]
        if kind == "I":  # the first stage's input needs no gradient: its I is empty, W the whole backward
            return [] if self.first else [*head_i, *rerun, *inputs]
        if kind == "W":
            return [*head_i, *head_w, *rerun, *inputs, *weights, *embed] if self.first else [*head_w, *weights]
        raise ValueError(f"no operators for action kind {kind!r}; kinds: F, B, I, W (S: step_operators)")


def step_operators(params: int, tensors: int, matrices: int, matrix_tensors: int, dtype_bytes: int,
                   impl: str = "fused") -> list[Operator]:
    """A stage's optimizer step as the runtime launches it: the clip norm, AdamW, and at 16 bits the next
    step's casts of the ``matrices`` weights."""
    ops: list[Operator] = [GradNorm(params, tensors), Step(params, tensors, impl)]
    if dtype_bytes < 4:
        ops.append(Pointwise("copy", "fwd", max(1, matrices // max(1, matrix_tensors)), RESIDUAL_BYTES,
                             count=matrix_tensors, name="weight casts"))
    return ops
