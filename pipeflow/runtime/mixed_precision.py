"""Mixed precision: the compute dtype of forwards (autocast) and of the messages between
stages, and fp16's dynamic loss scaling. Weights and optimizer state stay fp32; a stage's
output travels in the compute dtype and is restored to fp32 where it arrives."""

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
        """The context a synchronous step runs in: an outer, disabled autocast that keeps the cast
        of each weight for every microbatch's forward until the caller clears it
        (:func:`torch.clear_autocast_cache` after each optimizer step)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=False)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a message of ``dtype`` travels in: floating ones in the compute dtype."""
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.wire_dtype(t.dtype))

    def arrived(self, t: torch.Tensor) -> torch.Tensor:
        """A floating message that travelled in the compute dtype, back in fp32: the stream's dtype
        on one device (kept in 16 bits, later stages' additions and CPU norms ran in 16 bits)."""
        if self.dtype is None or not t.is_floating_point() or t.dtype == torch.float32:
            return t
        return t.float()


class LossScaler:
    """fp16's dynamic loss scaling: the loss is multiplied by ``scale`` before the backward and
    the gradients divided by it before the step. A step whose gradients overflowed is
    skipped and the scale halved; after ``growth_interval`` clean steps it doubles."""

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
