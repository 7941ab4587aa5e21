"""The fixed-cost model (cost=unit): every stage, segment and device costs the same,
in abstract time units; the papers' bubble formulas hold exactly under it.
"""

from __future__ import annotations

from ..topology.topology import Device
from .cost import COARSE_ABSENT, CostModel, _check_int, _check_number


class UnitCost(CostModel):
    """The same fixed cost for every stage, segment and device: F ``forward``, B ``backward``,
    W ``weight``, I ``backward - weight``, S ``step``; bytes ``activation``, ``message``,
    ``params``, the I-to-W residual ``residual * activation``. ``comm`` (not None): every
    message's time; else ``message`` bytes travel over the topology."""

    absent_terms = COARSE_ABSENT  # activations, messages and model state alone

    name = "unit"
    time_unit = "units"

    def __init__(
        self,
        num_stages: int,
        forward: float = 1.0,
        backward: float = 2.0,
        weight: float = 1.0,
        step: float = 0.0,
        activation: float = 1.0,
        message: float = 0.0,
        residual: float = 0.0,
        params: float = 0.0,
        comm: float | None = 0.0,
    ) -> None:
        self.num_stages = _check_int("pipeline.stages", num_stages)
        # comm: time of one message in the same units as forward/backward (free by
        # default: abstract units do not mix with a topology's seconds); None sends
        # ``message`` bytes over the topology's links instead
        self.message_time = None if comm is None else _check_number("cost.comm", comm)
        self.forward = _check_number("cost.forward", forward)
        self.backward = _check_number("cost.backward", backward)
        self.weight = _check_number("cost.weight", weight)
        self.step = _check_number("cost.step", step)
        self.activation = _check_number("cost.activation", activation)
        self.message = _check_number("cost.message", message)
        self.residual = _check_number("cost.residual", residual)
        self.params = _check_number("cost.params", params)
        if self.weight > self.backward:
            raise ValueError(
                f"cost.weight={weight}: the weight-gradient part of the backward cannot exceed the whole "
                f"backward (cost.backward={backward}); use cost.weight <= cost.backward"
            )
        if self.residual > 1:
            raise ValueError(
                f"cost.residual={residual}: it is the fraction of a forward's activations kept from I until W; "
                f"use a number in [0, 1]"
            )
        self._time = {
            "F": self.forward,
            "B": self.backward,
            "W": self.weight,
            "I": self.backward - self.weight,
            "S": self.step,
        }

    def compute_time(self, kind: str, stage: int, segment: int, device: Device) -> float:
        try:
            return self._time[kind]
        except KeyError:
            raise self._bad_kind(kind) from None

    def message_bytes(self, src_stage: int, dst_stage: int, segment: int) -> float:
        return self.message

    def activation_bytes(self, stage: int, segment: int) -> float:
        return self.activation

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        return self.residual * self.activation

    def param_bytes(self, stage: int) -> float:
        return self.params

    def describe(self) -> dict:
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "forward": self.forward,
            "backward": self.backward,
            "weight": self.weight,
            "step": self.step,
            "activation": self.activation,
            "message": self.message,
            "residual": self.residual,
            "params": self.params,
            "comm": self.message_time,
        }
