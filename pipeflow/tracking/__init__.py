"""Tracking of runs: one metrics sink (local JSONL + Weights & Biases, measured
timelines, the final summary) and the console progress bar of training runs; the W&B
labels of a Hydra job (:mod:`.labels`) and a simulated run as one W&B run
(:mod:`.simulated`), imported from their modules since they need Hydra.

Light: torch is never imported here, and wandb and tqdm only when a sink or a visible bar
needs them.
"""

from .progress import Progress
from .sink import MetricsSink, flat_scalars, read_metrics, resolve_wandb_mode, wandb_credentials

__all__ = ["MetricsSink", "Progress", "flat_scalars", "read_metrics", "resolve_wandb_mode", "wandb_credentials"]
