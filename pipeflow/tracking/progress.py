"""Rank 0's account of a training run as it goes (step, loss, tokens per second): a tqdm bar
on a terminal, else a plain line at the first step, at most every ``every`` seconds and at
the last; the same lines, time-stamped, to the run folder's ``train.log``."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path


def stamp() -> str:
    """The time stamp of a train.log line (the launcher's lines use the same)."""
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S")


class Progress:
    """Progress over ``total`` steps from ``initial`` (a resumed run's step); ``enabled=None``:
    the bar only when stderr is a terminal; ``log``: the file the lines go to (None: none)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool | None = None, log: str | Path | None = None,
                 every: float = 10.0) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.enabled = bool(enabled)
        self.total, self.every = int(total), float(every)
        self.log = Path(log) if log is not None else None
        self._bar = None
        self._start = time.monotonic()
        self._last_line = None  # when the last plain line was printed
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        elapsed = time.monotonic() - self._start
        return f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  {elapsed:.0f} s"

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Move to ``step`` steps done (1 after the first step) and show the latest loss
        and throughput."""
        now = time.monotonic()
        due = self._last_line is None or now - self._last_line >= self.every or step >= self.total
        if due:
            self._last_line = now
            text = self.line(step, loss, tokens_per_s)
            if self.log is not None:
                try:
                    with open(self.log, "a", encoding="utf-8") as f:
                        f.write(f"[{stamp()}] {text}\n")
                except OSError:
                    self.log = None  # the run goes on; its metrics.jsonl has every number
            if self._bar is None:
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
