"""The check that spans every group: no key a schema lacks. Each group's own checks live
with the group (:mod:`pipeflow.config.groups`).
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from .values import ConfigError


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse a key no schema has, however it was written (``+trainer.stepz=5``,
    ``++pipeline.data_parallel=2``, or in a YAML): Hydra adds a forced key to a typed
    group without complaint, and nothing would read it. Untyped groups (data, partition,
    a user's schedule) check their own keys, and so does the schedule: its sentence lists
    the schedule's own options (:func:`pipeflow.config.assembly.schedule_options`)."""

    def walk(node: DictConfig, path: str) -> None:
        kind = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(kind):
            fields = [f.name for f in dataclasses.fields(kind)]
            for key in node.keys():
                if key not in fields:
                    where = path.rstrip(".") or "the config"
                    value = node.get(key)
                    raise ConfigError(f"{path}{key}={value}: unknown key; {where} has {', '.join(fields)}")
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, DictConfig) and f"{path}{key}" != "schedule":
                walk(child, f"{path}{key}.")

    walk(cfg, "")


EXPORTS = ("hf",)


def check_export(export, family: str) -> None:
    """``export`` is null or ``hf``, and ``hf`` only for a Hugging Face decoder."""
    if export is None:
        return
    if export not in EXPORTS:
        raise ConfigError(f"export={export}: allowed values: {', '.join(EXPORTS)} (or null)")
    if family != "hf_causal":
        raise ConfigError(f"export={export}: model.family={family} is no Hugging Face decoder; a folder that "
                          f"transformers loads is written for model.family=hf_causal (llama_tiny, qwen2_tiny, ...)")
