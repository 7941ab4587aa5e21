"""The matrix products of a backward and what the host's math library allocates inside
them (its scratch: :func:`pipeflow.topology.kernel_scratch.product_scratch`), for the working sets
of :mod:`pipeflow.planning.working_set` and :mod:`pipeflow.planning.branched_memory`."""

from __future__ import annotations

from .transformer import RESIDUAL_BYTES, TransformerSpec, matrix_inputs


def weight_product_scratch(scratch, rows: int, tokens: int, cols: int) -> float:
    """The host's scratch (``scratch``: :func:`pipeflow.topology.kernel_scratch.product_scratch`, or
    None) for a weight gradient's product over ``tokens``, ``rows`` x ``cols``: its first
    operand transposed, either way round by how the matrix is stored, so the larger."""
    if scratch is None:
        return 0.0
    return float(max(scratch(rows, tokens, cols, True), scratch(cols, tokens, rows, True)))


def down_weight_scratch(spec: TransformerSpec, tokens: int, scratch) -> float:
    """The scratch of the MLP down projection's weight-gradient product over ``tokens``:
    ``hidden^T @ grad`` where the weight is stored [in, out] (GPT-2's Conv1D), ``grad^T @
    hidden`` where [out, in] (nn.Linear); 0 without a ``scratch``."""
    if scratch is None:
        return 0.0
    H, I = spec.n_embd, spec.ffn_width
    return float(scratch(I, tokens, H, True) if spec.weights_in_out else scratch(H, tokens, I, True))


def mlp_product_scratch(spec: TransformerSpec, tokens: int, dtype_bytes: int, scratch, up: bool = False) -> float:
    """What the host's math library allocates inside a product that runs while a block's
    MLP hidden gradient is live (``scratch``: :func:`pipeflow.topology.kernel_scratch.product_scratch`,
    set from a CPU topology at 16 bits; None elsewhere): the down projection's weight
    gradient (after its input's, with a bias), a product with its first operand
    transposed, ``hidden^T @ grad`` where the weight is stored [in, out] (GPT-2's Conv1D),
    ``grad^T @ hidden`` where [out, in] (nn.Linear). The up projection's runs after the
    activation's backward, when the hidden gradient and the activation's input have gone
    (measured, bert GPipe bf16: its larger scratch is not the block's most), ``up``: that
    product's scratch instead, for a model whose MLP peaks there (the branched model's
    blocks hold their 16-bit weight gradients to the casts' backward). Without a bias
    the down projection's input gradient comes last, its product beside its result. A
    gated MLP holds the most in its product of the gate and the up projection, where no
    matrix product runs."""
    if scratch is None or dtype_bytes >= 4 or spec.mlp == "gated":
        return 0.0
    H, I = spec.n_embd, spec.ffn_width
    if up:  # grad^T @ input ([out, in]) or input^T @ grad ([in, out]) over I x H
        return float(scratch(H, tokens, I, True) if spec.weights_in_out else scratch(I, tokens, H, True))
    most = down_weight_scratch(spec, tokens, scratch)
    if not spec.mlp_bias:
        most = max(most, scratch(tokens, H, I, False))
    return float(most)


def weight_products(spec: TransformerSpec, blocks: int, head: bool, tokens: int) -> list[tuple[int, int, int]]:
    """(rows, columns, tokens) of each weight a stage's W computes the gradient of by a
    matrix product, in the order the runtime's W runs them (the order I reached them,
    walking from the stage's output: the head's first, then each block's from its last
    product to its first): BERT's decoder and dense transform, or the LM head; a block's
    MLP down projection, its up (and gate) projection, the attention's output
    projection, and its fused Q/K/V (GPT-2's c_attn) or V, K and Q apart."""
    H, I = spec.n_embd, spec.ffn_width
    q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
    out = []
    if head:
        out.append((spec.vocab_size, H, tokens))
        if spec.post_norm:
            out.append((H, H, tokens))
    qkv = [(q + 2 * kv, H)] if spec.qkv_inputs == 1 else [(kv, H), (kv, H), (q, H)]
    block = [(H, I), *[(I, H)] * (spec.mlp_matrices - 1), (H, q), *qkv]
    out += [(r, c, tokens) for _ in range(blocks) for r, c in block]
    return out


def weight_phase_bytes(products: list[tuple[int, int, int]], dtype_bytes: int, scratch, fresh: bool) -> float:
    """What W holds at its most on top of its level (what I kept for it is held until W
    returns, pipeflow.runtime.backward), over its products (:func:`weight_products`):
    each product's result (compute dtype) beside the host's scratch for it
    (:func:`mlp_product_scratch`'s ``scratch``, either orientation) or, at 16 bits, the
    fp32 copy it is cast to before it is added. ``fresh`` (a W into a stage with no
    gradients yet, which the simulator has added whole): that copy becomes the gradient,
    and at each product the gradients of it and the products after it are not yet made,
    so the most is near the end (measured: cbm ZB-H2's first W on the text stage, at the
    first block's Q/K/V, every other gradient made)."""
    c = dtype_bytes
    left = 4.0 * sum(r * k for r, k, _ in products) if fresh else 0.0
    most = 0.0 if fresh else float("-inf")
    for r, k, tokens in products:
        e = r * k
        room = weight_product_scratch(scratch, r, tokens, k) if c < 4 else 0.0
        most = max(most, c * e + max(room, 4 * e if c < 4 else 0) - left)
        left -= 4.0 * e if fresh else 0.0
    return float(max(most, 0.0))


def rerun_rotation_bytes(spec: TransformerSpec, tokens: int, c: int) -> tuple[float, float]:
    """A recomputed attention's rerun at its rotary rotation, on top of what was live
    before it: (what it holds, of that what I keeps for W). The Q, K and V projections
    (compute dtype; at 16 bits from their own casts of the region's input, which W keeps,
    :func:`matrix_inputs`, and the weights' casts made anew), and the rotation of Q, then
    of K beside Q's result: x cos (fp32: the tables are), the half-rotated copy (compute
    dtype), at 16 bits its fp32 promotion, and x sin (fp32); measured, llama ZB-H2 bf16
    selective (its I peaks there). Nothing without rotary positions."""
    if spec.position_embedding != "rotary":
        return 0.0, 0.0
    H = spec.n_embd
    q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
    r = 2 * RESIDUAL_BYTES + c + (RESIDUAL_BYTES if c < 4 else 0)
    # (and, kept too, the output projection's output gradient: its 16-bit cast of the
    # stream's gradient, made before its backward unpacked the region and started the rerun)
    casts = (matrix_inputs(spec, c)[0] + 1) * tokens * H * c if c < 4 else 0.0
    held = tokens * (q + 2 * kv) * c + ((q + 2 * kv) * H * c if c < 4 else 0.0)
    rotation = tokens * max(q * r, RESIDUAL_BYTES * q + kv * r)
    return float(casts + held + rotation), float(casts)
