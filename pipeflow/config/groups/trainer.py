"""The ``trainer`` group of pipeflow-train: steps, logging, validation, checkpoints, the timed step."""

from __future__ import annotations


from omegaconf import DictConfig

from ..values import at_least


def check_trainer(trainer: DictConfig) -> None:
    at_least("trainer.steps", trainer.steps, 1)
    at_least("trainer.log_every", trainer.log_every, 1)
    at_least("trainer.val_every", trainer.val_every, 0)  # 0: never
    at_least("trainer.val_batches", trainer.val_batches, 1 if trainer.val_every > 0 else 0)
    at_least("trainer.save_every", trainer.save_every, 0)  # 0: only the final checkpoint
    if trainer.timeline_step is not None:
        at_least("trainer.timeline_step", trainer.timeline_step, 1)  # steps count from 1
