"""What a stage's AdamW step holds while it runs beside the weights, gradients and moments,
in the implementation ``optim.impl`` picks (:func:`step_impl`; docs/runtime.md, "The
optimizer step")."""

from __future__ import annotations

from typing import Callable

from .transformer import TransformerSpec, attention_products, mlp_products

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
    """Bytes an AdamW step in ``impl`` holds beside the state, over ``params`` fp32 parameters,
    ``sizes()`` giving the weight-decay group's tensors' elements in step order: fused,
    nothing; foreach, a denominator per parameter of the larger group; single,
    :func:`one_at_a_time_most`."""
    if impl == "fused":
        return 0.0
    if impl == "foreach":
        decayed = sum(sizes())
        return 4.0 * max(decayed, params - decayed)
    if impl == "single":
        return 4.0 * one_at_a_time_most(sizes())
    raise ValueError(f"no AdamW implementation {impl!r}; allowed: fused, foreach, single")


def decay_tensors(spec: TransformerSpec, layers: int, first: bool, last: bool) -> list[int]:
    """Elements of each matrix in a stage's weight-decay group, in the module's order: the
    embeddings (first stage), each block's attention and MLP matrices, then the head (a tied
    head's copy where the last stage is not the first; one stage of a tied model steps the
    embedding alone)."""
    H, V = spec.n_embd, spec.vocab_size
    out: list[int] = []
    if first:
        out.append(V * H)
        if spec.position_embedding == "learned":
            out.append(spec.positions * H)
        if spec.post_norm:
            out.append(2 * H)
    block = [k * n for _, k, n in (*attention_products(spec), *mlp_products(spec))]
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
