"""FLOP, parameter and activation-width counts of a transformer stack (GPT-2/BERT blocks and the Hugging
Face decoders: grouped-query attention, gated MLP, RMSNorm, rotary positions, untied head), for the
analytic cost model. docs/planning.md ("What a stage costs") derives every count and names the symbols
(H, h, kv, d, I, V, x, P)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..families import FAMILIES, family_of

MLPS = ("gelu", "gated")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")


@dataclass(frozen=True)
class TransformerSpec:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    seq_len: int
    n_inner: int | None = None  # MLP width, default 4*n_embd
    n_positions: int | None = None  # position table size (model.n_positions), default seq_len
    causal: bool = True  # GPT causal, BERT not
    recompute: str = "none"  # model.recompute: none | full | selective (the analytic cost prices it)
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    head_dim_override: int | None = None  # model.head_dim; None: n_embd // n_head
    mlp: str = "gelu"  # gelu: two matrices; gated: gate, up and down (SwiGLU)
    norm: str = "layernorm"  # layernorm: weight and bias; rmsnorm: weight only
    qkv_bias: bool = True
    o_bias: bool = True
    mlp_bias: bool = True
    tied: bool = True  # the LM head shares the token embedding
    position_embedding: str = "learned"  # model.positions: learned (a table) | rotary (no parameters)
    dropout_masks: bool = False  # whether the forward keeps 1-byte dropout masks (model.dropout > 0)
    attention: str = "sdpa"  # model.attention: sdpa (fused: no score is kept) | eager (the scores are kept)
    # the fused kernel is handed K and V repeated to every query head, and keeps those
    # copies: grouped-query attention at fp32 on CUDA (pipeflow.models.attention), where
    # torch's memory-efficient kernel takes no key/value groups (kv_repeat_on)
    kv_repeat: bool = False
    post_norm: bool = False  # BERT: each sub-layer ends with its norm (GPT and the decoders: pre-norm)
    weights_in_out: bool = False  # GPT-2's Conv1D: weights [in, out] (nn.Linear [out, in]); products' scratch
    # matrix products that read the attention's input: 1 (GPT's fused c_attn) or 3 (separate
    # Q, K and V: BERT, Llama-style decoders); at 16 bits each saves its own autocast copy
    qkv_inputs: int = 1
    # a tensor rank's cut of the vocabulary: the loss is the parallel cross-entropy
    # (pipeflow.models.tensor_parallel), which keeps an fp32 softmax of its logits
    vocab_parallel: bool = False
    hf_keys: bool = False  # the model's keys are a Hugging Face config's (model.hf.*): refusals name those
    # the vocabulary the loss scores where the embedding and the head are padded past it
    # (model.vocab_multiple: vocab_size is then the padded width their products run at);
    # None: vocab_size, unpadded
    loss_vocab: int | None = None
    # model.family: a CPU device profile prices its host time per block by family; not part of
    # the shape (two specs of one shape are equal whichever family named them)
    family: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "full", "selective"):
            raise ValueError(f"model.recompute={self.recompute}: allowed values: none, full, selective")
        for key, value, allowed in (("mlp", self.mlp, MLPS), ("norm", self.norm, NORMS),
                                    ("positions", self.position_embedding, POSITIONS)):
            if value not in allowed:
                raise ValueError(f"model.{key}={value}: allowed values: {', '.join(allowed)}")
        if self.qkv_inputs not in (1, 3):
            raise ValueError(f"model.qkv_inputs={self.qkv_inputs!r}: allowed values: 1 (a fused Q/K/V projection), 3")
        if self.attention not in ATTENTION:
            raise ValueError(f"model.attention={self.attention}: allowed values: {', '.join(ATTENTION)}")
        for key in ("qkv_bias", "o_bias", "mlp_bias", "tied", "dropout_masks", "post_norm"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"model.{key}={getattr(self, key)!r}: allowed values: true, false")
        for key in ("n_layer", "n_head", "n_embd", "vocab_size", "seq_len"):
            _positive_int(key, getattr(self, key))
        for key, value in (("n_inner", self.n_inner), ("n_positions", self.n_positions),
                           ("n_kv_head", self.n_kv_head), ("head_dim", self.head_dim_override)):
            if value is not None:
                _positive_int(key, value)
        if self.head_dim_override is None and self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd={self.n_embd}: must be a multiple of model.n_head={self.n_head} (each head "
                             f"gets n_embd/n_head dimensions)" + (", or set model.hf.head_dim" if self.hf_keys else ""))
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_kv_head={self.n_kv_head}: must divide model.n_head={self.n_head} "
                             f"(each key/value head serves a whole group of query heads)")
        if self.n_positions is not None and self.seq_len > self.n_positions:
            raise ValueError(
                f"model.seq_len={self.seq_len}: longer than the model's {self.n_positions} positions (model.hf."
                f"max_position_embeddings; GPT-2's model.hf.n_positions); use a seq_len <= {self.n_positions} or "
                f"raise that key" if self.hf_keys else f"model.seq_len={self.seq_len}: longer than model.n_positions="
                f"{self.n_positions}; use a seq_len <= {self.n_positions} or raise model.n_positions"
            )

    @property
    def head_dim(self) -> int:
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.n_embd // self.n_head

    @property
    def scored_vocab(self) -> int:
        """The logits the loss reads of each token's ``vocab_size`` (the rest are padding)."""
        return self.loss_vocab if self.loss_vocab is not None else self.vocab_size

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def ffn_width(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def positions(self) -> int:
        """Position table size (rows of the learned table; the context length when rotary)."""
        return self.n_positions if self.n_positions is not None else self.seq_len

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "gated" else 2

    @staticmethod
    def from_config(cfg: Mapping) -> "TransformerSpec":
        """The ``model`` config group's shape (unknown keys ignored; ``seq_len`` defaults to
        ``n_positions``; absent decoder keys take GPT/BERT values). ValueError for a missing or bad key,
        or a family that is not one transformer stack."""
        get = cfg.get
        fam = family_of(cfg)
        if not fam.transformer:
            shaped = ", ".join(f.name for f in FAMILIES.values() if f.transformer)
            raise ValueError(f"model.family={fam.name}: not one transformer stack (its cost is per branch); "
                             f"allowed values: {shaped}")
        family = fam.name
        for key in ("n_layer", "n_head", "n_embd", "vocab_size"):
            if get(key) is None:
                raise ValueError(f"model.{key} is missing: the cost model needs it (a whole number >= 1)")
        seq_len = get("seq_len")
        if seq_len is None:
            seq_len = get("n_positions")
        if seq_len is None:
            raise ValueError(
                "model.seq_len is missing (and no model.n_positions to default to): set a whole number >= 1"
            )
        shape = {}
        for key, field in (("n_kv_head", "n_kv_head"), ("head_dim", "head_dim_override"), ("mlp", "mlp"),
                           ("norm", "norm"), ("qkv_bias", "qkv_bias"), ("o_bias", "o_bias"),
                           ("mlp_bias", "mlp_bias"), ("tied", "tied"), ("positions", "position_embedding")):
            if get(key) is not None:
                shape[field] = get(key)
        shape["dropout_masks"] = float(get("dropout") or 0.0) > 0
        padded = padded_vocab(get("vocab_size"), get("vocab_multiple"))
        shape["qkv_inputs"] = int(get("qkv_inputs") or (1 if family == "gpt" else 3))
        return TransformerSpec(
            name=str(get("name") or family),
            n_layer=get("n_layer"),
            n_head=get("n_head"),
            n_embd=get("n_embd"),
            vocab_size=padded,
            loss_vocab=get("vocab_size") if padded != get("vocab_size") else None,
            seq_len=seq_len,
            n_inner=get("n_inner"),
            n_positions=get("n_positions"),
            causal=fam.causal,
            recompute=str(get("recompute") or "none"),
            attention=str(get("attention") or "sdpa"),
            post_norm=family == "bert",
            weights_in_out=family == "gpt",
            hf_keys=family == "hf_causal",
            family=family,
            **shape,
        )


def padded_vocab(vocab: int, multiple) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (model.vocab_multiple; None: unpadded)."""
    if multiple is None:
        return vocab
    _positive_int("vocab_multiple", multiple)
    return -(-vocab // multiple) * multiple if isinstance(vocab, int) and not isinstance(vocab, bool) else vocab


def _positive_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{key}={value!r}: must be a whole number >= 1")


# --------------------------------------------------------------------- FLOPs

# The analytic count's scale, mask and softmax of a query-key pair (the operator lists
# have the softmax as a pointwise operator, no FLOPs)
SOFTMAX_FLOPS = 3


def attention_products(spec: TransformerSpec) -> list[tuple[str, int, int]]:
    """(name, k, n) of the attention's weight products: input projections, then the output one."""
    H, q, kv = spec.n_embd, spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
    inputs = [("qkv", H, q + 2 * kv)] if spec.qkv_inputs == 1 else [("q", H, q), ("k", H, kv), ("v", H, kv)]
    return [*inputs, ("proj", q, H)]


def mlp_products(spec: TransformerSpec) -> list[tuple[str, int, int]]:
    """(name, k, n) of the MLP's products: gate and up (or FC1), then down (FC2)."""
    H, I = spec.n_embd, spec.ffn_width
    ups = [("gate", H, I), ("up", H, I)] if spec.mlp == "gated" else [("fc1", H, I)]
    return [*ups, ("fc2", I, H)]


def product_flops(rows: int, k: int, n: int) -> float:
    """FLOPs of a product of a [rows, k] input with a k x n weight (a multiply-add is 2)."""
    return 2.0 * rows * k * n


def attention_pairs(queries: int, keys: int, causal: bool) -> float:
    """Query-key pairs a head scores for ``queries`` ending a prefix of ``keys`` (causal: continuous)."""
    x, P = float(queries), float(keys)
    return x * P - x * x / 2 if causal else x * P


def pair_flops(head_dim: int) -> int:
    """FLOPs of Q K^T and A V for one query-key pair of a head (2d multiply-adds)."""
    return 4 * head_dim


def attention_score_flops(spec: TransformerSpec, tokens: int, prefix: int) -> float:
    """The part of a layer's forward that has no weights: Q K^T, softmax, A V (per query head)."""
    return attention_pairs(tokens, prefix, spec.causal) * (spec.n_head * (pair_flops(spec.head_dim) + SOFTMAX_FLOPS))


def attention_linear_flops(spec: TransformerSpec, tokens: int) -> float:
    """Forward FLOPs of the attention's weight matmuls: Q, K, V and the output projection."""
    return sum(product_flops(tokens, k, n) for _, k, n in attention_products(spec))


def layer_linear_flops(spec: TransformerSpec, tokens: int) -> float:
    """Forward FLOPs of one layer's weight matmuls (Q, K, V, output projection, MLP) for ``tokens`` tokens."""
    return attention_linear_flops(spec, tokens) + sum(product_flops(tokens, k, n) for _, k, n in mlp_products(spec))


def layer_forward_flops(spec: TransformerSpec, tokens: int, prefix: int) -> float:
    """Forward FLOPs of one layer for the last ``tokens`` of a ``prefix`` (docs/planning.md, "FLOPs");
    ValueError where they cannot end it."""
    if not 0 < tokens <= prefix:
        raise ValueError(f"a segment of {tokens} tokens cannot end a prefix of {prefix} tokens")
    return attention_score_flops(spec, tokens, prefix) + layer_linear_flops(spec, tokens)


def head_forward_flops(spec: TransformerSpec, tokens: int) -> float:
    """LM head (output projection to the vocabulary) forward FLOPs for ``tokens`` tokens."""
    return product_flops(tokens, spec.n_embd, spec.vocab_size)


# ---------------------------------------------------------------- parameters


def norm_params(spec: TransformerSpec) -> int:
    """One norm: a weight (RMSNorm), or a weight and a bias (LayerNorm)."""
    return spec.n_embd * (1 if spec.norm == "rmsnorm" else 2)


def layer_params(spec: TransformerSpec) -> int:
    """One block's parameters: projections, MLP matrices, their biases where present, two norms."""
    H, I = spec.n_embd, spec.ffn_width
    q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
    attn = sum(k * n for _, k, n in attention_products(spec))
    if spec.qkv_bias:
        attn += q + 2 * kv
    if spec.o_bias:
        attn += H
    mlp = sum(k * n for _, k, n in mlp_products(spec))
    if spec.mlp_bias:
        mlp += (spec.mlp_matrices - 1) * I + H  # gate and up (or FC1) biases of width I, down (FC2) of H
    return attn + mlp + 2 * norm_params(spec)


def layer_matrix_params(spec: TransformerSpec) -> int:
    """One block's matrix-product weights (what autocast casts): no biases, no norms."""
    return sum(k * n for _, k, n in (*attention_products(spec), *mlp_products(spec)))


def recomputed_matrix_params(spec: TransformerSpec) -> int:
    """Of :func:`layer_matrix_params`, those model.recompute reruns (and casts anew)."""
    if spec.recompute == "full":
        return layer_matrix_params(spec)
    if spec.recompute == "selective":
        return sum(k * n for _, k, n in attention_products(spec))
    return 0


def embedding_params(spec: TransformerSpec) -> int:
    """Token embedding, plus the learned position table (none with rotary positions)."""
    n = spec.vocab_size * spec.n_embd
    if spec.position_embedding == "learned":
        n += spec.positions * spec.n_embd
    if spec.post_norm:  # BERT: two token-type rows and the embedding's LayerNorm
        n += 2 * spec.n_embd + norm_params(spec)
    return n


def head_params(spec: TransformerSpec) -> int:
    """The last stage's own parameters beyond its blocks: final norm and LM head V*H (BERT: its MLM head). A
    tied head is counted where its copy lives (see :func:`shared_head_params`)."""
    if spec.post_norm:  # BERT's MLM head: a dense transform, its LayerNorm, the decoder and its bias
        H = spec.n_embd
        return H * H + H + norm_params(spec) + spec.vocab_size * H + spec.vocab_size
    return norm_params(spec) + spec.vocab_size * spec.n_embd


def shared_head_params(spec: TransformerSpec) -> int:
    """The tied matrix V*H a stage holding both embedding and head counts twice (0 untied)."""
    return spec.vocab_size * spec.n_embd if spec.tied else 0


def stage_params(spec: TransformerSpec, layers: int, first: bool, last: bool) -> int:
    """Parameters of a stage of ``layers`` blocks (the embedding when ``first``, the head when ``last``)."""
    n = layers * layer_params(spec)
    if first:
        n += embedding_params(spec)
    if last:
        n += head_params(spec)
        if first:
            n -= shared_head_params(spec)
    return n


def total_params(spec: TransformerSpec) -> int:
    """Unique parameters of the whole model (a tied head counted once)."""
    return stage_params(spec, spec.n_layer, True, True)


# ------------------------------------------------------- activation widths

# The stream, the norms' internals and the statistics they keep are fp32 in
# pipeflow's runtime whatever its precision says: it keeps fp32 weights and casts
# to the compute dtype under autocast only where a matrix product takes them.
RESIDUAL_BYTES = 4
ATTENTION = ("sdpa", "eager")


def segment_own_kv(spec: TransformerSpec, tokens: int, prefix: int, microbatch_size: int, dtype_bytes: int) -> float:
    """Bytes per sequence one layer of a segmented run holds of a segment's own keys and values for later
    segments, on top of what its attention keeps."""
    x, dt = tokens, dtype_bytes
    kv = spec.kv_heads * spec.head_dim
    eager_copies = spec.attention == "eager" and (microbatch_size > 1 or 1 < spec.kv_heads < spec.n_head)
    recomputed = spec.recompute in ("selective", "full")
    if eager_copies or prefix > x or recomputed:
        own = (own_key_bytes(spec, dt) + dt) * kv
        if recomputed and spec.qkv_inputs == 1:
            own += spec.n_head * spec.head_dim * dt
        return float(x * own)
    kb = own_key_bytes(spec, dt)
    return float(x * kv * kb) if kb != dt else 0.0


def matrix_inputs(spec: TransformerSpec, dtype_bytes: int) -> tuple[int, int]:
    """(attention input copies, MLP input copies) the products keep: at 16 bits one per product."""
    if dtype_bytes >= 4:
        return 1, 1
    return spec.qkv_inputs, 2 if spec.mlp == "gated" else 1


def stage_shared_saved(spec: TransformerSpec, tokens: int) -> float:
    """Bytes every stage with layers keeps once per microbatch: rotary cos/sin tables (fp32)."""
    if spec.position_embedding != "rotary":
        return 0.0
    return 2.0 * tokens * spec.head_dim * RESIDUAL_BYTES


def arrived_input_saved(spec: TransformerSpec, tokens: int, microbatch_size: int, dtype_bytes: int) -> float:
    """Bytes a later stage keeps of its fp32 input beyond its blocks' (post-norm, 16 bits, no recompute)."""
    if spec.post_norm and dtype_bytes < 4 and spec.recompute == "none":
        return float(tokens * microbatch_size * spec.n_embd * RESIDUAL_BYTES)
    return 0.0


def own_key_bytes(spec: TransformerSpec, dtype_bytes: int) -> int:
    """Bytes per element of the keys a segment hands later segments."""
    return RESIDUAL_BYTES if spec.position_embedding == "rotary" else dtype_bytes


def kv_repeat_on(spec: TransformerSpec, dtype_bytes: int, gpu: bool) -> bool:
    """Whether the fused kernel gets K and V repeated per query head (:attr:`TransformerSpec.kv_repeat`)."""
    return gpu and dtype_bytes >= 4 and spec.attention == "sdpa" and spec.kv_heads < spec.n_head
