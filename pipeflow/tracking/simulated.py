"""A simulated run (pipeflow-simulate, pipeflow-plan) as one W&B run through
:class:`pipeflow.tracking.sink.MetricsSink`, once the app has written its files."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .labels import logger_labels
from .sink import MetricsSink


def log_simulated_run(cfg: DictConfig, hydra_cfg: DictConfig, run_dir: str | os.PathLike, summary: dict,
                      caption: str = "") -> None:
    """Log the finished job in ``run_dir`` to W&B: ``cfg`` (with :func:`logger_labels`' labels of
    ``hydra_cfg``) as the run config, its timeline.png (when ``summary["files"]`` lists one) as
    ``timeline`` with ``caption``, ``summary`` (the app's summary.json) as the run summary."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["logger"].update(logger_labels(cfg.logger, hydra_cfg))
    with MetricsSink(str(run_dir), plain, plain["logger"]) as sink:
        if "timeline.png" in summary.get("files", []):
            sink.log_image("timeline", Path(run_dir) / "timeline.png", caption)
        sink.finish(summary)
