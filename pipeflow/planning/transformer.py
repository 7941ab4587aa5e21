"""FLOP and parameter counts of a GPT/BERT-style transformer, for the analytic cost model.

Notation: H hidden size (n_embd), h heads, d = H/h head dim, Fw FFN width (n_inner,
default 4H), V vocabulary, S sequence length, x tokens of a segment, P its prefix
length (the segment's own tokens included).

FLOP model, one layer, one sequence (a multiply-add is 2 FLOPs), forward of the LAST x
tokens of a prefix of length P — the per-layer model of the Seq1F1B paper:

    causal:      x*P*h*(4d+3) - x^2*h*(4d+3)/2 + 8*x*H*h*d + 4*x*H*Fw
    non-causal:  x*P*h*(4d+3)                   + 8*x*H*h*d + 4*x*H*Fw

8xHhd is the Q, K, V and output projections, 4xHFw the two FFN matmuls: these are the
weight matmuls. The x*P*h*(4d+3) term is attention: Q K^T and A V (2d multiply-adds
per query-key pair, 4d FLOPs) plus about 3 FLOPs per pair for scale, mask and
softmax; causal attention only visits the keys at or before each query, which the
x^2/2 term removes (the continuous count, so segment FLOPs add up exactly to the
whole sequence's). With x = P = S, non-causal, Fw = 4H and the +3 dropped, this is
Megatron's 24*S*H^2 + 4*S^2*H.

LM head forward: 2*x*H*V (its matmul). Backward = 2 x forward; its weight-gradient
part (W, zero-bubble split) equals the forward FLOPs of the weight matmuls, and the
input-gradient part I = backward - W.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..families import FAMILIES, family_of


@dataclass(frozen=True)
class TransformerSpec:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    seq_len: int
    n_inner: int | None = None  # FFN width, default 4*n_embd
    n_positions: int | None = None  # learned position table size, default seq_len
    causal: bool = True  # GPT causal, BERT not
    recompute: str = "none"  # model.recompute: none | full | selective (the analytic cost prices it)

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "full", "selective"):
            raise ValueError(f"model.recompute={self.recompute}: allowed values: none, full, selective")
        for key in ("n_layer", "n_head", "n_embd", "vocab_size", "seq_len"):
            _positive_int(key, getattr(self, key))
        for key in ("n_inner", "n_positions"):
            if getattr(self, key) is not None:
                _positive_int(key, getattr(self, key))
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd}: must be a multiple of model.n_head={self.n_head} "
                f"(each head gets n_embd/n_head dimensions)"
            )
        if self.n_positions is not None and self.seq_len > self.n_positions:
            raise ValueError(
                f"model.seq_len={self.seq_len}: longer than model.n_positions={self.n_positions}; "
                f"use a seq_len <= {self.n_positions} or raise n_positions"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_width(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def positions(self) -> int:
        return self.n_positions if self.n_positions is not None else self.seq_len

    @staticmethod
    def from_config(cfg: Mapping) -> "TransformerSpec":
        """Read the ``model`` config group; unknown keys (dropout, init, ...) are ignored.

        ``seq_len`` falls back to ``n_positions`` when absent; the family
        (:mod:`pipeflow.families`, default gpt) decides causal attention.
        """
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
        return TransformerSpec(
            name=str(get("name") or family),
            n_layer=get("n_layer"),
            n_head=get("n_head"),
            n_embd=get("n_embd"),
            vocab_size=get("vocab_size"),
            seq_len=seq_len,
            n_inner=get("n_inner"),
            n_positions=get("n_positions"),
            causal=fam.causal,
            recompute=str(get("recompute") or "none"),
        )


def _positive_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{key}={value!r}: must be a whole number >= 1")


# --------------------------------------------------------------------- FLOPs


def attention_score_flops(spec: TransformerSpec, tokens: int, prefix: int) -> float:
    """The part of a layer's forward that has no weights: Q K^T, softmax, A V."""
    x, P = float(tokens), float(prefix)
    per_pair = spec.n_head * (4 * spec.head_dim + 3)
    if spec.causal:
        return x * P * per_pair - x * x * per_pair / 2
    return x * P * per_pair


def layer_linear_flops(spec: TransformerSpec, tokens: int) -> float:
    """Forward FLOPs of one layer's weight matmuls (QKV, output projection, FFN) for ``tokens`` tokens."""
    x, H = float(tokens), spec.n_embd
    return 8 * x * H * spec.n_head * spec.head_dim + 4 * x * H * spec.ffn_width


def layer_forward_flops(spec: TransformerSpec, tokens: int, prefix: int) -> float:
    """Forward FLOPs of one layer for the last ``tokens`` tokens of a prefix of ``prefix`` tokens
    (``prefix == tokens`` for a whole sequence). See the module docstring for the model."""
    if not 0 < tokens <= prefix:
        raise ValueError(f"a segment of {tokens} tokens cannot end a prefix of {prefix} tokens")
    return attention_score_flops(spec, tokens, prefix) + layer_linear_flops(spec, tokens)


def head_forward_flops(spec: TransformerSpec, tokens: int) -> float:
    """LM head (output projection to the vocabulary) forward FLOPs for ``tokens`` tokens."""
    return 2.0 * tokens * spec.n_embd * spec.vocab_size


# ---------------------------------------------------------------- parameters


def layer_params(spec: TransformerSpec) -> int:
    """One GPT-2/BERT block: QKV and output projection, two FFN matmuls (all with
    biases) and two LayerNorms: 4H^2 + 2H*Fw + 9H + Fw."""
    H, Fw = spec.n_embd, spec.ffn_width
    attn = 3 * H * H + 3 * H + H * H + H
    ffn = H * Fw + Fw + Fw * H + H
    norms = 4 * H
    return attn + ffn + norms


def embedding_params(spec: TransformerSpec) -> int:
    """Token embedding plus learned position embedding."""
    return spec.vocab_size * spec.n_embd + spec.positions * spec.n_embd


def head_params(spec: TransformerSpec) -> int:
    """Final LayerNorm plus the LM head matrix.

    The head is tied to the token embedding (GPT-2, BERT), so it adds nothing to the
    model's unique count; but when the last stage is not the first, the last stage
    keeps its own copy of the tied matrix (and its gradient, which is reduced with
    the embedding's), so per stage it is counted where the copy lives.
    """
    return 2 * spec.n_embd + spec.vocab_size * spec.n_embd


def total_params(spec: TransformerSpec) -> int:
    """Unique parameters of the whole model (tied head counted once)."""
    return spec.n_layer * layer_params(spec) + embedding_params(spec) + 2 * spec.n_embd
