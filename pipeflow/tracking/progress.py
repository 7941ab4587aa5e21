"""The console progress bar of a training run (rank 0): step, loss, tokens per second."""

from __future__ import annotations

import sys


class Progress:
    """A tqdm bar over ``total`` steps, starting at ``initial`` (a resumed run's step).

    ``enabled=None`` shows it only when stderr is a terminal: in logs and CI a bar
    redrawn every step is noise, and metrics.jsonl already holds every number.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.enabled = bool(enabled)
        self._bar = None
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Move the bar to ``step`` steps done (1 after the first step) and show the
        latest loss and throughput."""
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
