"""The one metrics sink of a training run (:class:`MetricsSink`, rank 0's): the run directory
always (``metrics.jsonl``, one line per :meth:`MetricsSink.log`; ``timeline.json`` /
``timeline.png``; ``summary.json``), Weights & Biases when asked. W&B never prompts:
``logger.mode=auto`` goes online only with credentials configured, and an explicit
``WANDB_MODE`` decides for ``auto``."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from pipeflow.faults import WriteFailed
from pipeflow.formats.files import Lines, write_aside

__all__ = ["MetricsSink", "flat_scalars", "read_metrics", "resolve_wandb_mode", "wandb_credentials"]

# WANDB_MODE values wandb accepts besides its own modes, as the modes they mean
_WANDB_MODE_ALIASES = {"dryrun": "offline", "run": "online"}


def wandb_credentials() -> tuple[bool, str]:
    """(found, why not): whether W&B credentials are configured here, asking wandb itself,
    without network or prompting."""
    import wandb

    # wandb.setup starts wandb's service and advertises it to child processes through
    # WANDB_SERVICE; a check made in the launcher must not leave that behind for the ranks.
    had_service = "WANDB_SERVICE" in os.environ
    try:
        # silent: otherwise login() prints a greeting that looks the user up on the server
        wandb.setup(settings=wandb.Settings(silent=True))
        if wandb.login(prompt=False, verify=False):
            return True, ""
        return False, "no W&B API key is configured"
    except wandb.errors.AuthenticationError as err:  # a key is set but malformed
        return False, f"the configured W&B credentials are unusable ({err})"
    finally:
        if not had_service:
            wandb.teardown()


def resolve_wandb_mode(mode: str) -> str:
    """``logger.mode`` as the mode to give ``wandb.init``: auto -> WANDB_MODE when set,
    else online with credentials, else offline. An explicit mode is kept as it is."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        return _WANDB_MODE_ALIASES.get(env, env)
    return "online" if wandb_credentials()[0] else "offline"


def flat_scalars(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Numbers, strings and booleans of a nested mapping, keys joined with '/' (W&B
    groups panels by that prefix); lists and other values are left out."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        value = _plain(value)
        if isinstance(value, Mapping):
            out.update(flat_scalars(value, name + "/"))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
    return out


def _plain(value: Any) -> Any:
    """0-d tensors and numpy scalars as Python numbers, paths as strings."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _json_default(value: Any) -> Any:
    plain = _plain(value)
    if plain is value:
        if hasattr(value, "tolist"):
            return value.tolist()
        return str(value)
    return plain


class MetricsSink:
    """Metrics of one run, to ``run_dir/metrics.jsonl`` and (``logger.name=wandb``) W&B.
    ``config``: the resolved config (W&B's run config); ``logger_cfg``: ``config["logger"]``;
    ``resume_step`` > 0: the lines of an existing metrics.jsonl past it are dropped."""

    def __init__(self, run_dir: str, config: dict, logger_cfg: dict, resume_step: int = 0) -> None:
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WriteFailed(self.run_dir, err) from None
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if resume_step > 0 and self.metrics_path.exists():
            self._truncate_after(resume_step)
        self._file = Lines(self.metrics_path)  # created by the first log()
        self._last_step = resume_step
        self._finished = False
        self.wandb_run = None
        self.wandb_mode = "disabled"
        self._owns_wandb_service = False
        if logger_cfg.get("name") == "wandb":
            self._start_wandb(config, logger_cfg)

    def _truncate_after(self, step: int) -> None:
        kept = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut short by the crash that made the resume necessary
        write_aside(self.metrics_path, "".join(f"{line}\n" for line in kept))

    def _start_wandb(self, config: dict, logger_cfg: dict) -> None:
        asked = str(logger_cfg.get("mode", "auto"))
        self.wandb_mode = resolve_wandb_mode(asked)
        if self.wandb_mode == "disabled":
            return
        import wandb

        # A service this sink starts, it stops (see _close); one it found running, it leaves.
        self._owns_wandb_service = "WANDB_SERVICE" not in os.environ
        settings = wandb.Settings(
            silent=True,
            console="off",  # the runtime's stdout is not the run's record; metrics.jsonl is
            # The system-metrics sampler is another process competing with the CPU ranks
            # for cores, which would disturb the very step times being measured.
            x_disable_stats=True,
            disable_job_creation=True,
            save_code=False,
        )
        kwargs = dict(
            project=logger_cfg.get("project") or "pipeflow",
            entity=logger_cfg.get("entity"),
            group=logger_cfg.get("group"),
            tags=list(logger_cfg.get("tags") or []),
            name=logger_cfg.get("run_name"),
            config=config,
            dir=str(self.run_dir),  # wandb/offline-run-* inside the run directory
            settings=settings,
        )
        try:
            self.wandb_run = wandb.init(mode=self.wandb_mode, **kwargs)
        except wandb.errors.Error as err:
            if asked != "auto" or self.wandb_mode != "online":
                raise
            # Logged in but the server is out of reach (no network, a firewall): auto
            # means "online if possible", so the run goes on offline rather than failing.
            sys.stderr.write(
                f"W&B could not start online ({str(err).splitlines()[0]}); logging offline to "
                f"{self.run_dir / 'wandb'}, upload later with `wandb sync`\n"
            )
            self.wandb_mode = "offline"
            self.wandb_run = wandb.init(mode="offline", **kwargs)

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: dict) -> None:
        """One line ``{"step": step, **metrics}`` in metrics.jsonl, and the same to W&B."""
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        from .record import strict

        # strict JSON: a non-finite number (a diverged loss) is null, not NaN; a line is
        # written whole or not at all (a full disk: WriteFailed names the file), and
        # reaches the file at once, so a crashed run keeps every step it logged
        self._file.append(json.dumps(strict(row), default=_json_default))
        self._last_step = max(self._last_step, int(step))
        if self.wandb_run is not None:
            with self._writing_wandb():
                self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=int(step))

    @contextlib.contextmanager
    def _writing_wandb(self):
        """W&B writes its run's files under run_dir/wandb (offline, and online as a
        cache): a failure to write them (a full disk) is said naming that folder."""
        try:
            yield
        except OSError as err:
            raise WriteFailed(self.run_dir / "wandb", err) from None

    def log_timeline(self, timeline, step: int) -> None:
        """Write the measured ``timeline`` of ``step`` as run_dir/timeline.json and
        timeline.png, and show the picture in W&B."""
        from pipeflow.sim.gantt import draw_timeline

        meta = timeline.meta or {}
        sizes = [f"{timeline.num_devices} devices"]
        if "num_microbatches" in meta:
            sizes.append(f"m={meta['num_microbatches']}")
        title = f"{meta.get('schedule', 'pipeline')}: {', '.join(sizes)}, step {step}, {timeline.source}"
        timeline.save(self.run_dir / "timeline.json")
        png = draw_timeline(timeline, self.run_dir / "timeline.png", title=title)
        self.log_image("timeline", png, title, step)

    def log_image(self, key: str, path: str | os.PathLike, caption: str, step: int = 0) -> None:
        """Show the picture at ``path`` (already in the run directory) in W&B as ``key``;
        nothing to do without W&B."""
        if self.wandb_run is not None:
            import wandb

            # W&B drops rows logged at a step lower than one already logged
            with self._writing_wandb():
                self.wandb_run.log({key: wandb.Image(str(path), caption=caption)},
                                   step=max(int(step), self._last_step))

    def finish(self, summary: dict, exit_code: int = 0) -> None:
        """Write run_dir/summary.json, put its scalars in the W&B run summary, close
        (``exit_code`` non-zero: W&B marks the run failed; an interrupted run's is 1)."""
        from .record import write_summary

        try:
            write_summary(self.run_dir, summary, default=_json_default)  # whole or not at all, on a full disk too
        except OSError:
            self.close(exit_code=1)
            raise
        if self.wandb_run is not None:
            with self._writing_wandb():
                self.wandb_run.summary.update(flat_scalars(summary))
        self.close(exit_code=exit_code)

    def close(self, exit_code: int) -> None:
        """Close metrics.jsonl and finish the W&B run (flushed for ``wandb sync``); a second call
        does nothing. A failed run's close (``exit_code`` non-zero) raises nothing of its own."""
        if self._finished:
            return
        self._finished = True
        self._file.close()
        if self.wandb_run is None:
            return
        try:
            with self._writing_wandb():
                self.wandb_run.finish(exit_code=exit_code)
                if self._owns_wandb_service:
                    import wandb

                    # finish() may return before wandb's service has written the run file,
                    # and the atexit hook that would wait for it does not run in a rank
                    # started by multiprocessing; stopping the service waits for the flush.
                    wandb.teardown()
        except WriteFailed:
            if exit_code == 0:
                raise

    # A run that dies between start and finish still closes its files, and W&B marks it
    # failed rather than leaving it "running" forever.
    def __enter__(self) -> "MetricsSink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of a run's metrics.jsonl, in order (lines cut short by a crash skipped)."""
    rows = []
    path = Path(run_dir) / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows

