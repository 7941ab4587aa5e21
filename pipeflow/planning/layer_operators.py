"""Each layer's operators in the order the runtime launches them (a block's forward, its input and weight
backwards, recomputation's rerun, the embedding's, the head's with the loss), for the family, segment,
tensor shard and precision; their FLOPs add up to the analytic cost's (``tests/test_operators.py``)."""

from __future__ import annotations

from dataclasses import replace

from .operators import Attention, Loss, Operator, Pointwise, Product, Saved, Shape
from .transformer import (RESIDUAL_BYTES, TransformerSpec, attention_products, embedding_params, head_params,
                          layer_params, mlp_products)


def _cast(sh: Shape, elements: int, phase: str, name: str) -> list[Pointwise]:
    """At 16 bits a product's fp32 input is cast (forward), its gradient cast back (backward)."""
    if sh.dtype_bytes >= 4:
        return []
    return [Pointwise("copy", phase, elements, RESIDUAL_BYTES, name=name)]


def _norm(sh: Shape, phase: str, name: str, key: str = "", region: bool = False,
          input_bytes: int = RESIDUAL_BYTES) -> list[Pointwise]:
    """A norm over the rows; forward, it keeps what :func:`norm_saved` counts (tensors ``key``.*)."""
    kind = "rmsnorm" if sh.spec.norm == "rmsnorm" else "layernorm"
    saves = norm_saved(sh.spec.norm, sh.rows, sh.spec.n_embd, key or name, region, input_bytes) if phase == "fwd" else ()
    return [Pointwise(kind, phase, sh.rows * sh.spec.n_embd, RESIDUAL_BYTES, name=name, saves=saves)]


def norm_saved(norm: str, rows: int, H: int, key: str, region: bool = False,
               input_bytes: int = RESIDUAL_BYTES) -> tuple[Saved, ...]:
    """What one norm keeps: LayerNorm its fp32 input and two fp32 statistics a row; RMSNorm its fp32 input,
    the normalised input and one fp32 root."""
    T = rows
    kept = [Saved(f"{key}.in", T * H * input_bytes, region)]
    if norm == "rmsnorm":
        return (*kept, Saved(f"{key}.normed", T * H * RESIDUAL_BYTES, region), Saved(f"{key}.rstd", T * 4, region))
    return (*kept, Saved(f"{key}.stats", T * 8, region))


# eager attention's batched products: no weight (not a W's, no bias, no gradient to accumulate)
BATCHED = ("scores", "mix")


def has_weight(op: Operator) -> bool:
    """Whether ``op`` is a product with a weight (not eager attention's batched ones)."""
    return isinstance(op, Product) and op.name not in BATCHED


def _projections(sh: Shape) -> list[tuple[str, int, int]]:
    """(name, k, n) of the attention's input products: a fused Q/K/V or three."""
    return attention_products(sh.spec)[:-1]


def _mlp(sh: Shape) -> list[tuple[str, int, int]]:
    return mlp_products(sh.spec)


def _attention(sh: Shape, phase: str) -> Attention:
    s, c, T = sh.spec, sh.dtype_bytes, sh.rows
    q = s.n_head * s.head_dim
    saves: tuple[Saved, ...] = ()
    if phase == "fwd":  # Q, its output (the output projection's input too), a log-sum-exp a query head,
        # K and V over the keys (repeated to every query head where the runtime hands them so: kv_repeat)
        kv = (q if s.kv_repeat else s.kv_heads * s.head_dim) * sh.sequences * sh.prefix * c
        saves = (Saved("q", T * q * c, True), Saved("attn.out", T * q * c, True),
                 Saved("lse", T * s.n_head * 4, True), Saved("k", kv, True), Saved("v", kv, True))
    return Attention(phase, sh.sequences * s.n_head, sh.tokens, sh.prefix, s.head_dim, s.causal, sh.dtype_bytes,
                     heads=s.n_head, saves=saves)


def _input_name(sh: Shape, name: str, shared: str) -> str:
    """The tensor a product keeps as its input: one shared name at full precision, its own cast at 16 bits."""
    return shared if sh.dtype_bytes >= 4 else f"{name}.in"


def attention_forward(sh: Shape) -> list[Operator]:
    """The attention sub-layer's forward: what ``selective`` recomputation reruns."""
    s, c, T = sh.spec, sh.dtype_bytes, sh.rows
    q, kv = s.n_head * s.head_dim, s.kv_heads * s.head_dim
    ops: list[Operator] = [Product("fwd", T, k, n, c, name=name,
                                   saves=(Saved(_input_name(sh, name, "attn.in"), T * k * c, True),))
                           for name, k, n in _projections(sh)]
    if s.position_embedding == "rotary":  # q and k rotated (x cos + rotate_half(x) sin, in fp32; its
        # tables, kept once a stage: transformer.stage_shared_saved)
        ops.append(Pointwise("rotary", "fwd", T * (q + kv), RESIDUAL_BYTES, name="rotary"))
    if s.attention == "eager":
        ops += _eager_scores(sh, "fwd")
    else:
        ops.append(_attention(sh, "fwd"))
    ops.append(Pointwise("copy", "fwd", T * q, c, name="merge heads"))
    name, k, n = attention_products(s)[-1]  # the output projection
    ops.append(Product("fwd", T, k, n, c, name=name, saves=(Saved("attn.out", T * q * c, True),)))
    return _biased(s, ops)


def _eager_scores(sh: Shape, phase: str) -> list[Operator]:
    """Eager attention's two batched products and fp32 softmax, with what they keep (Q, K and V repeated per
    head, the softmax output, dropout's mask)."""
    s, c = sh.spec, sh.dtype_bytes
    bh, x, p, d = sh.sequences * s.n_head, sh.tokens, sh.prefix, s.head_dim
    if phase != "fwd":
        scores = Pointwise("softmax", "bwd", bh * x * p, RESIDUAL_BYTES, name="softmax")
        return [Product("dgrad", x, p, d, c, count=bh, name="mix"), Product("wgrad", x, p, d, c, count=bh, name="mix"),
                scores, Product("dgrad", x, d, p, c, count=bh, name="scores"),
                Product("wgrad", x, d, p, c, count=bh, name="scores")]
    width = d if sh.sequences == 1 and s.kv_heads == 1 else s.n_head * d
    kv, pairs = sh.sequences * p * width * c, bh * x * p
    probs = [Saved("probs", pairs * c, True)]
    mixed = [Saved("probs.mask", pairs, True), Saved("probs.dropped", pairs * c, True)] if s.dropout_masks else probs
    return [Product("fwd", x, d, p, c, count=bh, name="scores",
                    saves=(Saved("q", sh.rows * s.n_head * d * c, True), Saved("k", kv, True))),
            Pointwise("softmax", "fwd", pairs, RESIDUAL_BYTES, name="softmax", saves=tuple(probs)),
            Product("fwd", x, p, d, c, count=bh, name="mix", saves=(*mixed, Saved("v", kv, True)))]


def _stream(sh: Shape, branch: str, region: bool) -> Pointwise:
    """The residual add closing a branch (with dropout, keeping the branch's mask)."""
    T, H = sh.rows, sh.spec.n_embd
    saves = (Saved(f"{branch}.dropout", T * H, region),) if sh.spec.dropout_masks else ()
    return Pointwise("add", "fwd", T * H, RESIDUAL_BYTES, name="residual", saves=saves)


def block_forward(sh: Shape) -> list[Operator]:
    """One block's forward operators (post-norm: the norms after the adds)."""
    s, c, T = sh.spec, sh.dtype_bytes, sh.rows
    post = s.post_norm
    attention = [*([] if post else _norm(sh, "fwd", "norm", "norm1")), *_cast(sh, T * s.n_embd, "fwd", "cast"),
                 *attention_forward(sh), _stream(sh, "attn", True),
                 *(_norm(sh, "fwd", "norm", "norm1", region=True) if post else [])]
    mlp: list[Operator] = [*([] if post else _norm(sh, "fwd", "norm", "norm2")), *_cast(sh, T * s.n_embd, "fwd", "cast")]
    ups = _mlp(sh)
    mlp += _biased(s, [Product("fwd", T, k, n, c, name=name, saves=(Saved(_input_name(sh, name, "mlp.in"), T * k * c),))
                       for name, k, n in ups[:-1]])
    width = s.ffn_width
    inner = (("gate.out", "gate.act", "up.out") if s.mlp == "gated" else ("act.in",))
    mlp.append(Pointwise("silu_mul" if s.mlp == "gated" else "gelu", "fwd", T * width, c, name="activation",
                         saves=tuple(Saved(t, T * width * c) for t in inner)))
    name, k, n = ups[-1]
    mlp += [*_biased(s, [Product("fwd", T, k, n, c, name=name, saves=(Saved(f"{name}.in", T * k * c),))]),
            _stream(sh, "mlp", False), *(_norm(sh, "fwd", "norm", "norm2") if post else [])]
    return attention + mlp


def _biased(s: TransformerSpec, ops: list[Operator]) -> list[Operator]:
    """``ops`` with each biased product's bias first written into its output (torch's CPU addmm)."""
    out: list[Operator] = []
    for op in ops:
        if has_weight(op) and _has_bias(s, op.name):
            out.append(Pointwise("bias", "fwd", op.m * op.n * op.count, op.dtype_bytes, name="bias"))
        out.append(op)
    return out


def block_input_backward(sh: Shape) -> list[Operator]:
    """One block's backward to its input (I's share of B)."""
    ops: list[Operator] = []
    for op in reversed(block_forward(sh)):
        if isinstance(op, Product):
            if not has_weight(op):
                continue  # eager attention's products: in _eager_scores' backward
            ops.append(replace(op, phase="dgrad"))
        elif isinstance(op, Attention):
            ops.append(replace(op, phase="bwd"))
        elif op.kind == "softmax":
            ops += _eager_scores(sh, "bwd")
        elif op.kind == "bias":
            continue  # its gradient is W's sum over the tokens
        else:  # (an add's backward: the stream's gradients from the branch and the skip, summed)
            ops.append(replace(op, phase="bwd"))
    return ops


def block_weight_backward(sh: Shape) -> list[Operator]:
    """One block's weight gradients (W's share of B), at 16 bits each cast and added into its fp32 gradient."""
    s, c, T = sh.spec, sh.dtype_bytes, sh.rows
    ops: list[Operator] = []
    for op in reversed(block_forward(sh)):
        if has_weight(op):
            ops.append(replace(op, phase="wgrad"))
            if _has_bias(s, op.name):
                ops.append(Pointwise("reduce", "bwd", T * op.n, c, name="bias"))
    products = [o for o in block_forward(sh) if has_weight(o)]
    matrices = sum(o.k * o.n for o in products)
    ops += _accumulate(matrices, len(products), layer_params(s) - matrices, block_tensors(s) - len(products), c)
    return ops


def _has_bias(s: TransformerSpec, name: str) -> bool:
    if name in ("qkv", "q", "k", "v"):
        return s.qkv_bias
    if name == "proj":
        return s.o_bias
    return s.mlp_bias


def _accumulate(matrices: int, matrix_tensors: int, rest: int, rest_tensors: int, c: int) -> list[Pointwise]:
    """The weights' gradients added into their fp32 gradients a tensor at a time (cast first at 16 bits)."""
    def each(total: int, n: int) -> int:
        return max(1, total // max(1, n))

    ops = [Pointwise("copy", "bwd", each(matrices, matrix_tensors), RESIDUAL_BYTES, count=matrix_tensors,
                     name="grad cast")] \
        if c < 4 else []
    n = matrix_tensors + rest_tensors
    return ops + [Pointwise("add", "bwd", each(matrices + rest, n), RESIDUAL_BYTES, count=n, name="grad accumulate")]


def recompute_forward(sh: Shape) -> list[Operator]:
    """What a block's backward reruns first (``full``: the block; ``selective``: the attention)."""
    if sh.spec.recompute == "full":
        return block_forward(sh)
    if sh.spec.recompute == "selective":
        return [*_cast(sh, sh.rows * sh.spec.n_embd, "fwd", "cast"), *attention_forward(sh)]
    return []


def embedding_forward(sh: Shape) -> list[Operator]:
    """The tables' lookups, with what they keep."""
    s, T, H = sh.spec, sh.rows, sh.spec.n_embd
    ids = (Saved("ids", T * 8), *((Saved("embedding.dropout", T * H),) if s.dropout_masks else ()))
    ops = [Pointwise("copy", "fwd", T * H, RESIDUAL_BYTES, name="token embedding", saves=ids)]
    if s.position_embedding == "learned":
        ops.append(Pointwise("add", "fwd", T * H, RESIDUAL_BYTES, name="positions",
                             saves=(Saved("positions", sh.tokens * 8),)))
    if s.post_norm:
        ops += _norm(sh, "fwd", "embedding norm")
    return ops


def embedding_backward(sh: Shape) -> list[Operator]:
    """The tables' dense gradients: zeroed, the tokens' rows added in, then accumulated."""
    s, T, H = sh.spec, sh.rows, sh.spec.n_embd
    table = embedding_params(s)
    ops = [*(_norm(sh, "bwd", "embedding norm") if s.post_norm else []),
           Pointwise("copy", "bwd", table, RESIDUAL_BYTES, name="embedding grad"),
           Pointwise("add", "bwd", T * H, RESIDUAL_BYTES, name="embedding rows")]
    tables = 1 + (s.position_embedding == "learned")
    return ops + [Pointwise("add", "bwd", table // tables, RESIDUAL_BYTES, count=tables, name="grad accumulate")]


def head_forward(sh: Shape) -> list[Operator]:
    """The final norm, the vocabulary product and the chunked loss, with what each keeps."""
    s, c, T, H, V = sh.spec, sh.dtype_bytes, sh.rows, sh.spec.n_embd, sh.spec.vocab_size
    ops: list[Operator] = []
    if s.post_norm:
        ops += [*_cast(sh, T * H, "fwd", "cast"),
                Product("fwd", T, H, H, c, name="transform", saves=(Saved("transform.in", T * H * c),)),
                Pointwise("gelu", "fwd", T * H, c, name="activation", saves=(Saved("transform.out", T * H * c),)),
                *_norm(sh, "fwd", "head norm", input_bytes=c)]
    else:
        ops += _norm(sh, "fwd", "final norm")
    ops += [*_cast(sh, T * H, "fwd", "cast"), Product("fwd", T, H, V, c, name="lm_head",
                                                      saves=(Saved("lm_head.in", T * H * c),))]
    if s.vocab_parallel:  # (a rank's cut: the parallel loss keeps an fp32 softmax, its targets and two masks)
        ops.append(Pointwise("copy", "fwd", T * V, c, name="logits to fp32") if c < 4 else None)
        ops.append(Loss("fwd", T, V, RESIDUAL_BYTES, saves=(Saved("softmax", T * V * 4), Saved("targets", T * 10))))
        return [o for o in ops if o is not None]
    # (the loss casts 16-bit logits as it reads them: its measured time holds the cast)
    # (a padded head, model.vocab_multiple: the loss reads the scored columns of logits as wide as the head's)
    ops.append(Loss("fwd", T, s.scored_vocab, c,
                    saves=(Saved("logits", T * V * c), Saved("lse", T * 4), Saved("targets", T * 8))))
    return ops


def head_input_backward(sh: Shape) -> list[Operator]:
    """The head's backward to its input, in the order the runtime launches it."""
    ops: list[Operator] = []
    for op in reversed(head_forward(sh)):
        if isinstance(op, Product):
            ops.append(replace(op, phase="dgrad"))
        else:
            ops.append(replace(op, phase="bwd"))
    return ops


def head_weight_backward(sh: Shape) -> list[Operator]:
    """The head's weight gradients, each added into its fp32 gradient (cast first at 16 bits)."""
    s, c, T = sh.spec, sh.dtype_bytes, sh.rows
    ops: list[Operator] = [replace(o, phase="wgrad") for o in reversed(head_forward(sh)) if isinstance(o, Product)]
    if s.post_norm:
        ops += [Pointwise("reduce", "bwd", T * s.n_embd, c, name="bias"),
                Pointwise("reduce", "bwd", T * s.vocab_size, c, name="bias")]
    products = [o for o in head_forward(sh) if isinstance(o, Product)]
    matrices = sum(o.k * o.n for o in products)
    others = 4 if s.post_norm else (1 if s.norm == "rmsnorm" else 2)  # the norms' (and biases') tensors
    return ops + _accumulate(matrices, len(products), head_params(s) - matrices, others, c)


def block_tensors(spec: TransformerSpec) -> int:
    """Parameter tensors of one block (the optimizer's per-tensor work)."""
    products = [name for name, _, _ in (*attention_products(spec), *mlp_products(spec))]
    norms = 2 * (1 if spec.norm == "rmsnorm" else 2)
    return len(products) + sum(_has_bias(spec, name) for name in products) + norms
