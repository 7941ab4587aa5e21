"""Tracking of runs: the metrics sink (JSONL, W&B, measured timelines, the summary) and the
progress bar; :mod:`.labels` and :mod:`.simulated` need Hydra and are imported from their
modules. Torch is never imported; wandb and tqdm only when needed."""

from .progress import Progress
from .sink import MetricsSink, flat_scalars, read_metrics, resolve_wandb_mode, wandb_credentials

__all__ = ["MetricsSink", "Progress", "flat_scalars", "read_metrics", "resolve_wandb_mode", "wandb_credentials"]
