"""A device profile: each operator's time on a machine in seconds, from an operator sweep measured on it
(read by :mod:`pipeflow.planning.from_sweep`, fitted by :mod:`pipeflow.planning.profile_fits`); an action
runs its operators with the host issuing them, so small kernels cost their launches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..faults import Fault
from .model_state import gradient_bytes
from .operators import (CLASSES, POINTWISE_KINDS, Attention, GradNorm, Loss, Operator, Pointwise, Product, Step,
                        kernels)
from .profile_fits import StepFit
from .transformer import shared_head_params



class ProfileError(Fault, ValueError):
    """A profile file that cannot price a step: one sentence naming the file."""


@dataclass
class DeviceProfile:
    """Operator times of one device from a sweep: products and attention by interpolated throughput,
    memory-bound operators and the loss by a fit, the optimizer by parameters and tensors, the host per
    launch (``launch_s``) and per backward pass (``backward_call_s``)."""

    name: str
    source: str
    launch_s: float  # the host's seconds per kernel it launches
    backward_call_s: float  # the host's seconds to start a backward pass
    # the device's own seconds per kernel (a graph of tiny kernels replayed); None where
    # host and device are one (a CPU: an operator's time holds its call)
    kernel_s: float | None = None
    products: dict = field(default_factory=dict)  # (dtype bytes, phase, aligned) -> (Table, smallest m)
    attention: dict = field(default_factory=dict)  # (dtype bytes, head dim, causal, phase) -> Table over (log keys, log heads)
    pointwise: dict = field(default_factory=dict)  # (swept kind, dtype bytes, phase) -> Curve (CPU) or Linear (GPU) over elements
    loss: dict = field(default_factory=dict)  # (dtype bytes, phase) -> Curve (CPU) or Linear (GPU) over tokens x vocab
    step: dict = field(default_factory=dict)  # impl -> StepFit
    grad_norm: StepFit | None = None  # the clip's norm and scale (section grad_norm); None: priced as passes
    # (model family, F|B|I|W) -> the host's seconds per block beyond its kernels' calls (section
    # blocks, a CPU's: pipeflow.runtime.block_host); a family not measured gets none
    block_host: dict = field(default_factory=dict)
    # F|B|I|W -> the seconds per block an action takes inside a step beyond its operators and
    # its block's host time priced alone, and the local host's topology keys: section
    # pipeline (a CPU's reference pipeline calibrated; pipeflow.measure_device); none where
    # not measured
    in_step: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    # a synchronous step's all-reduces on this host (section pipeline): the fixed seconds of
    # one, per ring hop, as the reference step measured them; None where not measured
    sync_hop_s: float | None = None
    facts: dict = field(default_factory=dict)  # the sweep's device, torch, host
    # operator class -> the factor a run's own trace set on its prices (python -m
    # pipeflow.fold_trace --out: measured over priced, section corrections); none: 1
    corrections: dict = field(default_factory=dict)

    # ------------------------------------------------------------ pricing
    def time(self, op: Operator) -> float:
        """Device seconds of ``op`` (all ``count`` of it), corrected by a run's trace."""
        return self._time(op) * self.corrections.get(op.cls, 1.0)

    def _time(self, op: Operator) -> float:
        if isinstance(op, Product):
            return op.count * self._product(op)
        if isinstance(op, Attention):
            return op.flops / self._attention(op)
        if isinstance(op, Pointwise):
            return op.count * self._pointwise(op)
        if isinstance(op, Loss):
            return op.count * self._lookup(self.loss, (op.dtype_bytes, op.phase), "loss")(op.tokens * op.vocab)
        if isinstance(op, GradNorm):
            return op.count * self._grad_norm(op)
        if isinstance(op, Step):
            fit = self.step.get(op.impl) or self.step.get("foreach") or next(iter(self.step.values()), None)
            if fit is None:
                raise ProfileError(f"device profile {self.source}: no optimizer rows (section adamw)")
            return op.count * fit(op.params, op.tensors)
        raise TypeError(f"not an operator: {op!r}")

    def _product(self, op: Product) -> float:
        dtypes = {d for d, _, _ in self.products} or {2}
        dtype = op.dtype_bytes if op.dtype_bytes in dtypes else min(dtypes, key=lambda d: abs(d - op.dtype_bytes))
        key = (dtype, op.phase, aligned(op.k, op.n, dtype))
        if key not in self.products:  # no product of that alignment measured: the other's
            key = (dtype, op.phase, not key[2])
        table, smallest = self._lookup(self.products, key, "products")
        m = max(op.m, smallest)  # under the smallest measured m: that size's time
        return 2.0 * m * op.k * op.n / table((math.log(m), math.log(op.k), math.log(op.n)))

    def _attention(self, op: Attention) -> float:
        phase = "fwd" if op.phase == "fwd" else "bwd"
        keys = [k for k in self.attention if k[3] == phase]
        if not keys:
            raise ProfileError(f"device profile {self.source}: no attention rows (section sdpa_bf16)")
        # the same dtype first (a 16-bit run measured in bf16), then the nearest head dim, then causal alike
        key = min(keys, key=lambda k: (k[0] != op.dtype_bytes, abs(math.log(k[1] / op.head_dim)), k[2] != op.causal))
        return self.attention[key]((math.log(op.keys), math.log(op.heads or op.batch_heads)))

    def _pointwise(self, op: Pointwise) -> float:
        """As its kind declares (:data:`~pipeflow.planning.operators.POINTWISE_KINDS`)."""
        kind = POINTWISE_KINDS[op.kind]
        if kind.epilogue and self.kernel_s is not None:
            return 0.0
        swept, phase = kind.swept, op.phase if kind.backward else "fwd"
        fit = self._lookup(self.pointwise, (swept, op.dtype_bytes, phase), "pointwise") \
            if (swept, op.dtype_bytes, phase) in self.pointwise else \
            self._lookup(self.pointwise, (swept, 4 if op.dtype_bytes == 2 else 2, phase), "pointwise")
        return fit(op.elements * kind.passes)

    def _grad_norm(self, op: GradNorm) -> float:
        """As measured, or where the sweep lacks it, a read of every gradient and a scale."""
        if self.grad_norm is not None:
            return self.grad_norm(op.params, op.tensors)
        each = max(1, op.params // max(1, op.tensors))
        passes = [Pointwise("reduce", "fwd", each, 4, count=op.tensors), Pointwise("copy", "fwd", each, 4, count=op.tensors)]
        return sum(self.time(p) for p in passes) + 6 * op.tensors * self.launch_s

    def block_time(self, family: str, kind: str, first: bool = False) -> float:
        """The host's seconds per block of ``family`` in ``kind`` beyond its operators' (0 unmeasured)."""
        if self.kernel_s is not None:
            return 0.0
        if first and kind in "IW":
            if kind == "I":
                return 0.0
            kind = "B"
        return max(self.block_host.get((family, kind), 0.0) + self.in_step.get(kind, 0.0), 0.0)

    def step_sync(self, collectives: list[tuple[float, int]]) -> float:
        """Seconds of a synchronous step's all-reduces (``collectives``: (bytes, ranks) each) on a profiled
        CPU host; 0 where the profile did not calibrate a pipeline."""
        if self.sync_hop_s is None:
            return 0.0
        rate = float(self.host.get("collective_bandwidth") or 0.0)
        return sum((n - 1) * self.sync_hop_s + ((n - 1) / n * b / rate if rate > 0 else 0.0)
                   for b, n in collectives if n > 1)

    def _lookup(self, table: dict, key, what: str):
        got = table.get(key)
        if got is None:
            raise ProfileError(f"device profile {self.source}: no {what} rows for {key}")
        return got

    def action(self, ops: list[Operator], backward: bool = False) -> tuple[float, dict[str, float]]:
        """(an action's seconds, their split by operator class, :data:`CLASSES`; ``host``: waiting on
        launches): the host issuing each operator's kernels, the device running each once free and
        launched."""
        host = self.backward_call_s if backward else 0.0
        dev = 0.0
        split = dict.fromkeys(CLASSES, 0.0)
        if self.kernel_s is None:  # one thread: each operator's time holds its call
            for op in ops:
                split[op.cls] += self.time(op)
            split["host"] = host
            return sum(split.values()), split
        for op in ops:
            t = self.time(op)
            if t <= 0:
                continue
            n = op.count
            if isinstance(op, (Step, GradNorm)):  # its measured time holds its launches: host and device alike
                start = max(host, dev)
                host = dev = start + t
                split[op.cls] += t
                continue
            per, issue = t / n, kernels(op) * self.launch_s
            end = max(dev + t, host + issue + (n - 1) * max(per, issue) + per)
            split["host"] += end - dev - t
            split[op.cls] += t
            dev, host = end, host + n * issue
        return dev, split

    def fit_errors(self) -> dict[str, float]:
        """Relative RMS error of each class's model on its own rows."""
        out: dict[str, float] = {}
        for (dtype, phase, fits), (table, _) in sorted(self.products.items()):
            out[f"product {phase} {8 * dtype}-bit{'' if fits else ' unaligned'}"] = table.leave_one_out()
        for (dtype, d, causal, phase), table in sorted(self.attention.items()):
            out[f"attention {phase} {8 * dtype}-bit d={d}{' causal' if causal else ''}"] = table.leave_one_out()
        for (kind, dtype, phase), fit in sorted(self.pointwise.items()):
            out[f"{kind} {phase} {8 * dtype}-bit"] = fit.error
        for (dtype, phase), fit in sorted(self.loss.items()):
            out[f"cross-entropy {phase} {8 * dtype}-bit"] = fit.error
        for impl, fit in sorted(self.step.items()):
            out[f"adamw {impl}"] = fit.error
        if self.grad_norm is not None:
            out["gradient norm and clip"] = self.grad_norm.error
        return out


def aligned(k: int, n: int, dtype_bytes: int) -> bool:
    """Whether a product's widths let tensor cores read whole 16-byte rows."""
    # an odd vocabulary (GPT-2's 50,257) ran several times slower than 50,304 (H200: 89-145 against 700-790 TFLOP/s)
    step = max(1, 16 // dtype_bytes)
    return k % step == 0 and n % step == 0


def in_step_rows(times: dict, priced: dict, layers: list[int]) -> dict[str, float]:
    """Per action kind, the seconds per block a calibrated step took beyond its price."""
    extra: dict = {}
    for key, t in priced.items():
        kind, stage = key.split("|")[0], int(key.split("|")[1])
        if key in times and layers[stage] > 0:
            extra.setdefault(kind, []).append((float(times[key]) - t) / layers[stage])
    out = {k: float(np.median(v)) for k, v in extra.items() if k in "FB"}
    if "B" in out:
        out["I"], out["W"] = out["B"], 0.0
    return out


def sync_collectives(spec, schedule) -> list[tuple[float, int]]:
    """The all-reduces of a synchronous step's synchronisation as (bytes, ranks): gradient norm and loss
    over every device, a tied embedding's gradient over its ends' devices."""
    out = [(16.0, schedule.num_devices)]
    if spec.tied and schedule.num_stages > 1:
        ends = (0, schedule.num_stages - 1)
        tied = {d for s in ends for _, d in schedule.placement.replicas(s)}
        out.append((gradient_bytes(shared_head_params(spec)), len(tied)))
    return out
