"""Where Seq1F1B cuts a sequence into segments (ALGORITHMS.md, "Seq1F1B").

- ``uniform``: equal lengths; the remainder goes to the first segments.
- ``compute``: equal FLOPs. With causal attention a later token attends to more keys,
  so equal lengths are not equal work. The FLOP model, for the last x tokens of a
  prefix of P tokens, summed over the model's L layers, plus the embedding and output:

      L * (x*P*h*(4d+3) - x^2*h*(4d+3)/2 + 8*x*H*h*d + 4*x*H*F) + 4*x*H*V

  (H hidden, h heads, d head dim, F FFN width, V vocabulary; the per-layer terms are
  :func:`pipeflow.planning.transformer.layer_forward_flops`). Split points are chosen
  from the end of the sequence backward: the last segment is the x that carries
  1/s of the whole sequence's FLOPs at P = S, a quadratic in x whose smaller root is
  the one inside the prefix; then P shrinks by x and the next segment is solved the
  same way. Each x is rounded down and the first segment takes the rest, so the
  lengths are whole numbers >= 1 that add up to S. Earlier segments come out longer;
  a 7B-like model at S = 32768, s = 4 gives [11021, 8421, 7087, 6239], the paper's.
"""

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
    prefix, one sequence: every layer (attention over the prefix, weight matmuls) plus
    4*x*H*V for the embedding and the output layer (the FLOP model of the split)."""
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
    """Equal-FLOP lengths, solved from the end of the sequence backward (module docstring)."""
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
    """Token counts of the ``segments`` sequence segments of a ``seq_len``-token sequence,
    first to last: whole numbers >= 1 adding up to ``seq_len``. ``strategy`` is
    ``uniform`` or ``compute`` (which needs the model's ``spec``). ``multiple``: each
    segment a multiple of this many tokens where ``seq_len`` is one (sequence
    parallelism cuts every segment into that many slices; :func:`granular`). Raises
    ValueError naming the key (``schedule.split``, ``pipeline.segments``)."""
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
