"""The operators an action is made of, as typed records a device profile prices one by one (products,
attention, pointwise, loss, the optimizer's step and clip norm), each with its FLOPs and what it keeps
for its backward (:class:`Saved`); ``count`` repeats one."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

from ..topology.elementwise_kernels import ELEMENTWISE
from .transformer import TransformerSpec, attention_pairs, pair_flops, product_flops

PHASES = ("fwd", "dgrad", "wgrad")
# the operator classes a breakdown reports (docs/simulation.md, "Operators")
CLASSES = ("product", "attention", "norm", "pointwise", "loss", "optimizer", "host")


@dataclass(frozen=True)
class PointwiseKind:
    """How a device profile prices one kind of :class:`Pointwise` operator: by the swept kernel ``swept``
    (:data:`~pipeflow.topology.elementwise_kernels.ELEMENTWISE`) over ``passes`` of its elements, its
    backward by that kernel's backward (``backward``) or its forward again; the kernels the host launches
    for one, forward and backward; its class in a breakdown; ``epilogue``: free on a GPU. ValueError for
    a class or kernel there is none of."""

    cls: str
    swept: str
    passes: float = 1.0
    backward: bool = False
    kernels: tuple[int, int] = (1, 1)
    epilogue: bool = False

    def __post_init__(self) -> None:
        if self.cls not in CLASSES or self.swept not in ELEMENTWISE:
            raise ValueError(f"a pointwise kind's class is one of {', '.join(CLASSES)} and its kernel one the "
                             f"sweep times ({', '.join(ELEMENTWISE)}); not {self.cls!r}, {self.swept!r}")


# Every pointwise kind, declared once. Kinds the sweep does not time are priced as a swept
# one over as many passes: the rotation (two products, a negation, a concatenation, a sum:
# about five adds' traffic; 10 kernels as pipeflow's models write it), a bias's or a norm's
# sum over tokens (one read: half a copy), softmax (a norm's passes), a product's bias
# written into its output (an add's pass: a strided read and a write, not the swept copy's
# memcpy; a GPU's product adds it in its epilogue, cuBLASLt). A cast, an add of gradients
# or a sum is its forward kernel again. RMSNorm is the 8 kernels pipeflow's models launch.
POINTWISE_KINDS = {
    "layernorm": PointwiseKind("norm", "layernorm", backward=True, kernels=(1, 2)),
    "rmsnorm": PointwiseKind("norm", "rmsnorm_llama", backward=True, kernels=(8, 16)),
    "gelu": PointwiseKind("pointwise", "gelu_tanh", backward=True),
    "silu_mul": PointwiseKind("pointwise", "silu_mul", backward=True),
    "add": PointwiseKind("pointwise", "add"),
    "copy": PointwiseKind("pointwise", "copy"),
    "rotary": PointwiseKind("pointwise", "add", passes=5.0, kernels=(10, 20)),
    "reduce": PointwiseKind("pointwise", "copy", passes=0.5),
    "softmax": PointwiseKind("pointwise", "layernorm", backward=True),
    "bias": PointwiseKind("pointwise", "add", epilogue=True),
}


@dataclass(frozen=True)
class Saved:
    """A tensor a forward operator keeps for its backward: its name within one block (counted once), its
    bytes for the whole call, and whether it lies in the attention's region (``selective`` recomputation
    reruns it)."""

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
        return product_flops(self.m, self.k, self.n) * self.count


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
        """Query-key pairs scored per head (:func:`~pipeflow.planning.transformer.attention_pairs`)."""
        return attention_pairs(self.queries, self.keys, self.causal)

    @property
    def flops(self) -> float:
        """Q K^T and A V over the pairs; the backward 2.5 times the forward."""
        f = float(pair_flops(self.head_dim)) * self.pairs * self.batch_heads * self.count
        return f if self.phase == "fwd" else 2.5 * f


@dataclass(frozen=True)
class Pointwise:
    kind: str  # one of POINTWISE_KINDS
    phase: str  # fwd | bwd
    elements: int
    dtype_bytes: int
    count: int = 1
    name: str = ""
    launches: int = 0  # kernels per operator; 0: as its kind launches (kernels())
    saves: tuple[Saved, ...] = _saves()

    def __post_init__(self) -> None:
        if self.kind not in POINTWISE_KINDS or self.phase not in ("fwd", "bwd"):
            raise ValueError(f"a pointwise operator is one of {', '.join(POINTWISE_KINDS)}, fwd or bwd; "
                             f"not {self.kind!r} {self.phase!r}")

    @property
    def cls(self) -> str:
        return POINTWISE_KINDS[self.kind].cls

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
    """The step's gradient norm for the clip, a tensor at a time, then each gradient scaled by the clip."""

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
    """What one action's operators depend on: shape, sequences, ``tokens`` ending a ``prefix``, dtype."""

    spec: TransformerSpec
    sequences: int
    tokens: int
    prefix: int
    dtype_bytes: int

    @property
    def rows(self) -> int:  # tokens the products see
        return self.sequences * self.tokens


def kernels(op: Operator) -> int:
    """Kernels the host launches for one operator (before ``count``): 1 fused, a pointwise kind's as it
    declares (:data:`POINTWISE_KINDS`); 0 for the step's."""
    if isinstance(op, Pointwise):
        return op.launches or POINTWISE_KINDS[op.kind].kernels[op.phase == "bwd"]
    if isinstance(op, Attention):
        return 1 if op.phase == "fwd" else 2
    if isinstance(op, (Step, GradNorm)):
        return 0  # its measured time holds its own launches
    return 1
