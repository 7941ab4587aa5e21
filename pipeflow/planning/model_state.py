"""What a parameter costs in memory and in its optimizer step as the runtime keeps it
(:mod:`pipeflow.runtime.optimizer`): fp32 weight, gradient and AdamW's two moments (16 B), and at 16 bits
a 16-bit cast of each matrix weight."""

from __future__ import annotations

# whole numbers: a count of parameters times them stays exact (host.py sums their squares)
WEIGHT_BYTES = 4  # the fp32 weight (the master weight at 16 bits)
GRADIENT_BYTES = 4  # its fp32 gradient
MOMENT_BYTES = 8  # AdamW's two fp32 moments
STATE_BYTES = WEIGHT_BYTES + GRADIENT_BYTES + MOMENT_BYTES  # 16 B a parameter
CAST_BYTES = 2  # a weight's 16-bit cast under autocast


def parameter_state(params: float) -> dict[str, float]:
    """Bytes of ``params`` parameters' ``parameters``, ``gradients`` and ``optimizer_state``."""
    return {"parameters": WEIGHT_BYTES * params, "gradients": GRADIENT_BYTES * params,
            "optimizer_state": MOMENT_BYTES * params}


def cast_bytes(params: float, dtype_bytes: int) -> float:
    """Bytes of the 16-bit casts of ``params`` weights at ``dtype_bytes`` (0 at fp32)."""
    return float(CAST_BYTES * params) if dtype_bytes < 4 else 0.0


def gradient_bytes(params: float) -> float:
    """Bytes of the fp32 gradients of ``params`` parameters."""
    return float(GRADIENT_BYTES * params)


def step_bytes(params: float, dtype_bytes: int) -> float:
    """Bytes AdamW's step moves for ``params`` parameters."""
    per_param = 2 * (WEIGHT_BYTES + MOMENT_BYTES) + GRADIENT_BYTES + (dtype_bytes if dtype_bytes < 4 else 0)
    return params * per_param


def step_time(params: float, dtype_bytes: int, memory_bandwidth: float) -> float:
    """Seconds of that step at ``memory_bandwidth`` bytes/s (0 where it is unknown, <= 0)."""
    if memory_bandwidth <= 0:
        return 0.0
    return step_bytes(params, dtype_bytes) / memory_bandwidth
