"""The matrix products of a backward and what the host's math library allocates inside
them (its scratch: :func:`pipeflow.topology.kernel_scratch.product_scratch`), for the working sets
of :mod:`pipeflow.planning.working_set` and :mod:`pipeflow.planning.branched_memory`."""

from __future__ import annotations

from .transformer import RESIDUAL_BYTES, TransformerSpec, attention_products, matrix_inputs, mlp_products


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
    """Bytes the host's math library allocates inside a product run while a block's MLP hidden
    gradient is live: the down projection's weight gradient (:func:`down_weight_scratch`; the
    larger with its input gradient's without a bias), or with ``up`` the up projection's. 0
    without ``scratch`` (a CPU topology at 16 bits sets it) and for a gated MLP."""
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
    """(rows, columns, tokens) of each weight whose gradient a stage's W computes by a matrix
    product, in the runtime's order (from the stage's output back): BERT's decoder and dense
    transform or the LM head; per block the MLP's down, up (and gate), the attention's output
    and its fused Q/K/V or V, K and Q apart."""
    H = spec.n_embd
    out = []
    if head:
        out.append((spec.vocab_size, H, tokens))
        if spec.post_norm:
            out.append((H, H, tokens))
    block = [(n, k) for _, k, n in reversed([*attention_products(spec), *mlp_products(spec)])]
    out += [(r, c, tokens) for _ in range(blocks) for r, c in block]
    return out


def weight_phase_bytes(products: list[tuple[int, int, int]], dtype_bytes: int, scratch, fresh: bool) -> float:
    """W's most on top of its level, in bytes, over its products (:func:`weight_products`):
    each product's result (compute dtype) beside the host's scratch or, at 16 bits, its fp32
    copy. ``fresh`` (a W into a stage with no gradients yet): that copy becomes the gradient,
    so the most is near the end."""
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
    """(held, of that kept by I for W) bytes of a recomputed attention's rerun at its rotary
    rotation, on top of what was live: the Q, K and V projections (at 16 bits from their own
    casts) and the rotation's fp32 temporaries. (0, 0) without rotary positions."""
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
