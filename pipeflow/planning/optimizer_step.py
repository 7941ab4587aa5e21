"""What a stage's optimizer step holds while it runs, beside the weights, gradients and
moments (torch's AdamW as :mod:`pipeflow.runtime.optimizer` builds it).

On an accelerator AdamW steps a parameter group at once (foreach): the square root of
every second moment into one new fp32 buffer, 4 bytes a parameter. On CPU it steps one
tensor at a time: each tensor's denominator is the square root of its second moment (a
new fp32 tensor) divided by the bias correction (another), and the previous tensor's
denominator is let go only when the next one's replaces it. So stepping tensor k holds
``2 s_k + s_{k-1}`` elements (measured: GPT-2 small's last stage steps its 50257 x 768
head beside the MLP down projection's denominator before it, 9 MiB the largest tensor's
two alone missed). The tensors come in the module's order, the two weight-decay groups
apart (:func:`pipeflow.runtime.optimizer.make_optimizer`: matrices, then biases and norms,
each group its own call), so the most is over the matrices in their order.
"""

from __future__ import annotations

from .transformer import TransformerSpec


def decay_tensors(spec: TransformerSpec, layers: int, first: bool, last: bool) -> list[int]:
    """Elements of each matrix a stage's optimizer steps in its weight-decay group, in the
    module's order: the embeddings (the first stage: tokens, a learned position table,
    BERT's two token types), each block's attention (a fused Q/K/V projection, or Q, K
    and V) and output projection, its MLP (gate, up and down, or in and out), then the
    head (BERT's transform before its decoder; a tied head's copy where the last stage
    is not the first; one stage of a tied model steps the embedding alone)."""
    H, I, V = spec.n_embd, spec.ffn_width, spec.vocab_size
    q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
    out: list[int] = []
    if first:
        out.append(V * H)
        if spec.position_embedding == "learned":
            out.append(spec.positions * H)
        if spec.post_norm:
            out.append(2 * H)
    attention = [H * (q + 2 * kv)] if spec.qkv_inputs == 1 else [H * q, H * kv, H * kv]
    block = [*attention, q * H, *[H * I] * spec.mlp_matrices]
    out.extend(block * layers)
    if last:
        if spec.post_norm:
            out.append(H * H)
        if not (first and spec.tied):
            out.append(V * H)
    return out


def one_at_a_time_most(sizes: list[int]) -> int:
    """The most elements a one-tensor-at-a-time AdamW holds over ``sizes`` in order: its
    two temporaries of a tensor beside the denominator of the one before."""
    most, before = 0, 0
    for n in sizes:
        most = max(most, 2 * n + before)
        before = n
    return most
