"""The elementwise kernels the operator sweep times (its section ``elementwise``), by the name its rows
carry: what each computes, the kernels torch launches for it and the fewest bytes it moves. A device
profile prices every pointwise operator kind by one of them
(:data:`pipeflow.planning.operators.POINTWISE_KINDS`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SweptKernel:
    """One swept kernel: ``call(kit, x, y)`` its output from two inputs (``kit``: torch, ``F``, the
    LayerNorm ``ln``, the RMSNorm weight ``wr``); the kernels launched forward and backward; the fewest
    bytes moved forward, and forward and backward (None: no backward timed), in inputs' bytes."""

    call: Callable
    launches: tuple[int, int]
    fwd_inputs: int
    fwd_bwd_inputs: int | None


def _rmsnorm(torch, x, w, eps=1e-5):
    """As transformers' LlamaRMSNorm computes it."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


# in the order the sweep times them (Llama's RMSNorm as transformers writes it: its backward
# one kernel a forward kernel's gradient or two)
ELEMENTWISE = {
    "copy": SweptKernel(lambda k, x, y: x.detach().clone(), (1, 1), 2, None),
    "add": SweptKernel(lambda k, x, y: x + y, (1, 1), 3, 6),
    "gelu_tanh": SweptKernel(lambda k, x, y: k.F.gelu(x, approximate="tanh"), (1, 1), 2, 5),
    "silu_mul": SweptKernel(lambda k, x, y: k.F.silu(x) * y, (2, 4), 3, 8),
    "layernorm": SweptKernel(lambda k, x, y: k.ln(x), (1, 2), 2, 5),
    "rmsnorm_llama": SweptKernel(lambda k, x, y: _rmsnorm(k.torch, x, k.wr), (7, 12), 2, 5),
}
