"""Where Seq1F1B cuts a sequence into segments: ``uniform`` (equal lengths) or ``compute``
(equal forward FLOPs under causal attention, :func:`compute_split`: earlier segments longer;
a 7B-like model at S = 32768, s = 4 gives the paper's [11021, 8421, 7087, 6239])."""

from __future__ import annotations

import math
from typing import Sequence

from .transformer import TransformerSpec, attention_score_flops, layer_linear_flops

SPLITS = ("uniform", "compute")


def _check(strategy: str, seq_len: int, segments: int, spec: TransformerSpec | None) -> None:
    if strategy not in SPLITS:
        raise ValueError(f"schedule.split={strategy}: unknown sequence split; allowed values: {', '.join(SPLITS)}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"model.seq_len={seq_len!r}: must be a whole number >= 1")
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"pipeline.segments={segments!r}: must be a whole number >= 1")
    if segments > seq_len:
        raise ValueError(
            f"pipeline.segments={segments}: more segments than tokens in a sequence (model.seq_len={seq_len}); "
            f"use at most {seq_len}"
        )
    if segments > 1 and spec is not None and not spec.causal:
        raise ValueError(
            f"pipeline.segments={segments}: sequence segments need causal attention, and model '{spec.name}' "
            f"attends both ways (BERT); use pipeline.segments=1"
        )


def uniform_split(seq_len: int, segments: int) -> list[int]:
    """Equal lengths adding up to ``seq_len``; the first ``seq_len % segments`` get one more token."""
    base, extra = divmod(seq_len, segments)
    return [base + (1 if i < extra else 0) for i in range(segments)]


def segment_flop(spec: TransformerSpec, tokens: float, prefix: float) -> float:
    """Forward FLOPs of the whole model for the last ``tokens`` tokens of a ``prefix``-token
    prefix, one sequence: every layer's (:func:`pipeflow.planning.transformer.layer_forward_flops`)
    plus 4*x*H*V for the embedding and the output layer."""
    per_layer = attention_score_flops(spec, tokens, prefix) + layer_linear_flops(spec, tokens)
    return spec.n_layer * per_layer + 4.0 * tokens * spec.n_embd * spec.vocab_size


def segment_flops(lengths: Sequence[int], spec: TransformerSpec) -> list[float]:
    """FLOPs of each segment of a split (the FLOP model of :func:`segment_flop`); with causal
    attention they add up to the whole sequence's."""
    out, prefix = [], 0
    for x in lengths:
        prefix += x
        out.append(segment_flop(spec, x, prefix))
    return out


def compute_split(spec: TransformerSpec, seq_len: int, segments: int) -> list[int]:
    """Equal-FLOP lengths: the last segment is the x carrying 1/s of the sequence's FLOPs at
    P = S (the smaller root of a quadratic), then P shrinks by x and so on; each x rounded
    down, the first segment takes the rest."""
    # f(x, P) = A' * (x*P - x^2/2) + c*x, A' = L*h*(4d+3) (causal attention), c linear
    a = spec.n_layer * spec.n_head * (4 * spec.head_dim + 3)
    c = segment_flop(spec, 1, 1) - a * 0.5  # the linear part per token (f(1, 1) = a/2 + c)
    target = segment_flop(spec, seq_len, seq_len) / segments
    lengths: list[int] = []
    prefix = seq_len
    for done in range(segments - 1):
        # a/2 x^2 - (a*P + c) x + target = 0: the smaller root, written to avoid cancellation
        b = a * prefix + c
        disc = max(b * b - 2.0 * a * target, 0.0)
        x = 2.0 * target / (b + math.sqrt(disc))
        left = segments - done - 1  # segments still to cut from the rest, each >= 1 token
        xi = min(max(1, math.floor(x)), prefix - left)
        lengths.append(xi)
        prefix -= xi
    lengths.append(prefix)
    return lengths[::-1]


def split_sequence(strategy: str, seq_len: int, segments: int, spec: TransformerSpec | None = None,
                   multiple: int = 1) -> list[int]:
    """Token counts of the ``segments`` sequence segments of a ``seq_len``-token sequence, first
    to last: whole numbers >= 1 adding up to ``seq_len``. ``strategy``: ``uniform`` or
    ``compute`` (which needs ``spec``). ``multiple``: each segment a multiple of it where
    ``seq_len`` is one (:func:`granular`). ValueError naming ``schedule.split`` or
    ``pipeline.segments``."""
    _check(strategy, seq_len, segments, spec)
    if strategy == "uniform" or segments == 1:
        lengths = uniform_split(seq_len, segments)
    elif spec is None:
        raise ValueError("schedule.split=compute: the computation-wise split needs the model's shape (model.*)")
    else:
        lengths = compute_split(spec, seq_len, segments)
    return granular(lengths, multiple, strategy)


def granular(lengths: list[int], multiple: int, strategy: str = "uniform") -> list[int]:
    """``lengths`` as multiples of ``multiple`` adding up to the same: the first ones
    rounded to the nearest (one multiple at least), the last the rest. Unchanged where
    their sum is no multiple (the tensor-parallel check refuses that sequence)."""
    total = sum(lengths)
    if multiple <= 1 or total % multiple or all(x % multiple == 0 for x in lengths):
        return list(lengths)
    head = [max(multiple, multiple * round(x / multiple)) for x in lengths[:-1]]
    if total - sum(head) < multiple:
        raise ValueError(f"schedule.split={strategy}: {len(lengths)} segments of {total} tokens do not leave each "
                         f"a multiple of {multiple} tokens (pipeline.sequence_parallel); use fewer pipeline.segments")
    return head + [total - sum(head)]
