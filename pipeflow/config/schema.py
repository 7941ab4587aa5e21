"""Typed schemas for the Hydra config groups, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` starts from one of these schemas
(``defaults: [/schema/..., _self_]``), so a misspelt key in a file or on the command line
fails at composition time instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from pipeflow.formats.settings import AdamWConfig, LocalRuntimeConfig, NoLoggerConfig, TrainerConfig, WandbLoggerConfig
from pipeflow.planning.cost_models import COST_MODELS
from pipeflow.schedules.registry import specs
from pipeflow.topology.presets import PRESETS

from .assembly import PLANNED_SPEC  # noqa: F401 - registers schedule=planned before the schemas are derived
from .apphelp import register_help
from .derive import cost_schema, topology_schema, schedule_schema
from .groups.model import HFModelConfig, ModelConfig
from .groups.pipeline import PipelineConfig
from .values import CONF_DIR  # noqa: F401 - where the apps compose from




# ----------------------------------------------------------------------------- schemas








@dataclass
class SimulateConfig:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    schedule: Any = MISSING  # typed by the schedule's own schema (schedule_schema)
    model: Any = MISSING  # GPT/BERT options compose /schema/model, HF decoders /schema/model_hf; a CBM: cbm_shape
    # Typed by the option's own schema (cost/unit and cost/analytic differ), hence Any.
    topology: Any = MISSING
    cost: Any = MISSING
    export: Optional[str] = None  # torch_csv: also write schedule.csv
    draw: Union[bool, str] = "auto"  # timeline.png: auto (when it can be read), true (always), false (never)
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (config.groups.precision): bytes per element, the devices' peak
    compile: bool = False  # each transformer block compiled on its own (config.groups.compile): not priced yet
    logger: Any = MISSING  # logger/none (simulate.yaml's default) or logger/wandb: one W&B run per job












@dataclass
class TrainConfig:
    # The default pipeline is small enough for two CPU ranks; train.yaml spells it out.
    pipeline: PipelineConfig = field(
        default_factory=lambda: PipelineConfig(stages=2, microbatches=4, microbatch_size=4)
    )
    schedule: Any = MISSING  # typed by the schedule's own schema (schedule_schema)
    # GPT and BERT options compose /schema/model themselves (so a misspelt key still
    # fails); a concurrent-branch model has two branches and is checked by cbm_shape
    model: Any = MISSING
    # data and partition options carry their own keys (pipeflow.data, planning.partitioners)
    data: Any = MISSING
    partition: Any = MISSING
    topology: Any = MISSING
    optim: AdamWConfig = MISSING
    runtime: LocalRuntimeConfig = MISSING
    logger: Any = MISSING  # logger/wandb and logger/none differ
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # auto | fp32 | bf16 | fp16 (config.groups.precision): the autocast dtype; fp32 master weights and optimizer state
    precision: str = "auto"
    compile: bool = False  # each transformer block compiled on its own (config.groups.compile)
    resume: Optional[str] = None  # a previous run dir to continue from (its latest checkpoint)
    export: Optional[str] = None  # hf: the trained hf_causal model as a Hugging Face folder (<run>/hf)
    seed: int = 1234


# Schemas by their ConfigStore path. They live under schema/ rather than beside the
# options they type, so `--help` and `cost=...` list only real options; an option
# file pulls its schema in with `defaults: [/schema/<group>/<option>@_here_, _self_]`.
SCHEMAS: dict[str, type] = {
    "schema/simulate": SimulateConfig,
    "schema/train": TrainConfig,
    "schema/optim/adamw": AdamWConfig,
    "schema/runtime/local": LocalRuntimeConfig,
    "schema/logger/wandb": WandbLoggerConfig,
    "schema/logger/none": NoLoggerConfig,
    **{f"schema/schedule/{spec.name}": schedule_schema(spec) for spec in specs()},
    "schema/model": ModelConfig,
    "schema/model_hf": HFModelConfig,
    **{f"schema/cost/{name}": cost_schema(name) for name in COST_MODELS},
    **{f"schema/topology/{preset}": topology_schema(preset) for preset in PRESETS},
}


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore and the help page's resolvers in OmegaConf;
    call before composing (idempotent)."""
    register_help()
    cs = ConfigStore.instance()
    for path, node in SCHEMAS.items():
        group, name = path.rsplit("/", 1)
        cs.store(group=group, name=name, node=node)


def compose(config_name: str = "simulate", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a config from ``conf/`` outside ``@hydra.main`` (tests, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))
