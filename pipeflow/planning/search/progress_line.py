"""How far a long search is: a line every ``search.progress`` seconds while it prices, from
whichever process priced (forked workers move counters in shared memory, :class:`Progress`
made before the fork; in one process the search says the line itself)."""

from __future__ import annotations

import math
import multiprocessing
import time
from typing import Callable

__all__ = ["Progress", "duration"]


def duration(t: float) -> str:
    """A time in seconds with the unit its size reads best in (``41.3 ms``, ``2.35 s``,
    ``231 s``); every step time the search says goes through here."""
    t = float(t)
    if abs(t) < 1:
        return f"{t * 1e3:.3f} ms" if abs(t) < 1e-3 else f"{t * 1e3:.1f} ms"
    return f"{t:.2f} s" if abs(t) < 60 else f"{t:,.0f} s"


class Progress:
    """Counts the candidates of one phase priced so far and the fastest that fits, and
    says a line when ``every`` seconds have passed since the last (0: at every chance;
    None: never). ``shared``: the counters live in shared memory, for forked workers."""

    def __init__(self, phase: str, items: list, every: float | None, say: Callable[[str], None] | None,
                 shared: bool = False):
        self.phase, self.items, self.total = phase, items, len(items)
        self.every = None if say is None else every
        self.say = say
        self.shared = shared and self.every is not None
        self.start = self.last = time.monotonic()
        self.said = 0  # lines said
        self.seen = -1  # the count at the last line
        if self.shared:
            ctx = multiprocessing.get_context("fork")
            self._index = {c: i for i, c in enumerate(items)}
            self._done, self._best, self._at = ctx.Value("q", 0), ctx.Value("d", math.inf), ctx.Value("q", -1)
        else:
            self._done_n, self._best_t, self._best_c = 0, math.inf, None

    # ---------------------------------------------------------------- the pricing side
    def priced(self, candidate, q) -> None:
        """One candidate priced (``q``: its Priced, or the rule's sentence that refused it)."""
        if self.every is None:
            return
        fits = getattr(q, "fits", False)
        t = q.step_time if fits else math.inf
        if self.shared:
            with self._done.get_lock():
                self._done.value += 1
                if t < self._best.value:
                    self._best.value, self._at.value = t, self._index[candidate]
            return
        self._done_n += 1
        if t < self._best_t:
            self._best_t, self._best_c = t, candidate
        self.tell()

    # ---------------------------------------------------------------- the saying side
    def state(self) -> tuple[int, float, object]:
        """(candidates priced, the fastest fitting step time, its candidate or None)."""
        if self.shared:
            with self._done.get_lock():
                done, best, at = self._done.value, self._best.value, self._at.value
            return done, best, (self.items[at] if at >= 0 else None)
        return self._done_n, self._best_t, self._best_c

    def line(self) -> str:
        done, best, c = self.state()
        pct = 100 * done // self.total if self.total else 100
        text = (f"search: {self.phase} {done:,} of {self.total:,} candidates ({pct}%), "
                f"{time.monotonic() - self.start:.0f} s")
        if c is not None:
            text += f"; fastest that fits so far {duration(best)} a step: {c.label()}"
        return text

    def tell(self, final: bool = False) -> None:
        """Say the line if it is due (``final``: the phase is over; said when any line
        was, or at every chance, so that a phase that was reported ends with its total)."""
        if self.every is None:
            return
        now = time.monotonic()
        done = self.state()[0]
        # every > 0: a line each period, moved or not (a slow candidate is no silence); 0: when the count moved
        due = now - self.last >= self.every and (self.every > 0 or done != self.seen)
        if final:
            due = done != self.seen and (self.said > 0 or self.every == 0)
        if due:
            self.say(self.line())
            self.last, self.seen, self.said = now, done, self.said + 1

    def poll(self) -> float:
        """Seconds the waiting side sleeps between looks."""
        return 1.0 if self.every is None else min(max(self.every, 0.05), 1.0)
