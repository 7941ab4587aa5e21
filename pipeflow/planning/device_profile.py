"""A device profile: each operator's time on a machine, from a sweep measured on it.

The sweep (``python -m pipeflow.measure_device --out F``, or the one shipped for a
preset: ``topology.device=h200``) times the operators a training step launches at
several sizes (:mod:`pipeflow.topology.op_sweep`). A :class:`DeviceProfile` prices an
operator of :mod:`pipeflow.planning.operators` from those rows:

- matrix products: the throughput of the nearest measured shapes (in log m, k, n, by
  phase and dtype), interpolated; under the smallest measured m the smallest's time
  (a product that small waits on its launch, not its FLOPs);
- attention: the throughput at the nearest head dimension and number of heads,
  interpolated in the prefix's length, forward and backward apart;
- memory-bound operators (norms, activations, adds, copies) and the loss: on a GPU a
  fixed cost (its kernels') plus a cost per element fitted on the rows where the
  device, not the host, sets the time (:class:`Linear`); on a CPU the measured times
  interpolated between the rows (:class:`Curve`: its bandwidth depends on the size,
  cache to DRAM to fresh pages);
- the optimizer: a fixed cost plus a cost per parameter and per tensor, fitted by
  least squares;
- the host: ``launch_s`` per kernel issued, ``backward_call_s`` per backward pass.

An action's time (:meth:`DeviceProfile.action`) runs its operators in order with the
host issuing them: an operator starts once the device is free and the host has
launched it, so a stream of small kernels costs its launches, not its bytes.

:meth:`DeviceProfile.fit_errors` says how well each class's model holds on the rows
it was made from (leave-one-out for the interpolated tables).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..faults import Fault
from .operators import CLASSES, Attention, GradNorm, Loss, Operator, Pointwise, Product, Step, kernels

# the sweep's elementwise rows by the operator kind they price
_SWEPT = {"layernorm": "layernorm", "rmsnorm": "rmsnorm_llama", "gelu": "gelu_tanh", "silu_mul": "silu_mul",
          "add": "add", "copy": "copy"}
# kinds the sweep does not time, priced as a swept one over as many passes of their elements:
# the rotation (two products, a negation, a concatenation, a sum: about five adds' traffic),
# a bias's or a norm's sum over tokens (one read: half a copy), softmax (a norm's passes), a
# product's bias written into its output (an add's pass: a strided read and a write, not the
# swept copy's memcpy; nothing on a GPU, see _pointwise)
_AS = {"rotary": ("add", 5.0), "reduce": ("copy", 0.5), "softmax": ("layernorm", 1.0), "bias": ("add", 1.0)}
_DTYPES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


class ProfileError(Fault, ValueError):
    """A profile file that cannot price a step (missing sections, unreadable rows): one
    sentence naming the file."""


_LONGER = " (a longer --budget-s if its sections were cut short or skipped)"


@dataclass(frozen=True)
class Linear:
    """``fixed + per * size``; ``error``: its relative RMS error on the rows fitted."""

    fixed: float
    per: float
    error: float = 0.0
    rows: int = 0

    def __call__(self, size: float) -> float:
        return self.fixed + self.per * size


def fit_linear(sizes, seconds, fixed: float | None = None) -> Linear:
    """``fixed + per * size`` over the device-bound rows: those at least 2.5 times the
    smallest time (below, the host's launches set it). With ``fixed`` given (a GPU's
    cost per kernel, measured by replaying a graph of them: the device's own share of a
    small kernel) only ``per`` is fitted; otherwise the line's intercept, kept in
    [0, the smallest time] (a CPU's cost per call)."""
    x, y = np.asarray(sizes, float), np.asarray(seconds, float)
    keep = y >= 2.5 * y.min()
    if keep.sum() < 2:
        keep = np.argsort(y)[-2:] if len(y) >= 2 else np.arange(len(y))
    x, y = x[keep], y[keep]
    if fixed is None:
        b = np.polyfit(x, y, 1)[1] if len(x) >= 2 and np.ptp(x) > 0 else 0.0
        fixed = min(max(float(b), 0.0), float(y.min()))
    per = max(float(np.sum((y - fixed) * x) / np.sum(x * x)), 0.0)
    fit = fixed + per * x
    return Linear(fixed, per, float(np.sqrt(np.mean(((fit - y) / y) ** 2))), int(len(x)))


@dataclass(frozen=True)
class Curve:
    """Seconds of a memory-bound operator against its elements, as measured: linear
    between neighbouring rows; under the smallest, ``fixed`` plus that row's time per
    element beyond it; over the largest, the last two rows' slope.

    One straight line cannot fit a CPU: its bandwidth falls as an operator's inputs
    leave the caches, and over the 32 MiB that glibc maps fresh for every allocation
    each output page is faulted in anew (a 64 MiB copy ran at 4 GB/s, a 1 MiB one at
    76). A line through every row priced gpt_tiny's 256 KiB adds at 74 us against the
    11 measured, and the backward's memory-bound operators at 6.1 ms a stage against the
    2.2 that torch's profiler counted in the run. ``error``: relative RMS error
    predicting each inner row from the others."""

    sizes: tuple
    seconds: tuple
    fixed: float = 0.0  # a call's own cost: the rows' intercept
    error: float = 0.0

    @property
    def rows(self) -> int:
        return len(self.sizes)

    def __call__(self, size: float) -> float:
        xs, ys = self.sizes, self.seconds
        if size <= xs[0]:
            return self.fixed + (ys[0] - self.fixed) * size / xs[0]
        if size >= xs[-1]:
            if len(xs) == 1:
                return ys[0] * size / xs[0]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + max(slope, 0.0) * (size - xs[-1])
        return float(np.interp(size, xs, ys))


def fit_curve(sizes, seconds) -> Curve:
    """The :class:`Curve` through ``(sizes, seconds)`` (several rows at one size: their
    median), its ``fixed`` the intercept of the line through the two smallest rows, kept
    in [0, the smallest time] (a CPU's cost per call)."""
    by: dict = {}
    for x, y in zip(sizes, seconds):
        by.setdefault(float(x), []).append(float(y))
    xs = sorted(by)
    ys = [float(np.median(by[x])) for x in xs]
    fixed = 0.0
    if len(xs) >= 2:
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        fixed = min(max(ys[0] - slope * xs[0], 0.0), ys[0])
    errs = [Curve(tuple(xs[:i] + xs[i + 1:]), tuple(ys[:i] + ys[i + 1:]), fixed)(xs[i]) / ys[i] - 1.0
            for i in range(1, len(xs) - 1)]
    return Curve(tuple(xs), tuple(ys), fixed, float(np.sqrt(np.mean(np.square(errs)))) if errs else 0.0)


@dataclass(frozen=True)
class StepFit:
    """The optimizer's step: ``fixed + per_param * params + per_tensor * tensors``."""

    fixed: float
    per_param: float
    per_tensor: float
    error: float = 0.0

    def __call__(self, params: int, tensors: int) -> float:
        return self.fixed + self.per_param * params + self.per_tensor * tensors


def fit_step(rows: list[dict]) -> StepFit:
    a = np.array([[1.0, r["params"], r["tensors"]] for r in rows])
    y = np.array([r["s"] for r in rows])
    # relative least squares (every row weighs alike, whatever its size), then no negative terms
    w = 1.0 / y
    coef = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    coef = np.maximum(coef, 0.0)
    fit = a @ coef
    return StepFit(*map(float, coef), float(np.sqrt(np.mean(((fit - y) / y) ** 2))))


@dataclass(frozen=True)
class Table:
    """Throughput measured at points of a log-space (one row of ``points`` each): the
    rows of the nearest value of the other coordinates, interpolated linearly along the
    first coordinate (clamped at its ends); two nearest groups weighed by distance."""

    points: np.ndarray  # [rows, dims], logs; the first coordinate is interpolated along
    values: np.ndarray  # throughput (FLOP/s)

    def __call__(self, point) -> float:
        point = np.asarray(point, float)
        rest = self.points[:, 1:]
        groups = np.unique(rest, axis=0)
        d = np.sqrt(((groups - point[1:]) ** 2).sum(axis=1))
        order = np.argsort(d)[:2]
        if d[order[0]] < 1e-9 or len(order) == 1:
            return self._along(groups[order[0]], point[0])
        w = 1.0 / d[order] ** 2
        logs = [math.log(self._along(groups[i], point[0])) for i in order]
        return float(math.exp(np.dot(w, logs) / w.sum()))

    def _along(self, group, x: float) -> float:
        rows = np.all(np.isclose(self.points[:, 1:], group), axis=1)
        xs, vs = self.points[rows, 0], self.values[rows]
        order = np.argsort(xs)
        return float(np.exp(np.interp(x, xs[order], np.log(vs[order]))))

    def leave_one_out(self) -> float:
        """Relative RMS error predicting each row from the others."""
        if len(self.values) < 2:
            return 0.0
        errs = []
        for i in range(len(self.values)):
            rest = Table(np.delete(self.points, i, 0), np.delete(self.values, i))
            errs.append(rest(self.points[i]) / self.values[i] - 1.0)
        return float(np.sqrt(np.mean(np.square(errs))))


@dataclass
class DeviceProfile:
    """Operator times of one device, from a sweep (see the module docstring)."""

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
        if op.kind == "bias" and self.kernel_s is not None:
            return 0.0  # a GPU's product adds its bias in its epilogue (cuBLASLt)
        kind, passes = _AS.get(op.kind, (op.kind, 1.0))
        swept = _SWEPT[kind]
        # a cast, an add of gradients or a sum is its forward kernel again
        phase = op.phase if kind in ("layernorm", "rmsnorm", "gelu", "silu_mul") else "fwd"
        fit = self._lookup(self.pointwise, (swept, op.dtype_bytes, phase), "pointwise") \
            if (swept, op.dtype_bytes, phase) in self.pointwise else \
            self._lookup(self.pointwise, (swept, 4 if op.dtype_bytes == 2 else 2, phase), "pointwise")
        return fit(op.elements * passes)

    def _grad_norm(self, op: GradNorm) -> float:
        """As measured (section grad_norm), or, in a sweep without it, its passes: a read of
        every gradient (half a copy's traffic) and a scale, five launches and one a tensor."""
        if self.grad_norm is not None:
            return self.grad_norm(op.params, op.tensors)
        each = max(1, op.params // max(1, op.tensors))
        passes = [Pointwise("reduce", "fwd", each, 4, count=op.tensors), Pointwise("copy", "fwd", each, 4, count=op.tensors)]
        return sum(self.time(p) for p in passes) + 6 * op.tensors * self.launch_s

    def block_time(self, family: str, kind: str, first: bool = False) -> float:
        """The host's seconds per block of ``family`` in action ``kind`` beyond what its
        operators price: its block measured alone (section ``blocks``) and what a step
        adds to that (section ``pipeline``); 0 where not measured, and on a GPU, whose host
        overlaps its kernels. A first stage has no input path: its I is empty, its W the
        whole backward."""
        if self.kernel_s is not None:
            return 0.0
        if first and kind in "IW":
            if kind == "I":
                return 0.0
            kind = "B"
        return max(self.block_host.get((family, kind), 0.0) + self.in_step.get(kind, 0.0), 0.0)

    def step_sync(self, collectives: list[tuple[float, int]]) -> float:
        """Seconds of a synchronous step's synchronisation on a profiled CPU host: its
        all-reduces (``collectives``: (bytes, ranks) each; the runtime's are the gradient
        norm and the loss over the world, and a tied embedding's gradient between the
        first and the last stage), each (n - 1) hops of the measured fixed cost and
        (n - 1) / n of its bytes at the measured all-reduce rate. 0 where the profile did
        not calibrate a pipeline (section ``pipeline``)."""
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
        """An action's seconds and their split by operator class (:data:`CLASSES`; ``host``:
        the device idle, waiting on launches). The host issues each operator's kernels
        (``launch_s`` each; a backward pass first pays ``backward_call_s``); the device
        runs an operator once it is free and the operator is launched."""
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
        """Relative RMS error of each class's model on its own rows (the tables' leave-one-out)."""
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
    """Whether a product's widths let the tensor cores read whole 16-byte rows (k and n
    multiples of 16 / dtype bytes): an odd vocabulary (GPT-2's 50,257) runs several times
    slower than 50,304 (measured on the H200: 89-145 against 700-790 TFLOP/s)."""
    step = max(1, 16 // dtype_bytes)
    return k % step == 0 and n % step == 0


# ---------------------------------------------------------------- from a sweep


def _rows(sweep: dict, name: str) -> list[dict]:
    sec = sweep.get("sections", {}).get(name) or {}
    return [r for r in sec.get("rows", []) if isinstance(r, dict) and "error" not in r]


def _products(sweep: dict) -> dict:
    grouped: dict = {}
    for section, default in (("gemm_bf16", 2), ("gemm_fp32_grid", 4)):
        for r in _rows(sweep, section):
            dtype = _DTYPES.get(str(r.get("dtype")), default)
            for phase in ("fwd", "dgrad", "wgrad"):
                if r.get(f"{phase}_s"):
                    key = (dtype, phase, aligned(r["k"], r["n"], dtype))
                    grouped.setdefault(key, []).append((r["m"], r["k"], r["n"], r[f"{phase}_s"]))
    if not any(d == 4 for d, _, _ in grouped):  # a GPU sweep's fp32 products: forward only, every phase alike
        for r in _rows(sweep, "gemm_fp32"):
            if r.get("precision", "highest") == "highest":
                for phase in ("fwd", "dgrad", "wgrad"):
                    key = (4, phase, aligned(r["k"], r["n"], 4))
                    grouped.setdefault(key, []).append((r["m"], r["k"], r["n"], r["s"]))
    out = {}
    for key, rows in grouped.items():
        a = np.array(rows, float)
        out[key] = (Table(np.log(a[:, :3]), 2 * a[:, 0] * a[:, 1] * a[:, 2] / a[:, 3]), int(a[:, 0].min()))
    return out


def _backward(r: dict, serial_call: float) -> float:
    """A row's backward: its forward and backward less its forward, and where one thread
    does all (a CPU) less the backward pass's start, which an action pays once
    (``backward_call_s``), not once per operator; on a GPU the host's start overlaps the
    device's work in the rows that set the fit."""
    return r["fwd_bwd_s"] - r["fwd_s"] - serial_call


def _attention(sweep: dict, serial_call: float) -> dict:
    grouped: dict = {}
    for r in _rows(sweep, "sdpa_bf16"):
        dtype = _DTYPES.get(str(r.get("dtype", "bfloat16")), 2)
        op = Attention("fwd", r["b"] * r["h"], r["s"], r["s"], r["d"], bool(r["causal"]), dtype)
        bwd = _backward(r, serial_call)
        for phase, flops, s in (("fwd", op.flops, r["fwd_s"]), ("bwd", 2.5 * op.flops, bwd)):
            if s > 0:
                grouped.setdefault((dtype, r["d"], bool(r["causal"]), phase), []).append(
                    (math.log(r["s"]), math.log(r["h"]), flops / s))
    return {k: Table(np.array(v)[:, :2], np.array(v)[:, 2]) for k, v in grouped.items()}


# kernels each swept operator launches, forward and backward (as torch runs them; Llama's
# RMSNorm as transformers writes it, its backward one kernel a forward kernel's gradient or two)
_SWEPT_KERNELS = {"copy": (1, 1), "add": (1, 1), "gelu_tanh": (1, 1), "silu_mul": (2, 4), "layernorm": (1, 2),
                  "rmsnorm_llama": (7, 12)}


def fit_memory_bound(rows: list[tuple[float, float]], kernel_fixed: float | None):
    """A memory-bound class's model from its (elements, seconds) rows: on a GPU
    (``kernel_fixed``: its kernels' own cost) a :class:`Linear` through the device-bound
    rows, since the sweep's small rows time the host issuing them back to back (what the
    action's launches price apart); on a CPU, where a call's time is the operator's, the
    :class:`Curve` through every row."""
    if kernel_fixed is None:
        return fit_curve(*zip(*rows))
    return fit_linear(*zip(*rows), kernel_fixed)


def _pointwise(sweep: dict, kernel_s: float | None, serial_call: float) -> dict:
    grouped: dict = {}
    for r in _rows(sweep, "elementwise"):
        dtype = _DTYPES.get(str(r["dtype"]), 4)
        n = r["rows"] * r["hidden"]
        grouped.setdefault((r["op"], dtype, "fwd"), []).append((n, r["fwd_s"]))
        if r.get("fwd_bwd_s") and _backward(r, serial_call) > 0:
            grouped.setdefault((r["op"], dtype, "bwd"), []).append((n, _backward(r, serial_call)))
    out = {}
    for (op, dtype, phase), rows in grouped.items():
        if len(rows) >= 2:
            launches = _SWEPT_KERNELS.get(op, (1, 1))[phase == "bwd"]
            out[(op, dtype, phase)] = fit_memory_bound(rows, None if kernel_s is None else launches * kernel_s)
    return out


def _loss(sweep: dict, kernel_s: float | None, serial_call: float) -> dict:
    grouped: dict = {}
    for r in _rows(sweep, "cross_entropy"):
        dtype = _DTYPES.get(str(r["dtype"]), 4)
        n = r["tokens"] * r["vocab"]
        grouped.setdefault((dtype, "fwd"), []).append((n, r["fwd_s"]))
        if _backward(r, serial_call) > 0:
            grouped.setdefault((dtype, "bwd"), []).append((n, _backward(r, serial_call)))
    # (its forward: a log-softmax and a gather, reduced; its backward about as many)
    return {k: fit_memory_bound(v, None if kernel_s is None else 3 * kernel_s)
            for k, v in grouped.items() if len(v) >= 2}


def _host(sweep: dict, source: str) -> tuple[float, float, float | None]:
    """Seconds per kernel the host launches (a tiny add issued back to back), per backward
    pass (a tiny add's forward and backward less its forward: its backward launches no
    kernel), and the device's own per kernel (a graph of 100 tiny adds replayed, less an
    empty graph's replay, per kernel; None on a CPU, where one thread does both)."""
    launches = [r["s_per_call_async"] for r in _rows(sweep, "launch")
                if r.get("op") == "add_out_tiny" and "s_per_call_async" in r]
    if not launches:
        raise ProfileError(f"{source}: the sweep has no launch rows (section launch), so the host's cost per kernel "
                           f"is unknown; measure again with python -m pipeflow.measure_device --out FILE{_LONGER}")
    launch = float(np.median(launches))
    adds = [r["fwd_bwd_s"] - r["fwd_s"] for r in _rows(sweep, "elementwise") if r["op"] == "add" and r.get("fwd_bwd_s")]
    backward = max(min(adds), 0.0) if adds else 0.0
    graphs = {r["op"]: r["events"]["s"] for r in _rows(sweep, "launch")
              if str(r.get("op", "")).startswith("cuda_graph_replay") and "events" in r}
    kernel = None
    if sweep.get("device") == "cuda":
        full, empty = graphs.get("cuda_graph_replay_100_kernels"), graphs.get("cuda_graph_replay_0_kernels", 0.0)
        kernel = (full - empty) / 100 if full else launch / 4
    return launch, backward, kernel


def _block_host(sweep: dict, launch: float, backward_call: float) -> dict:
    """Per (family, kind): a block's measured time at a tiny size (section ``blocks``) less
    the calls its kernels make (``launch`` each, priced with the operators) and, in B and
    I, the backward pass's start (``backward_call``, priced once per action)."""
    out: dict = {}
    for r in _rows(sweep, "blocks"):
        for kind in "FBIW":
            t = r[f"{kind}_s"] - r["kernels"][kind] * launch - (backward_call if kind in "BI" else 0.0)
            out[(r["family"], kind)] = max(t, 0.0)
    return out


def in_step_rows(times: dict, priced: dict, layers: list[int]) -> dict[str, float]:
    """Per action kind, the seconds per block an action of the reference pipeline took in
    its step beyond its price: the median over its stages of (calibrated time, ``times``,
    a calibration's ``"F|stage|segment"`` keys) less the priced time (``priced``, the same
    keys), over the stage's blocks (``layers``). A 1F1B replay runs F and B; its I and W
    come from tight loops, which hold none of a step's state: I takes B's (it walks B's
    graph), W none (its products run by hand, outside autograd)."""
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
    """The all-reduces of a synchronous step's synchronisation (the executor's
    ``_synchronise``), as (bytes, ranks): the gradient norm and the loss in float64 over
    every device of ``schedule``; a tied embedding's fp32 gradient over the devices that
    hold the first or the last stage (the runtime's tied group: none where one device
    holds both, as a V-shaped schedule's first does). ``spec``: a
    :class:`~pipeflow.planning.transformer.TransformerSpec` (a tensor rank's)."""
    out = [(16.0, schedule.num_devices)]
    if spec.tied and schedule.num_stages > 1:
        ends = (0, schedule.num_stages - 1)
        tied = {d for s in ends for _, d in schedule.placement.replicas(s)}
        out.append((4.0 * spec.vocab_size * spec.n_embd, len(tied)))
    return out


def _sync_hop(row: dict, host: dict) -> float | None:
    """The fixed seconds per ring hop of the reference step's synchronisation (its
    ``sync_s`` less its all-reduces' bytes at the measured rate, over their hops); None
    where the row did not record its collectives."""
    coll = row.get("sync_collectives")
    if not coll or row.get("sync_s") is None:
        return None
    rate = float(host.get("collective_bandwidth") or 0.0)
    moved = sum((n - 1) / n * b / rate for b, n in coll if n > 1) if rate > 0 else 0.0
    hops = sum(n - 1 for _, n in coll if n > 1)
    return max(float(row["sync_s"]) - moved, 0.0) / hops if hops else None


def from_sweep(sweep: dict, name: str, source: str = "") -> DeviceProfile:
    """A profile from a sweep's JSON (the format :mod:`pipeflow.topology.op_sweep` writes)."""
    if not isinstance(sweep, dict) or "sections" not in sweep:
        raise ProfileError(f"{source or name}: not an operator sweep (no 'sections'; made by "
                           f"python -m pipeflow.measure_device --out FILE)")
    launch, backward, kernel = _host(sweep, source or name)
    serial = backward if kernel is None else 0.0
    adamw = _rows(sweep, "adamw")
    prof = DeviceProfile(name, source or name, launch, backward, kernel, _products(sweep), _attention(sweep, serial),
                         _pointwise(sweep, kernel, serial), _loss(sweep, kernel, serial),
                         {impl: fit_step([r for r in adamw if r["impl"] == impl]) for impl in {r["impl"] for r in adamw}},
                         {k: sweep[k] for k in ("device", "gpu", "torch", "host", "cpu_isa") if k in sweep})
    prof.block_host = _block_host(sweep, launch, backward)
    pipeline = _rows(sweep, "pipeline")
    if pipeline:
        prof.in_step = {k: float(v) for k, v in pipeline[-1].get("in_step", {}).items()}
        prof.host = dict(pipeline[-1].get("host", {}))
        prof.sync_hop_s = _sync_hop(pipeline[-1], prof.host)
    fixes = (sweep.get("corrections") or {}).get("classes", {})
    bad = {c: f for c, f in fixes.items() if c not in CLASSES or not isinstance(f, (int, float)) or not f > 0}
    if bad:
        raise ProfileError(f"{source or name}: corrections {bad}: each a class of {', '.join(CLASSES)} "
                           f"and a factor > 0 (python -m pipeflow.fold_trace --out writes them)")
    prof.corrections = {c: float(f) for c, f in fixes.items()}
    posting = (sweep.get("corrections") or {}).get("message_host")
    if posting is not None:  # a run's own seconds per message posted (fold_trace), over the reference's
        if not isinstance(posting, (int, float)) or not posting > 0 or not prof.host:
            raise ProfileError(f"{source or name}: corrections message_host={posting!r}: seconds > 0, for a "
                               f"profile whose section pipeline calibrated a host")
        prof.host["message_host"] = float(posting)
    norms = [{**r, "s": r["s"] + r.get("scale_s", 0.0)} for r in _rows(sweep, "grad_norm")]
    prof.grad_norm = fit_step(norms) if len(norms) >= 3 else None
    missing = [what for what, got in (("products", prof.products), ("attention", prof.attention),  # (every model's)
                                      ("pointwise", prof.pointwise), ("cross_entropy", prof.loss),
                                      ("adamw", prof.step)) if not got]
    if missing:
        raise ProfileError(f"{source or name}: the sweep has no rows for {', '.join(missing)}; measure again "
                           f"with python -m pipeflow.measure_device --out FILE{_LONGER}")
    return prof


_LOADED: dict[tuple, DeviceProfile] = {}


def load_profile(path: str | Path, name: str | None = None) -> DeviceProfile:
    """The profile in ``path`` (a sweep's JSON), read once per process."""
    p = Path(path)
    try:  # a file measured again (or written section by section) is read again
        stat = p.stat()
        key = (str(p.resolve()), stat.st_mtime_ns, stat.st_size)
    except OSError:
        key = (str(p.resolve()), 0, 0)
    if key not in _LOADED:
        if not p.is_file():
            raise ProfileError(f"topology.device_profile={path}: no such file (make one with "
                               f"python -m pipeflow.measure_device --out {path})")
        try:
            sweep = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"topology.device_profile={path}: not readable JSON ({e})") from None
        try:
            _LOADED[key] = from_sweep(sweep, name or p.stem, str(path))
        except ProfileError as e:  # (the key as well as the file: from_sweep names the file)
            raise ProfileError(f"topology.device_profile={e}" if str(e).startswith(f"{path}:") else str(e)) from None
    return _LOADED[key]
