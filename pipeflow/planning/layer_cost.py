"""One transformer layer's share of an action: its FLOPs, what its forward keeps for the
backward, what a backward rebuilds and what a zero-bubble I keeps for W, with
model.recompute applied (docs/planning.md, "Activation bytes"). :class:`~pipeflow.planning.cost.AnalyticCost`,
the branched cost and the planner's closed form all price layers with it."""

from __future__ import annotations

from dataclasses import dataclass

from .operators import Shape
from .saved_tensors import block_residual, block_saved
from .transformer import (
    RESIDUAL_BYTES,
    TransformerSpec,
    attention_linear_flops,
    attention_score_flops,
    layer_forward_flops,
    layer_linear_flops,
    recomputed_matrix_params,
    segment_own_kv,
)


@dataclass(frozen=True)
class LayerCost:
    """One layer's share of an action, for the last ``tokens`` tokens of a ``prefix``:
    FLOPs for one sequence, bytes for the whole microbatch (see :func:`layer_cost`)."""

    forward: float  # forward FLOPs
    weight: float  # of which weight matmuls (the W part of the backward)
    recompute: float  # FLOPs the backward reruns (model.recompute)
    saved: int  # bytes the forward keeps for the backward
    rebuilt: float  # bytes a backward rebuilds and holds while it runs (recomputation)
    residual: int  # bytes kept from I until W (zero-bubble split)


def layer_cost(spec: TransformerSpec, tokens: int, prefix: int, microbatch_size: int = 1,
               dtype_bytes: int = 2, segmented: bool = False) -> LayerCost:
    """One layer's :class:`LayerCost` for the last ``tokens`` tokens of a ``prefix`` (its whole
    sequence, or a segment's prefix), with model.recompute applied; what it keeps is what its
    forward's operators keep (:func:`~pipeflow.planning.saved_tensors.block_saved`)."""
    x, P, b, dt = tokens, prefix, microbatch_size, dtype_bytes
    f = layer_forward_flops(spec, x, P)
    # the tensors the block's forward operators keep (pipeflow.planning.operators), and of
    # them the attention region's; the stream (each sub-layer's input) is fp32 (r bytes)
    plain, region = block_saved(Shape(spec, b, x, P, dt))
    stream = spec.n_embd * RESIDUAL_BYTES
    own = segment_own_kv(spec, x, P, b, dt) if segmented else 0.0
    a = plain + b * own
    e, t = 0.0, 0.0
    if spec.recompute == "full":
        # the block keeps only its input (and a segment's keys and values, held for the
        # later segments); the backward reruns the block's forward
        # the rerun reads the block's input, kept, where its saved bytes counted it again:
        # the first norm's input (pre-norm), the Q/K/V products' at fp32 (post-norm)
        t = float(a) - (b * x * stream if not spec.post_norm or dt >= 4 else 0)
        if spec.qkv_inputs != 1:
            # the rerun hands its keys and values to no one (the segment's cache holds the
            # forward's): its own projections' outputs go once the attention has read them
            t -= b * own
        a = b * (x * stream + own)
        e = f
    elif spec.recompute == "selective":
        # the attention sub-layer keeps only its input; its forward (projections and
        # scores) runs again in the backward, and holds what it rebuilt meanwhile
        a -= region - b * x * stream
        attention = region
        if dt >= 4:  # at full precision the projections read the region's input itself, kept
            attention -= b * x * spec.n_embd * dt
        if P > x and spec.qkv_inputs == 1:  # the rerun's own keys and values, views in the fused
            attention += b * x * 2 * spec.kv_heads * spec.head_dim * dt  # output, beside the prefix's copy
        t = float(attention)
        e = attention_score_flops(spec, x, P) + attention_linear_flops(spec, x)
    if dt < 4:  # the rerun casts the weights it uses anew, held while the block's backward runs
        t += recomputed_matrix_params(spec) * dt
    # what W still needs after I: each weight matmul's input and output gradient,
    # GPT (3H + Fw) + (5H + Fw) per token — the zero-bubble paper's 32*b*s*H at 2 bytes
    r = block_residual(Shape(spec, b, x, x, dt))
    return LayerCost(f, layer_linear_flops(spec, x), e, float(a), t, r)
