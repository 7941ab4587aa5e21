"""A simulated run (pipeflow-simulate, pipeflow-plan) as one W&B run.

The apps write their files first (summary.json, timeline.json/png, ...); with
``logger=wandb`` the job then becomes one W&B run through :class:`MetricsSink`: the
resolved config as the run config, the timeline picture as an image, the summary's
scalars as the run summary. Simulated runs log no steps, so they have no metrics.jsonl.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .labels import logger_labels
from .sink import MetricsSink


def log_simulated_run(cfg: DictConfig, hydra_cfg: DictConfig, run_dir: str | os.PathLike, summary: dict,
                      caption: str = "") -> None:
    """Log the finished job in ``run_dir`` to W&B: ``cfg`` resolved, with the group, tags
    and run name :func:`logger_labels` gives the job ``hydra_cfg``, as the run config;
    the job's timeline.png, when its ``summary["files"]`` lists one, under the key
    ``timeline`` with ``caption``; ``summary`` as the run summary. ``summary`` is the
    app's summary.json, which the sink writes again as it is."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["logger"].update(logger_labels(cfg.logger, hydra_cfg))
    with MetricsSink(str(run_dir), plain, plain["logger"]) as sink:
        if "timeline.png" in summary.get("files", []):
            sink.log_image("timeline", Path(run_dir) / "timeline.png", caption)
        sink.finish(summary)
