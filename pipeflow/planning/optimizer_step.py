"""What a stage's optimizer step holds while it runs, beside the weights, gradients and
moments (torch's AdamW as :mod:`pipeflow.runtime.optimizer` builds it, in the
implementation ``optim.impl`` picks: :func:`step_impl`).

Fused (the default where torch has the kernel: CPU and CUDA), one kernel updates each
tensor in place: nothing beside the state but its step counts (4 bytes a tensor). Foreach
steps a parameter group a list at a time: the square root of every second moment into
new fp32 buffers, 4 bytes a parameter of the group (the matrices' group is the
larger). A tensor at a time (single): each tensor's denominator is the square root of
its second moment (a new fp32 tensor) divided by the bias correction (another), and the
previous tensor's denominator is let go only when the next one's replaces it. So stepping tensor k holds
``2 s_k + s_{k-1}`` elements (measured: GPT-2 small's last stage steps its 50257 x 768
head beside the MLP down projection's denominator before it, 9 MiB the largest tensor's
two alone missed). The tensors come in the module's order, the two weight-decay groups
apart (:func:`pipeflow.runtime.optimizer.make_optimizer`: matrices, then biases and norms,
each group its own call), so the most is over the matrices in their order.
"""

from __future__ import annotations

from typing import Callable

from .transformer import TransformerSpec

IMPLS = ("auto", "fused", "foreach", "single")
FUSED_DEVICES = ("cpu", "cuda")  # where torch 2.x has the fused AdamW kernel (the ones pipeflow's ranks run on)


def step_impl(impl: str, device_type: str) -> str:
    """The AdamW implementation ``optim.impl`` means on a ``device_type`` ("cpu", "cuda"):
    ``auto`` is fused where torch has the kernel, else foreach (torch's default on an
    accelerator)."""
    if impl not in IMPLS:
        raise ValueError(f"optim.impl={impl}: allowed values: {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    return "fused" if device_type in FUSED_DEVICES else "foreach"


def step_workspace(impl: str, params: float, sizes: Callable[[], list]) -> float:
    """Bytes an AdamW step in ``impl`` holds beside the state, over ``params`` fp32
    parameters of which ``sizes()`` gives the weight-decay group's tensors' elements in
    the order the step takes them: fused, nothing (its step counts' few bytes left out);
    foreach, a denominator for each parameter of a group, one group at a time (the
    larger's); single, :func:`one_at_a_time_most`."""
    if impl == "fused":
        return 0.0
    if impl == "foreach":
        decayed = sum(sizes())
        return 4.0 * max(decayed, params - decayed)
    if impl == "single":
        return 4.0 * one_at_a_time_most(sizes())
    raise ValueError(f"no AdamW implementation {impl!r}; allowed: fused, foreach, single")


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
