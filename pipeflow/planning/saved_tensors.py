"""What forward operators keep for their backward (the activations) and what a zero-bubble I keeps for its W
(the residuals), in bytes, each tensor counted once by name."""

from __future__ import annotations

import functools
from typing import Iterable

from .layer_operators import block_forward, embedding_forward, has_weight, head_forward, norm_saved
from .operators import Operator, Product, Saved, Shape
from .transformer import RESIDUAL_BYTES, TransformerSpec


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
    """(bytes one block's forward keeps without recomputation, of which in the attention's region)."""
    tensors = kept(block_forward(sh)).values()
    return float(sum(t.nbytes for t in tensors)), float(sum(t.nbytes for t in tensors if t.region))


def _weight_products(ops: Iterable[Operator]) -> list[Product]:
    """The forward products of ``ops`` that have a weight (not eager attention's)."""
    return [o for o in ops if has_weight(o) and o.phase == "fwd"]


def weight_residual(ops: Iterable[Operator]) -> float:
    """Bytes a zero-bubble I keeps for its W of ``ops``: each weight product's input and its output's
    gradient, in the compute dtype."""
    products = _weight_products(ops)
    return saved_bytes(products) + float(sum(o.m * o.n * o.dtype_bytes * o.count for o in products))


@functools.lru_cache(maxsize=4096)  # (a search prices one shape for many candidates)
def block_residual(sh: Shape) -> float:
    """:func:`weight_residual` of one block."""
    return weight_residual(block_forward(sh))


@functools.lru_cache(maxsize=4096)  # (a search prices one shape for many candidates)
def head_residual(spec: TransformerSpec, tokens: int, microbatch_size: int, dtype_bytes: int) -> float:
    """:func:`weight_residual` of the head, for one microbatch."""
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
