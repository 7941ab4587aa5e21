"""A stage's work as a typed list of operators: what a device profile
(:mod:`pipeflow.topology.device_profile`) prices one by one.

Each action of a schedule (F, B, I, W on a stage's layers for one microbatch's segment;
S, the stage's optimizer step) is the operators pipeflow's runtime launches for it:

- :class:`Product`: a matrix product ``x[m, k] @ W[n, k]^T`` in one of its three
  phases (``fwd``; ``dgrad``, the input's gradient ``g[m, n] @ W``; ``wgrad``, the
  weight's ``g^T @ x``), at a dtype;
- :class:`Attention`: the fused attention kernel (forward or backward) over
  ``batch_heads`` x ``queries`` x ``keys`` at a head dimension, causal or not;
- :class:`Pointwise`: a memory-bound operator of a class (``layernorm``, ``rmsnorm``,
  ``gelu``, ``silu_mul``, ``add``, ``copy``, ``rotary``, ``reduce``, ``softmax``) over
  ``elements`` of a dtype, forward or backward;
- :class:`Loss`: cross-entropy over ``tokens`` x ``vocab`` logits, forward or backward;
- :class:`Step`: the optimizer's step over ``params`` in ``tensors`` tensors, and the
  step's other passes over the gradients (the clip norm's sum and scale, the casts).

``count`` repeats an operator (a stage's blocks are one block's list, ``count`` times
the layers). FLOPs of the products and attention add up to the analytic cost's
(:func:`pipeflow.planning.transformer.layer_forward_flops` and the head's):
``tests/test_operators.py`` checks it for each family, recomputation and segments.

What the list follows: the family's block (pre- or post-norm, a fused or split Q/K/V,
a gated MLP, rotary positions, biases), recomputation (``full`` reruns the block's
forward in the backward, ``selective`` the attention's projections and scores),
Seq1F1B's segments (queries over a longer prefix of keys), tensor parallelism (the
rank's shard of the shape: :func:`pipeflow.planning.tensor_cost.shard_spec`) and the
precision (at 16 bits the stream and the norms stay fp32 and each product's input is
cast; each weight's 16-bit gradient is cast and added to its fp32 gradient).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Iterable

from .transformer import RESIDUAL_BYTES, TransformerSpec, embedding_params, head_params, layer_params

PHASES = ("fwd", "dgrad", "wgrad")
POINTWISE = ("layernorm", "rmsnorm", "gelu", "silu_mul", "add", "copy", "rotary", "reduce", "softmax", "bias")
# the operator classes a breakdown reports (docs/simulation.md, "Operators")
CLASSES = ("product", "attention", "norm", "pointwise", "loss", "optimizer", "host")


@dataclass(frozen=True)
class Saved:
    """A tensor a forward operator keeps for its backward: its name within one block
    (operators that keep one tensor name it alike, and it counts once: GPT's Q, K and V
    read one input), its bytes for the whole call, and whether it lies inside the
    attention's region, which ``selective`` recomputation reruns instead of keeping."""

    name: str
    nbytes: float
    region: bool = False


def _saves() -> tuple:
    # what an operator keeps for its backward: not part of what it costs (its price's key)
    return field(default=(), compare=False)


@dataclass(frozen=True)
class Product:
    phase: str  # fwd | dgrad | wgrad
    m: int  # rows of the input (tokens, or queries of a batched product)
    k: int  # the input's width
    n: int  # the output's width
    dtype_bytes: int
    count: int = 1
    name: str = ""
    saves: tuple[Saved, ...] = _saves()

    cls = "product"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"a product's phase is one of {', '.join(PHASES)}, not {self.phase!r}")

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


@dataclass(frozen=True)
class Attention:
    phase: str  # fwd | bwd
    batch_heads: int
    queries: int
    keys: int  # the prefix the queries attend over (queries == keys for a whole sequence)
    head_dim: int
    causal: bool
    dtype_bytes: int
    count: int = 1
    name: str = "attention"
    heads: int = 0  # of batch_heads, the heads of one sequence (0: unknown)
    saves: tuple[Saved, ...] = _saves()

    cls = "attention"

    @property
    def pairs(self) -> float:
        """Query-key pairs scored per head: a causal segment's queries see the prefix
        before them and the lower triangle of their own block."""
        x, p = float(self.queries), float(self.keys)
        return x * p - x * x / 2 if self.causal else x * p

    @property
    def flops(self) -> float:
        """Q K^T and A V (4 d FLOPs a pair), the backward 2.5 times the forward."""
        f = 4.0 * self.head_dim * self.pairs * self.batch_heads * self.count
        return f if self.phase == "fwd" else 2.5 * f


@dataclass(frozen=True)
class Pointwise:
    kind: str  # one of POINTWISE
    phase: str  # fwd | bwd
    elements: int
    dtype_bytes: int
    count: int = 1
    name: str = ""
    launches: int = 0  # kernels per operator; 0: as its kind launches (kernels())
    saves: tuple[Saved, ...] = _saves()

    def __post_init__(self) -> None:
        if self.kind not in POINTWISE or self.phase not in ("fwd", "bwd"):
            raise ValueError(f"a pointwise operator is one of {', '.join(POINTWISE)}, fwd or bwd; "
                             f"not {self.kind!r} {self.phase!r}")

    @property
    def cls(self) -> str:
        return "norm" if self.kind in ("layernorm", "rmsnorm") else "pointwise"

    flops = 0.0


@dataclass(frozen=True)
class Loss:
    phase: str  # fwd | bwd
    tokens: int
    vocab: int
    dtype_bytes: int
    count: int = 1
    name: str = "cross_entropy"
    saves: tuple[Saved, ...] = _saves()

    cls = "loss"
    flops = 0.0


CHUNK_ELEMENTS = 1 << 22  # the loss's fp32 chunk: at most 16 MiB (GPT-2's vocabulary: 83 rows; pipeflow.models.loss)


def chunk_rows(vocab: int) -> int:
    """Rows of ``vocab`` logits the loss (:mod:`pipeflow.models.loss`) takes at a time."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


@dataclass(frozen=True)
class Step:
    params: int
    tensors: int
    impl: str = "fused"  # torch's AdamW as the ranks run it (optim.impl): fused; foreach; single
    count: int = 1
    name: str = "adamw"

    cls = "optimizer"
    flops = 0.0


@dataclass(frozen=True)
class GradNorm:
    """The step's gradient norm for the clip, a tensor at a time (pipeflow.runtime.optimizer's
    square_sum: a batched product of each gradient's rows of 1,024 with themselves, summed
    in float64), then each gradient scaled by the clip."""

    params: int
    tensors: int
    count: int = 1
    name: str = "clip norm"

    cls = "optimizer"
    flops = 0.0


Operator = Product | Attention | Pointwise | Loss | Step | GradNorm


def times(ops: Iterable[Operator], n: int) -> list[Operator]:
    """``ops`` repeated ``n`` times (their counts multiplied)."""
    return [replace(o, count=o.count * n) for o in ops] if n != 1 else list(ops)


@dataclass(frozen=True)
class Shape:
    """What one action's operators depend on: the rank's model shape, the sequences of a
    microbatch, a segment of ``tokens`` ending a ``prefix``, the compute dtype."""

    spec: TransformerSpec
    sequences: int
    tokens: int
    prefix: int
    dtype_bytes: int

    @property
    def rows(self) -> int:  # tokens the products see
        return self.sequences * self.tokens


def _cast(sh: Shape, elements: int, phase: str, name: str) -> list[Pointwise]:
    """At 16 bits a product's fp32 input is cast (forward), its gradient cast back (backward)."""
    if sh.dtype_bytes >= 4:
        return []
    return [Pointwise("copy", phase, elements, RESIDUAL_BYTES, name=name)]


def _norm(sh: Shape, phase: str, name: str, key: str = "", region: bool = False,
          input_bytes: int = RESIDUAL_BYTES) -> list[Pointwise]:
    """A norm over the rows; forward, it keeps (as tensors ``key``.*) what
    :func:`norm_saved` counts, its input at ``input_bytes`` an element."""
    kind = "rmsnorm" if sh.spec.norm == "rmsnorm" else "layernorm"
    saves = norm_saved(sh.spec.norm, sh.rows, sh.spec.n_embd, key or name, region, input_bytes) if phase == "fwd" else ()
    return [Pointwise(kind, phase, sh.rows * sh.spec.n_embd, RESIDUAL_BYTES, name=name, saves=saves)]


def norm_saved(norm: str, rows: int, H: int, key: str, region: bool = False,
               input_bytes: int = RESIDUAL_BYTES) -> tuple[Saved, ...]:
    """What one norm keeps: LayerNorm (torch's kernel) its input (fp32: the stream) and
    two fp32 statistics a row; RMSNorm (transformers' Llama-style, written in Python) its
    fp32 input, the normalised input the weight multiplies and one fp32 reciprocal root."""
    T = rows
    kept = [Saved(f"{key}.in", T * H * input_bytes, region)]
    if norm == "rmsnorm":
        return (*kept, Saved(f"{key}.normed", T * H * RESIDUAL_BYTES, region), Saved(f"{key}.rstd", T * 4, region))
    return (*kept, Saved(f"{key}.stats", T * 8, region))


def _projections(sh: Shape) -> list[tuple[str, int, int]]:
    """(name, k, n) of the attention's input products: a fused Q/K/V or three."""
    s, H = sh.spec, sh.spec.n_embd
    q, kv = s.n_head * s.head_dim, s.kv_heads * s.head_dim
    return [("qkv", H, q + 2 * kv)] if s.qkv_inputs == 1 else [("q", H, q), ("k", H, kv), ("v", H, kv)]


def _mlp(sh: Shape) -> list[tuple[str, int, int]]:
    H, I = sh.spec.n_embd, sh.spec.ffn_width
    ups = [("gate", H, I), ("up", H, I)] if sh.spec.mlp == "gated" else [("fc1", H, I)]
    return [*ups, ("fc2", I, H)]


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
    """The tensor a product keeps as its input: at full precision the products of one
    input read (and keep) that one tensor; at 16 bits autocast casts it for each product."""
    return shared if sh.dtype_bytes >= 4 else f"{name}.in"


def attention_forward(sh: Shape) -> list[Operator]:
    """The attention sub-layer's forward from its (normed) input to its output
    projection's: what ``selective`` recomputation reruns."""
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
    ops.append(Product("fwd", T, q, s.n_embd, c, name="proj", saves=(Saved("attn.out", T * q * c, True),)))
    return _biased(s, ops)


def _eager_scores(sh: Shape, phase: str) -> list[Operator]:
    """Eager attention: two batched products and a softmax over the scores (fp32).
    Forward, the products keep Q, and K and V repeated to every query head (copies;
    views where one sequence over one key/value head allows), the softmax its output a
    pair of each head, and with dropout the mix keeps the dropout's mask and output."""
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
    """One block's forward operators (pre-norm; post-norm the norms follow the adds).
    Selective recomputation's region is the attention's operators, its dropout and, post-norm, its norm."""
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


def kept(ops: Iterable[Operator]) -> dict[str, Saved]:
    """The tensors ``ops`` keep for their backward, each once, by name."""
    out: dict[str, Saved] = {}
    for op in ops:
        if getattr(op, "phase", "") != "fwd":
            continue
        for t in op.saves:
            out.setdefault(t.name, t)
    return out


@functools.lru_cache(maxsize=4096)  # (a search prices one shape for many candidates)
def block_saved(sh: Shape) -> tuple[float, float]:
    """What one block's forward keeps for its backward without recomputation, and of that
    what lies inside the attention's region (selective recomputation's), for the whole
    microbatch: its operators' tensors (:class:`Saved`), each counted once."""
    tensors = kept(block_forward(sh)).values()
    return float(sum(t.nbytes for t in tensors)), float(sum(t.nbytes for t in tensors if t.region))


def _biased(s: TransformerSpec, ops: list[Operator]) -> list[Operator]:
    """``ops`` with each biased product's bias written into its output first (kind
    ``bias``: torch's CPU addmm copies the bias into every row before the product adds
    into them; on a GPU cuBLASLt adds it in the product's epilogue, and the profile
    prices it at nothing)."""
    out: list[Operator] = []
    for op in ops:
        if isinstance(op, Product) and op.name not in ("scores", "mix") and _has_bias(s, op.name):
            out.append(Pointwise("bias", "fwd", op.m * op.n * op.count, op.dtype_bytes, name="bias"))
        out.append(op)
    return out


def block_input_backward(sh: Shape) -> list[Operator]:
    """One block's backward to its input: each forward operator's input gradient, the
    stream's gradients summed where its two paths meet (I's share of B)."""
    ops: list[Operator] = []
    for op in reversed(block_forward(sh)):
        if isinstance(op, Product):
            if op.name in ("scores", "mix"):
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
    """One block's weight gradients (W's share of B): each product's ``wgrad``, a bias's
    sum over the tokens, and at 16 bits each weight's gradient cast and added to its
    fp32 gradient; a norm's weight (and bias) gradient comes with its input's."""
    s, c, T = sh.spec, sh.dtype_bytes, sh.rows
    ops: list[Operator] = []
    for op in reversed(block_forward(sh)):
        if isinstance(op, Product) and op.name not in ("scores", "mix", ""):
            ops.append(replace(op, phase="wgrad"))
            if _has_bias(s, op.name):
                ops.append(Pointwise("reduce", "bwd", T * op.n, c, name="bias"))
    products = [o for o in block_forward(sh) if isinstance(o, Product) and o.name not in ("scores", "mix")]
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
    """The weights' gradients added into their fp32 gradients, a tensor at a time; at 16
    bits the products' weight gradients are cast first."""
    def each(total: int, n: int) -> int:
        return max(1, total // max(1, n))

    ops = [Pointwise("copy", "bwd", each(matrices, matrix_tensors), RESIDUAL_BYTES, count=matrix_tensors,
                     name="grad cast")] \
        if c < 4 else []
    n = matrix_tensors + rest_tensors
    return ops + [Pointwise("add", "bwd", each(matrices + rest, n), RESIDUAL_BYTES, count=n, name="grad accumulate")]


def recompute_forward(sh: Shape) -> list[Operator]:
    """What a block's backward reruns first (model.recompute): ``full`` the whole block's
    forward; ``selective`` the attention's projections, scores and output projection
    from the region's input (cast again at 16 bits)."""
    if sh.spec.recompute == "full":
        return block_forward(sh)
    if sh.spec.recompute == "selective":
        return [*_cast(sh, sh.rows * sh.spec.n_embd, "fwd", "cast"), *attention_forward(sh)]
    return []


def embedding_forward(sh: Shape) -> list[Operator]:
    """The tables' lookups; they keep the token ids (int64), a learned table's position
    ids (one row for the microbatch), BERT's embedding norm and, with dropout, its mask."""
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
    """The final norm (BERT: the dense transform and its norm), the vocabulary's product
    and the loss (:mod:`pipeflow.models.loss`: chunked, its logits cast to fp32 a chunk at
    a time as it reads them at 16 bits). They keep the norm's, the head's input (in the
    compute dtype), the loss's logits (in the compute dtype), one fp32 log-sum-exp a
    token and its int64 targets; BERT's transform its input, its GeLU's input and its
    norm's, the norm's input in the compute dtype."""
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


def _weight_products(ops: Iterable[Operator]) -> list[Product]:
    """The forward products of ``ops`` that have a weight (not eager attention's)."""
    return [o for o in ops if isinstance(o, Product) and o.phase == "fwd" and o.name not in ("scores", "mix")]


def weight_residual(ops: Iterable[Operator]) -> float:
    """What a zero-bubble I keeps for its W of forward operators ``ops``: each weight
    product's input (each tensor once, as the forward kept it) and its output's gradient,
    in the compute dtype (GPT's block (3H + I) + (5H + I) a token: the zero-bubble
    paper's 32 b s H at 2 bytes)."""
    products = _weight_products(ops)
    return saved_bytes(products) + float(sum(o.m * o.n * o.dtype_bytes * o.count for o in products))


@functools.lru_cache(maxsize=4096)  # (a search prices one shape for many candidates)
def block_residual(sh: Shape) -> float:
    """:func:`weight_residual` of one block."""
    return weight_residual(block_forward(sh))


@functools.lru_cache(maxsize=4096)  # (a search prices one shape for many candidates)
def head_residual(spec: TransformerSpec, tokens: int, microbatch_size: int, dtype_bytes: int) -> float:
    """:func:`weight_residual` of the head (the LM head's input and the logits' gradient;
    BERT's transform's input and output gradient too), for one microbatch."""
    return weight_residual(head_forward(Shape(spec, microbatch_size, tokens, tokens, dtype_bytes)))


def norm_saved_bytes(spec: TransformerSpec) -> float:
    """Per token, what one norm of ``spec``'s keeps (:func:`norm_saved`)."""
    return _norm_token_bytes(spec.norm, spec.n_embd)


@functools.lru_cache(maxsize=64)
def _norm_token_bytes(norm: str, H: int) -> float:
    return float(sum(t.nbytes for t in norm_saved(norm, 1, H, "norm")))


def saved_bytes(ops: Iterable[Operator]) -> float:
    """What forward operators ``ops`` keep for their backward (:func:`kept`), in bytes."""
    return float(sum(t.nbytes for t in kept(ops).values()))


@functools.lru_cache(maxsize=4096)  # (a search prices one shape for many candidates)
def first_stage_saved(spec: TransformerSpec, tokens: int, microbatch_size: int) -> float:
    """What the embedding keeps for one microbatch (:func:`embedding_forward`)."""
    return saved_bytes(embedding_forward(Shape(spec, microbatch_size, tokens, tokens, RESIDUAL_BYTES)))


@functools.lru_cache(maxsize=4096)  # (a search prices one shape for many candidates)
def last_stage_saved(spec: TransformerSpec, tokens: int, microbatch_size: int, dtype_bytes: int) -> float:
    """What the head and the loss keep for one microbatch (:func:`head_forward`)."""
    return saved_bytes(head_forward(Shape(spec, microbatch_size, tokens, tokens, dtype_bytes)))


def head_input_backward(sh: Shape) -> list[Operator]:
    ops: list[Operator] = []
    for op in reversed(head_forward(sh)):
        if isinstance(op, Product):
            ops.append(replace(op, phase="dgrad"))
        else:
            ops.append(replace(op, phase="bwd"))
    return ops


def head_weight_backward(sh: Shape) -> list[Operator]:
    s, c, T = sh.spec, sh.dtype_bytes, sh.rows
    ops: list[Operator] = [replace(o, phase="wgrad") for o in reversed(head_forward(sh)) if isinstance(o, Product)]
    if s.post_norm:
        ops += [Pointwise("reduce", "bwd", T * s.n_embd, c, name="bias"),
                Pointwise("reduce", "bwd", T * s.vocab_size, c, name="bias")]
    products = [o for o in head_forward(sh) if isinstance(o, Product)]
    matrices = sum(o.k * o.n for o in products)
    others = 4 if s.post_norm else (1 if s.norm == "rmsnorm" else 2)  # the norms' (and biases') tensors
    return ops + _accumulate(matrices, len(products), head_params(s) - matrices, others, c)


@dataclass(frozen=True)
class StageOperators:
    """The operators of each action kind on a stage of ``layers`` blocks (first: the
    embedding; last: the head and the loss) for one segment (:class:`Shape`)."""

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
    """A stage's optimizer step (pipeflow.runtime.executor), a tensor at a time where the
    runtime goes so: the clip norm's sum over each gradient (its rows' batched product,
    to float64, summed, divided and added: five launches), each gradient scaled by the
    clip, AdamW, and at 16 bits the next step's casts of the ``matrices`` weights."""
    ops: list[Operator] = [GradNorm(params, tensors), Step(params, tensors, impl)]
    if dtype_bytes < 4:
        ops.append(Pointwise("copy", "fwd", max(1, matrices // max(1, matrix_tensors)), RESIDUAL_BYTES,
                             count=matrix_tensors, name="weight casts"))
    return ops


def kernels(op: Operator) -> int:
    """Kernels the host launches for one operator (before ``count``): a fused kernel is
    one; the compositions as pipeflow's models write them are more (Llama's RMSNorm
    as transformers writes it: cast, square, mean, add, rsqrt, two products, cast; the
    rotation of q or k: two products, a negation, a concatenation and a sum)."""
    if isinstance(op, Pointwise):
        if op.launches:
            return op.launches
        many = {"rmsnorm": 8, "rotary": 10, "softmax": 1}
        base = many.get(op.kind, 1)
        return base * 2 if op.phase == "bwd" and op.kind in ("rmsnorm", "rotary", "layernorm") else base
    if isinstance(op, Attention):
        return 1 if op.phase == "fwd" else 2
    if isinstance(op, (Step, GradNorm)):
        return 0  # its measured time holds its own launches
    return 1


def block_tensors(spec: TransformerSpec) -> int:
    """Parameter tensors of one block (weights, biases, norms): the optimizer's per-tensor work."""
    projections = 1 if spec.qkv_inputs == 1 else 3
    biases = (projections if spec.qkv_bias else 0) + int(spec.o_bias) + (spec.mlp_matrices if spec.mlp_bias else 0)
    norms = 2 * (1 if spec.norm == "rmsnorm" else 2)
    return projections + 1 + spec.mlp_matrices + biases + norms
