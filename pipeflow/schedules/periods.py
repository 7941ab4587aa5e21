"""Each schedule's period: from ``fill`` microbatches on, one more ``period`` of microbatches
inserts the same blocks of steps into every device's walk
(:class:`pipeflow.sim.memory_peaks.Periodic`), so two small walks two periods apart give
the peak at any larger count exactly. (fill, period) per schedule in p, v, s and m;
tests/test_search.py holds each rule."""

from __future__ import annotations

from typing import Callable

PeriodRule = Callable[[int, int, int, int], tuple[int, int]]


def _group(p: int, s: int) -> int:
    return -(-p // s)


def _interleaved(p: int, v: int, s: int, m: int) -> tuple[int, int]:
    g = _group(p, s)
    return (3 * g if m % g == 0 else max(3, g * (g + 1)) + 1), g


PERIODS: dict[str, PeriodRule] = {
    "1f1b": lambda p, v, s, m: (p + 2, 1),
    "zb_h1": lambda p, v, s, m: (p + 2, 1),
    "seq1f1b": lambda p, v, s, m: (_group(p - 1, s) + 3, 1),
    "zb_v": lambda p, v, s, m: (2 * p + 1, 1),
    "dualpipe_v": lambda p, v, s, m: (2 * p + 1, 1),
    "chimera": lambda p, v, s, m: (p + 2, p),  # (p even: an even fill and period keep m's parity)
    "gpipe": lambda p, v, s, m: (3, 1),
    "looped_bfs": lambda p, v, s, m: (3, 1),
    "zb_h2": lambda p, v, s, m: (2 * p, 1),
    "interleaved_1f1b": _interleaved,
    "interleaved_zb": _interleaved,
    "seq1f1b_interleaved": _interleaved,
}


def periods_past_fill(name: str, p: int, v: int, s: int, m: int) -> tuple[int, int, int] | None:
    """(m0, period, k): m is k periods past m0, the smallest size from the fill on a whole number
    of periods short of m; None where the schedule has no rule or m is below its fill."""
    rule = PERIODS.get(name)
    if rule is None:
        return None
    fill, q = rule(p, v, s, m)
    if m < fill:
        return None
    m0 = fill + (m - fill) % q
    return m0, q, (m - m0) // q
