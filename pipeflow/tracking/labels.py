"""W&B labels of a Hydra job (group, tags, run name), shared by the apps so that a multirun
is one W&B group with one tagged run per job."""

from __future__ import annotations

import re
from pathlib import Path

from hydra.types import RunMode
from omegaconf import DictConfig

_W_AND_B_TAG_LIMIT = 64  # characters; W&B rejects longer tags


def logger_labels(logger: DictConfig, hydra_cfg: DictConfig) -> dict:
    """W&B group, tags and run name for this job: the config's, else, in a multirun, a group
    per sweep (``<sweep file or app>-<date>_<time>``), the job's overrides as tags and its
    folder as name."""
    if logger.name != "wandb":
        return {}
    group, tags, run_name = logger.group, list(logger.tags), logger.run_name
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep = Path(hydra_cfg.sweep.dir)
        # outputs/multirun/train/<date>/<time> -> "<date>_<time>"
        stamp = "_".join(sweep.parts[-2:]) if re.fullmatch(r"\d{4}-\d{2}-\d{2}", sweep.parent.name) else sweep.name
        group = group or f"{hydra_cfg.job.get('config_name') or hydra_cfg.job.name}-{stamp}"
        # the overrides that vary across the sweep are what tells its runs apart; how the
        # run is logged (logger=wandb, logger.mode=...) and Hydra's own keys do not
        tags += [o for o in hydra_cfg.overrides.task if not _is_logging_override(o)]
        run_name = run_name or Path(hydra_cfg.runtime.output_dir).name
    tags = list(dict.fromkeys(t[:_W_AND_B_TAG_LIMIT] for t in tags))
    return {"group": group, "tags": tags, "run_name": run_name}


def _is_logging_override(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return key == "logger" or key.startswith(("logger.", "hydra."))
