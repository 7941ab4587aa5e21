"""The ``logger`` group of every app: W&B (offline by default without credentials) or none."""

from __future__ import annotations


from omegaconf import DictConfig

from ..values import ConfigError

LOGGERS = ("wandb", "none")

LOGGER_MODES = ("auto", "offline", "online", "disabled")


def check_logger(logger: DictConfig) -> None:
    """``logger.*`` of any app (train, simulate, plan): a known logger and W&B mode, and
    credentials when online is asked for explicitly. Raises ConfigError naming the key."""
    if logger.name not in LOGGERS:
        raise ConfigError(f"logger.name={logger.name}: unknown logger; allowed values: {', '.join(LOGGERS)}")
    if logger.name != "wandb":
        return
    if logger.mode not in LOGGER_MODES:
        raise ConfigError(f"logger.mode={logger.mode}: unknown W&B mode; allowed values: {', '.join(LOGGER_MODES)}")
    if logger.mode == "online":
        # Caught here, since in rank 0 it would only surface after every rank has started.
        from pipeflow.tracking.sink import wandb_credentials

        found, why = wandb_credentials()
        if not found:
            raise ConfigError(
                f"logger.mode=online: {why}; run `wandb login` (or set WANDB_API_KEY), "
                f"or use logger.mode=offline or auto"
            )
