"""Typed schemas for the Hydra config groups, and the up-front check of a composed config.

Every YAML file under ``conf/`` starts from one of the schemas registered here
(``defaults: [/schema/..., _self_]``), so a misspelt key in a file or on the command line
fails at composition time instead of being silently ignored. Value ranges and
combinations that a type cannot express (an unknown schedule, Chimera on an odd number
of stages, more stages than layers) are caught by :func:`prepare_simulation` before
any work starts, with one sentence that names the key and the allowed values.
"""

from __future__ import annotations

import collections.abc
import inspect
import re
import types
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from pipeflow.planning.cost import COST_MODELS, CostModel, build_cost_model, cost_params
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.export import check_exportable
from pipeflow.schedules.ir import Schedule
from pipeflow.schedules.registry import build_schedule
from pipeflow.topology.presets import PRESETS, build_topology
from pipeflow.topology.topology import Topology

# conf/ sits next to the package in the repository; an editable install finds it there.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

EXPORT_FORMATS = ("torch_csv",)


class ConfigError(ValueError):
    """A configuration that cannot run. The message is one sentence naming the key."""


# ----------------------------------------------------------------------------- schemas


@dataclass
class PipelineConfig:
    stages: int = 4  # pipeline depth p (devices of one pipeline)
    microbatches: int = 8  # m per iteration
    virtual_stages: int = 1  # model chunks per device (interleaved_1f1b)
    segments: int = 1  # sequence segments per microbatch (Seq1F1B)
    microbatch_size: int = 1  # sequences per microbatch


@dataclass
class ScheduleConfig:
    name: str = MISSING  # one of pipeflow.schedules.registry.schedule_names()


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = "gpt"  # gpt | bert
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    n_inner: Optional[int] = None  # FFN width; None means 4 * n_embd
    vocab_size: int = MISSING
    n_positions: int = MISSING
    seq_len: int = MISSING


def _config_type(hint: Any) -> Any:
    """A parameter's type as OmegaConf understands it, always Optional: null keeps the
    default (build_topology and build_cost_model drop null keys)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) in (list, tuple, collections.abc.Sequence):
        hint = List[typing.get_args(hint)[0]]
    return Optional[hint]


def _schema_from_signature(class_name: str, option: str, fn: Any, skip: Sequence[str] = ()) -> type:
    """A schema with ``name`` plus the keyword parameters of ``fn``, their types and
    defaults. Presets and cost models keep their parameters in their own signatures,
    so deriving the schema from them means the two cannot drift apart."""
    hints = typing.get_type_hints(fn)
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=option))]
    for param in inspect.signature(fn).parameters.values():
        if param.name == "self" or param.name in skip:
            continue
        fields.append((param.name, _config_type(hints[param.name]), param.default))
    return make_dataclass(class_name, fields)


def _topology_schema(preset: str) -> type:
    """``conf/topology/<preset>.yaml``: the preset's parameters, plus ``num_devices``
    (cut the preset to its first N devices; local_cpu: how many ranks)."""
    schema = _schema_from_signature(f"{_camel(preset)}TopologyConfig", preset, PRESETS[preset], skip=("num_devices",))
    return make_dataclass(schema.__name__, [("num_devices", Optional[int], None)], bases=(schema,))


def _cost_schema(name: str) -> type:
    """``conf/cost/<name>.yaml``: the cost model's parameters; the stage count, model and
    microbatch size come from the run, not from this group."""
    init = COST_MODELS[name].__init__
    from_run = [p for p in inspect.signature(init).parameters if p not in cost_params(name)]
    return _schema_from_signature(f"{_camel(name)}CostConfig", name, init, skip=from_run)


def _camel(name: str) -> str:
    return name.title().replace("_", "")


@dataclass
class SimulateConfig:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    schedule: ScheduleConfig = MISSING
    model: ModelConfig = MISSING
    # Typed by the option's own schema (cost/unit and cost/analytic differ), hence Any.
    topology: Any = MISSING
    cost: Any = MISSING
    export: Optional[str] = None  # torch_csv: also write schedule.csv
    draw: bool = True  # write timeline.png


# Schemas by their ConfigStore path. They live under schema/ rather than beside the
# options they type, so `--help` and `cost=...` list only real options; an option
# file pulls its schema in with `defaults: [/schema/<group>/<option>@_here_, _self_]`.
SCHEMAS: dict[str, type] = {
    "schema/simulate": SimulateConfig,
    "schema/schedule": ScheduleConfig,
    "schema/model": ModelConfig,
    **{f"schema/cost/{name}": _cost_schema(name) for name in COST_MODELS},
    **{f"schema/topology/{preset}": _topology_schema(preset) for preset in PRESETS},
}


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore; call before composing (idempotent)."""
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


# ------------------------------------------------------------------------------ checks


def _naming_key(key: str, value: Any, err: Exception) -> ConfigError:
    """Wrap a lower layer's ValueError so the sentence names a config key."""
    msg = str(err).strip()
    if re.search(r"\b(pipeline|schedule|model|topology|cost|export)\.\w+", msg):  # e.g. "topology.nodes=0: ..."
        return ConfigError(msg)
    return ConfigError(f"{key}={value}: {msg}")


def devices_needed_for(cfg: DictConfig) -> str:
    """Why the schedule needs its device count, for the topology's too-small error."""
    return f"schedule.name={cfg.schedule.name} with pipeline.stages={cfg.pipeline.stages}"


@dataclass
class SimulationInputs:
    """What a simulate config composes into; built once by :func:`prepare_simulation`."""

    schedule: Schedule  # generated, not yet validated
    spec: TransformerSpec
    cost: CostModel
    topology: Topology


def prepare_simulation(cfg: DictConfig) -> SimulationInputs:
    """Build the schedule, model shape, cost model and topology a config names, or raise
    ConfigError, one sentence naming the key and the allowed values. Nothing is
    simulated or written, so a bad config fails before any work."""
    if cfg.export is not None and cfg.export not in EXPORT_FORMATS:
        raise ConfigError(f"export={cfg.export}: unknown format; allowed values: null, {', '.join(EXPORT_FORMATS)}")

    pipe = cfg.pipeline
    for key in ("stages", "microbatches", "virtual_stages", "segments", "microbatch_size"):
        value = pipe[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"pipeline.{key}={value}: must be a whole number >= 1")

    # The schedule's own size rules (even stages for Chimera, ...) live with the
    # generators; generating is cheap, validating is not needed to learn the sizes.
    try:
        schedule = build_schedule(
            cfg.schedule.name, pipe.stages, pipe.microbatches, pipe.virtual_stages, pipe.segments, check=False
        )
    except ScheduleConfigError as err:
        raise ConfigError(str(err)) from None

    try:
        spec = TransformerSpec.from_config(cfg.model)
    except ValueError as err:
        raise _naming_key("model", cfg.model.name, err) from None
    if schedule.num_stages > spec.n_layer:
        # each stage needs at least one layer; interleaving puts several stages on a device
        per_device = max(1, schedule.num_stages // pipe.stages)
        via = f" ({pipe.stages} x pipeline.virtual_stages={per_device})" if per_device > 1 else ""
        raise ConfigError(
            f"pipeline.stages={pipe.stages}: the schedule splits the model into {schedule.num_stages} stages{via}, "
            f"but model '{cfg.model.name}' has only {spec.n_layer} layers (model.n_layer); "
            f"allowed values: 1..{spec.n_layer // per_device}"
        )

    try:
        cost = build_cost_model(cfg.cost, schedule.num_stages, spec, pipe.microbatch_size)
    except ValueError as err:
        raise _naming_key("cost", cfg.cost.name, err) from None

    try:
        topology = build_topology(cfg.topology, schedule.num_devices, needed_for=devices_needed_for(cfg))
    except ValueError as err:
        raise _naming_key("topology", cfg.topology.name, err) from None

    if cfg.export == "torch_csv":
        try:
            check_exportable(schedule)
        except ValueError as err:
            raise ConfigError(f"export=torch_csv: {err}") from None
    return SimulationInputs(schedule, spec, cost, topology)
