"""The models a device profile prices by, fitted to a sweep's rows (seconds), each with its relative error:
:class:`Linear`, :class:`Curve`, :class:`StepFit` and :class:`Table`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


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
    """``fixed + per * size`` over the device-bound rows (at least 2.5 times the smallest time); ``fixed``
    given (a GPU's per kernel) only ``per`` is fitted."""
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
    """Seconds of a memory-bound operator against its elements, linear between measured rows."""

    # one line cannot fit a CPU: its bandwidth falls as the inputs leave the caches, and past
    # glibc's 32 MiB each page is faulted anew (a 64 MiB copy ran at 4 GB/s, a 1 MiB one at 76)
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
    """The :class:`Curve` through ``(sizes, seconds)`` (the median at a repeated size)."""
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
    """Throughput at points of a log-space, interpolated along the first coordinate."""

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


def fit_memory_bound(rows: list[tuple[float, float]], kernel_fixed: float | None):
    """A memory-bound class's model from its (elements, seconds) rows: a :class:`Linear` on a GPU
    (``kernel_fixed`` given), a :class:`Curve` on a CPU."""
    if kernel_fixed is None:
        return fit_curve(*zip(*rows))
    return fit_linear(*zip(*rows), kernel_fixed)
