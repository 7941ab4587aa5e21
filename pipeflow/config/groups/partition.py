"""The ``partition`` group's profiled cut: its memory limit and profile, checked before any
rank starts."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from pipeflow.planning.transformer import TransformerSpec

from ..values import ConfigError, naming_key, number

def check_profiled_partition(part: DictConfig, spec: TransformerSpec, num_stages: int) -> None:
    """partition=profiled: a memory limit in bytes, and a profile file that fits the model
    (null: pipeflow-train profiles before launching); with a file, the split is computed
    now, so a memory limit nothing fits stops the run here."""
    limit, path = part.get("memory_limit"), part.get("profile")
    if limit is not None:
        number("partition.memory_limit", limit, "must be a number of bytes > 0, or null for no limit",
                isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0)
    if path is None:
        return
    from pipeflow.planning.partitioners import partition_layers

    try:
        partition_layers("profiled", spec, num_stages, {"profile": str(Path(path).expanduser()), "memory_limit": limit})
    except ValueError as err:
        msg = str(err)
        raise (ConfigError(msg) if msg.startswith("partition.") else naming_key("partition.profile", path, err)) from None
