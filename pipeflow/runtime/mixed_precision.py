"""Mixed precision: the compute dtype of forwards (autocast), of the activations and
gradients that travel between stages, and fp16's dynamic loss scaling.

Weights and optimizer state stay fp32 (autocast casts each weight to the compute dtype
where an operation uses it, and its gradient accumulates in fp32). A stage's output is
cast to the compute dtype before it is sent (half the bytes of fp32) and restored to
fp32 where it arrives (the stream a single device keeps), and the gradient that comes
back is cast to the output's own dtype before the backward.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """``precision`` on one rank's device."""

    def __init__(self, name: str = "fp32", device_type: str = "cpu", loss_scale: float = 2.0**16):
        if name not in DTYPES:
            raise ValueError(f"precision={name}: allowed values: {', '.join(DTYPES)}")
        self.name = name
        self.loss_scale = float(loss_scale)  # fp16: the initial scale
        self.dtype = DTYPES[name]
        self.device_type = device_type

    def autocast(self):
        """The context a forward (and its loss) runs in."""
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype is not None else nullcontext()

    def shared_casts(self):
        """The context a synchronous step runs in: every microbatch's forward reuses one
        cast of each weight. Autocast caches the casts of the weights (leaves that require
        grad) until its outermost context exits; a forward's own context would drop them
        and the next microbatch would cast again, each in-flight microbatch then holding
        its own 16-bit copy of the stage's matrices for its backward (measured: stage 0
        of a bf16 1F1B step kept 1.5 MiB more than one copy). An outer context, itself
        disabled, keeps the cache for the step; the caller clears it when the weights
        change (:func:`torch.clear_autocast_cache` after each optimizer step)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=False)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a message of ``dtype`` travels in: floating ones in the compute dtype."""
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.wire_dtype(t.dtype))

    def arrived(self, t: torch.Tensor) -> torch.Tensor:
        """A floating message that travelled in the compute dtype, back in fp32: the dtype
        the stage's stream has on one device (autocast computes in 16 bits, but what
        flows between its operations outside them, the stream, stays fp32).
        Kept in 16 bits, every stage after the first ran its stream additions and
        (on CPU, where autocast leaves LayerNorm in the input's dtype) its norms in 16
        bits: not the single-device step, and not the memory the model counts."""
        if self.dtype is None or not t.is_floating_point() or t.dtype == torch.float32:
            return t
        return t.float()


class LossScaler:
    """fp16's dynamic loss scaling: the loss is multiplied by ``scale`` before the
    backward, so that small gradients do not underflow in fp16, and the gradients are
    divided by it before the step. A step whose gradients overflowed (a non-finite
    global norm, the same on every rank) is skipped and the scale halved; after
    ``growth_interval`` steps in a row without one, the scale doubles."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000, factor: float = 2.0):
        self.scale = float(scale)
        self.growth_interval = int(growth_interval)
        self.factor = float(factor)
        self.good = 0  # steps since the last overflow or growth
        self.skipped = 0  # steps skipped so far

    def update(self, finite: bool) -> bool:
        """Record one step's verdict; whether to take the step."""
        if not finite:
            self.scale /= self.factor
            self.good = 0
            self.skipped += 1
            return False
        self.good += 1
        if self.good >= self.growth_interval:
            self.scale *= self.factor
            self.good = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good, self.skipped = float(state["scale"]), int(state["good"]), int(state["skipped"])
