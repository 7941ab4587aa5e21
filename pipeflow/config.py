"""Typed schemas for the Hydra config groups, and the up-front check of a composed config.

Every YAML file under ``conf/`` starts from one of the schemas registered here
(``defaults: [/schema/..., _self_]``), so a misspelt key in a file or on the command line
fails at composition time instead of being silently ignored. Value ranges and
combinations that a type cannot express (an unknown schedule, Chimera on an odd number
of stages, more stages than layers, a data file that is not there) are caught by
:func:`prepare_simulation` and :func:`prepare_training` before any work starts (for
training: before any rank is spawned), with one sentence that names the key and the
allowed values.
"""

from __future__ import annotations

import collections.abc
import glob
import inspect
import os
import re
import types
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from pipeflow.planning.cost import COST_MODELS, CalibratedCost, CostModel, build_cost_model, cost_params
from pipeflow.planning.partition import PARTITIONERS
from pipeflow.planning.seqsplit import split_sequence
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.export import check_exportable
from pipeflow.schedules.ir import Schedule
from pipeflow.schedules.registry import build_schedule, get_spec, load_spec, register, specs
from pipeflow.schedules.spec import ScheduleSpec
from pipeflow.schedules.validate import validate
from pipeflow.topology.presets import PRESETS, build_topology
from pipeflow.topology.topology import Topology

# conf/ sits next to the package in the repository; an editable install finds it there.
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

EXPORT_FORMATS = ("torch_csv",)

OPTIMIZERS = ("adamw",)
BACKENDS = ("auto", "gloo", "nccl")
RUNTIME_DEVICES = ("auto", "cpu", "cuda")
LOGGERS = ("wandb", "none")
LOGGER_MODES = ("auto", "offline", "online", "disabled")
FAIL_MODES = ("raise", "kill")
# The runtime's stage models (pipeflow.models.gpt, pipeflow.models.bert).
TRAIN_FAMILIES = ("gpt", "bert", "cbm")
# The family whose objective a data set feeds: next-token text for GPT, masked text for
# BERT. A batch of one is meaningless to the other's loss, so the pair is refused early.
DATA_FAMILY = {"text_corpus": "gpt", "mlm_corpus": "bert", "image_text": "cbm"}
# data=auto (the default) picks the data set the model's family trains on
DATA_FOR_FAMILY = {family: data for data, family in DATA_FAMILY.items()}
# text_corpus feeds UTF-8 bytes as tokens (pipeflow.data.text.ByteTokenizer), mlm_corpus
# bytes plus four special ids (pipeflow.data.mlm.MLM_VOCAB); a test keeps these equal to
# the data package's (importing it here would cost torch and datasets)
BYTE_VOCAB = 256
MLM_VOCAB = 260
DATA_VOCAB = {"text_corpus": BYTE_VOCAB, "mlm_corpus": MLM_VOCAB}


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
    dropout: float = 0.0  # read by pipeflow.models; the cost model ignores it


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


def schedule_schema(spec: ScheduleSpec) -> type:
    """``conf/schedule/<name>.yaml``: ``name``, ``generator`` (a user's schedule: the
    import path of its generator or spec), the generator's options and the keys the
    configuration layer reads for it, typed and defaulted from the spec."""
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=spec.name)),
                                          ("generator", Optional[str], None)]
    fields += [(o.name, Optional[o.type], o.default) for o in spec.options.values()]
    fields += [(key, Optional[kind], None) for key, kind in spec.config_keys.items()]
    return make_dataclass(f"Schedule{_camel(spec.name)}Config", fields)


@dataclass
class SimulateConfig:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    schedule: Any = MISSING  # typed by the schedule's own schema (schedule_schema)
    model: Any = MISSING  # GPT/BERT options compose /schema/model; a CBM is checked by cbm_shape
    # Typed by the option's own schema (cost/unit and cost/analytic differ), hence Any.
    topology: Any = MISSING
    cost: Any = MISSING
    export: Optional[str] = None  # torch_csv: also write schedule.csv
    draw: bool = True  # write timeline.png
    logger: Any = MISSING  # logger/none (simulate.yaml's default) or logger/wandb: one W&B run per job


@dataclass
class TrainerConfig:
    steps: int = 300  # optimizer steps (pipeline iterations) of the whole run
    log_every: int = 1  # a metrics.jsonl line every N steps
    val_every: int = 50  # validation loss every N steps; 0: never
    val_batches: int = 4  # batches per validation
    save_every: int = 0  # a checkpoint every N steps; 0: only at the end
    timeline_step: Optional[int] = 5  # the step (1..steps) whose actions are timed into timeline.json/png; null: none


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20  # linear warm-up from 0
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at trainer.steps
    grad_clip: Optional[float] = 1.0  # global gradient-norm clip; null or 0: none


@dataclass
class LocalRuntimeConfig:
    name: str = "local"
    backend: str = "auto"  # auto: nccl when CUDA is available, else gloo
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 60.0  # a collective or P2P op that takes longer fails the run
    master_port: Optional[int] = None  # null: a free port
    threads_per_rank: int = 1  # torch intra-op threads of each rank
    fail_at_step: Optional[int] = None  # test hook: rank fail_rank fails at this step
    fail_rank: Optional[int] = None
    fail_mode: str = "raise"  # raise: a Python error; kill: SIGKILL, as an out-of-memory kill would
    dump_grads: bool = False  # test hook: each rank writes run_dir/grads/rank<r>.pt after its first backward


@dataclass
class WandbLoggerConfig:
    name: str = "wandb"
    project: str = "pipeflow"
    mode: str = "auto"  # auto: WANDB_MODE if set, else online when logged in, else offline
    group: Optional[str] = None  # null: a multirun's jobs share one group named after the sweep
    tags: List[str] = field(default_factory=list)  # a multirun adds each job's overrides
    run_name: Optional[str] = None  # null: a multirun names the run after its job folder
    entity: Optional[str] = None


@dataclass
class NoLoggerConfig:
    name: str = "none"


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
    # data and partition options carry their own keys (pipeflow.data, planning.partition)
    data: Any = MISSING
    partition: Any = MISSING
    topology: Any = MISSING
    optim: AdamWConfig = MISSING
    runtime: LocalRuntimeConfig = MISSING
    logger: Any = MISSING  # logger/wandb and logger/none differ
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resume: Optional[str] = None  # a previous run dir to continue from (its latest checkpoint)
    seed: int = 1234


# schedule=planned: the topology-aware planner's plan (pipeflow.planning.planner) as the
# schedule (1F1B over the planned devices, replicas reduced) and its cut as the partition.
# It needs the run's model and topology, so the configuration layer assembles it.
PLANNED = "planned"


def _assemble_planned(cfg: Any) -> Schedule:
    return planned_schedule(cfg)[0]


PLANNED_SPEC = register(ScheduleSpec(
    PLANNED, None, "the topology-aware planner's partition, device mapping and 1F1B (pipeflow-plan)",
    # plan: a plan.json written by pipeflow-plan (null: plan at start-up for the run's model,
    # topology and microbatches); memory_limit_gb: per device, for that planning
    config_keys={"plan": str, "memory_limit_gb": float}, assemble=_assemble_planned, supports={}), replace=True)


def runtime_schedules() -> list[str]:
    """The schedules pipeflow-train runs: every registered one whose spec says so."""
    return [spec.name for spec in specs() if spec.runtime]


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
    # already naming one, e.g. "topology.nodes=0: ..." or "resume=...: ..."
    if re.search(r"\b(pipeline|schedule|model|topology|cost|export)\.\w+", msg) or msg.startswith(f"{key}="):
        return ConfigError(msg)
    return ConfigError(f"{key}={value}: {msg}")


def devices_needed_for(cfg: DictConfig) -> str:
    """Why the schedule needs its device count, for the topology's too-small error."""
    return f"schedule.name={cfg.schedule.name} with pipeline.stages={cfg.pipeline.stages}"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_pipeline(cfg: DictConfig) -> None:
    pipe = cfg.pipeline
    for key in ("stages", "microbatches", "virtual_stages", "segments", "microbatch_size"):
        value = pipe[key]
        if not _whole(value) or value < 1:
            raise ConfigError(f"pipeline.{key}={value}: must be a whole number >= 1")


def schedule_spec(schedule_cfg: Any) -> ScheduleSpec:
    """The spec of ``schedule.name``; a user's schedule (``schedule.generator``, the
    import path of its generator) is loaded and registered first. Raises ConfigError."""
    name, generator = schedule_cfg["name"], schedule_cfg.get("generator")
    try:
        return load_spec(str(generator), name) if generator else get_spec(name)
    except ScheduleConfigError as err:
        raise ConfigError(str(err)) from None


def schedule_options(schedule_cfg: Any) -> dict:
    """The generator's options as the config gives them (null ones left to the generator's
    defaults), each key checked against the schedule's schema: a key it does not have, or
    a value of the wrong type, raises ConfigError naming the key and the allowed ones.
    ``schedule_cfg`` composed or a plain dict (the ranks call it too)."""
    spec = schedule_spec(schedule_cfg)
    plain = schedule_cfg if isinstance(schedule_cfg, dict) else OmegaConf.to_container(schedule_cfg, resolve=True)
    allowed = spec.keys()
    for key, value in plain.items():
        if key not in ("name", "generator") and key not in allowed:
            raise ConfigError(f"schedule.{key}={value}: schedule '{spec.name}' has no option '{key}'; "
                              + (f"its options: {', '.join(allowed)}" if allowed else "it takes none"))
    try:
        OmegaConf.merge(OmegaConf.structured(schedule_schema(spec)), plain)
    except Exception as err:  # noqa: BLE001 - OmegaConf's validation errors name the key
        key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
        value = plain.get(str(key).rsplit(".", 1)[-1], "?")
        want = spec.options.get(str(key).rsplit(".", 1)[-1])
        kind = (("an " if want.type.__name__[0] in "aeiou" else "a ") + want.type.__name__) if want \
            else "a value of the option's type"
        raise ConfigError(f"schedule.{key}={value}: schedule '{spec.name}' takes {kind} here") from None
    return {k: v for k, v in plain.items() if k in spec.options and v is not None}


def planned_schedule(cfg: Any):
    """schedule=planned: (schedule, plan) from the plan.json in schedule.plan, or from a
    plan made now for the run's model, topology and microbatches. ``cfg`` composed or
    plain dicts (the ranks of pipeflow-train call it too: the planner is deterministic)."""
    from pipeflow.planning.planner import Plan, build_plan_schedule
    from pipeflow.planning.planner import plan as make_plan

    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    pipe, path = cfg.pipeline, cfg.schedule.get("plan")
    limit = cfg.schedule.get("memory_limit_gb")
    if "partition" in cfg and cfg.partition.name not in ("uniform", "planner"):
        raise ConfigError(f"partition.name={cfg.partition.name}: schedule=planned cuts the model as its plan says; "
                          f"allowed values: planner (or the default uniform, which the plan replaces)")
    if path:
        try:
            p = Plan.from_json(Path(str(path)).expanduser().read_text())
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"schedule.plan={path}: not a plan.json written by pipeflow-plan ({err})") from None
    else:
        spec = TransformerSpec.from_config(cfg.model)
        topology = build_topology(cfg.topology, pipe.stages, needed_for=devices_needed_for(cfg))
        try:
            p = make_plan(spec, topology, pipe.microbatches, pipe.microbatch_size,
                          memory_limit_bytes=None if limit is None else float(limit) * 1e9)
        except ValueError as err:
            raise ConfigError(str(err).replace("plan.memory_limit_gb", "schedule.memory_limit_gb")) from None
    used = sorted({d for row in p.pipelines for d in row})
    if used[-1] >= pipe.stages:
        raise ConfigError(f"pipeline.stages={pipe.stages}: the plan places stages on devices {used}; "
                          f"run it with pipeline.stages={used[-1] + 1} devices")
    if sum(p.layers_per_stage) != cfg.model.n_layer:
        raise ConfigError(f"schedule.plan={path}: the plan cuts {sum(p.layers_per_stage)} layers, "
                          f"model.n_layer={cfg.model.n_layer}; plan this model (pipeflow-plan model={cfg.model.name})")
    try:
        schedule = build_plan_schedule(p.device_of_stage, pipe.stages, pipe.microbatches, p.replica_devices)
    except ValueError as err:
        raise ConfigError(f"schedule.plan={path}: {err}") from None
    schedule.name = PLANNED
    schedule.meta["plan"] = p.to_dict()
    return schedule, p


def _generate_schedule(cfg: DictConfig) -> Schedule:
    """The schedule the config names, generated but not validated."""
    pipe = cfg.pipeline
    options = schedule_options(cfg.schedule)
    spec = schedule_spec(cfg.schedule)
    if spec.assemble is not None:
        return spec.assemble(cfg)
    # The schedule's own size rules (even stages for Chimera, ...) live with the
    # generators; generating is cheap, validating is not needed to learn the sizes.
    try:
        return build_schedule(
            cfg.schedule.name, pipe.stages, pipe.microbatches, pipe.virtual_stages, pipe.segments, check=False,
            **options,
        )
    except ScheduleConfigError as err:
        raise ConfigError(str(err)) from None


def _model_spec(cfg: DictConfig, schedule: Schedule) -> TransformerSpec:
    """The model's shape, checked against the number of stages the schedule cuts it into."""
    pipe = cfg.pipeline
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
    return spec


def segment_lengths(cfg: Any) -> list[int] | None:
    """Tokens per sequence segment, first to last, for a segmented schedule (seq1f1b,
    seq1f1b_interleaved): ``pipeline.segments`` segments of ``model.seq_len`` tokens cut
    by ``schedule.split`` (uniform, the default, or compute; :mod:`pipeflow.planning.seqsplit`).
    None for every other schedule. ``cfg`` is the composed config or the same as plain
    dicts (``cfg["schedule"]``, ``cfg["pipeline"]``, ``cfg["model"]``). Raises ConfigError
    naming the key."""
    schedule, pipe, model = cfg["schedule"], cfg["pipeline"], cfg["model"]
    if not schedule_spec(schedule).segments:
        return None
    try:
        spec = TransformerSpec.from_config(model)
    except ValueError as err:
        raise _naming_key("model", model.get("name"), err) from None
    split = schedule.get("split")
    try:
        return split_sequence("uniform" if split is None else split, spec.seq_len, pipe.get("segments", 1), spec)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _simulation_segments(cfg: DictConfig, schedule: Schedule) -> list[int] | None:
    """The segment lengths the cost model prices (None: whole sequences), checked
    against the cost group: analytic takes them as cost.segment_lengths (an explicit
    list there wins, if it has one length per segment), unit prices every segment
    alike, profiled measured whole sequences only."""
    lengths = segment_lengths(cfg)
    if lengths is None:
        return None
    name = cfg.cost.get("name")
    if name == "profiled" and schedule.num_segments > 1:
        raise ConfigError(
            f"pipeline.segments={schedule.num_segments}: cost model 'profiled' measures whole sequences; "
            f"use cost=analytic (or unit) with sequence segments"
        )
    given = cfg.cost.get("segment_lengths")
    if given is not None:
        given = list(given)
        if len(given) != schedule.num_segments:
            raise ConfigError(
                f"cost.segment_lengths={given}: {len(given)} lengths for pipeline.segments={schedule.num_segments}; "
                f"give one per segment, or null for schedule.split's"
            )
        return given
    return lengths


def _build_topology(cfg: DictConfig, schedule: Schedule, cost: CostModel | None = None) -> Topology:
    topo_cfg = cfg.topology
    if isinstance(cost, CalibratedCost) and cfg.topology.name == "local_cpu":
        # the calibrated host: its cores, their contention, and a gloo message's cost
        topo_cfg = {**OmegaConf.to_container(cfg.topology, resolve=True), **cost.host}
    try:
        return build_topology(topo_cfg, schedule.num_devices, needed_for=devices_needed_for(cfg))
    except ValueError as err:
        raise _naming_key("topology", cfg.topology.name, err) from None


@dataclass
class SimulationInputs:
    """What a simulate config composes into; built once by :func:`prepare_simulation`."""

    schedule: Schedule  # generated, not yet validated
    spec: TransformerSpec
    cost: CostModel
    topology: Topology
    segment_lengths: list[int] | None = None  # tokens per sequence segment (segmented schedules)


def prepare_simulation(cfg: DictConfig) -> SimulationInputs:
    """Build the schedule, model shape, cost model and topology a config names, or raise
    ConfigError, one sentence naming the key and the allowed values. Nothing is
    simulated or written, so a bad config fails before any work."""
    if cfg.export is not None and cfg.export not in EXPORT_FORMATS:
        raise ConfigError(f"export={cfg.export}: unknown format; allowed values: null, {', '.join(EXPORT_FORMATS)}")
    _check_pipeline(cfg)
    if cfg.model.get("family") == "cbm":
        schedule, specs = _branched_schedule(cfg)
        spec, lengths = None, None
        cost = _branched_cost(cfg, specs)
    else:
        schedule = _generate_schedule(cfg)
        spec = _model_spec(cfg, schedule)
        lengths = _simulation_segments(cfg, schedule)
        cost_cfg = cfg.cost
        if schedule.name == PLANNED and cfg.cost.name == "analytic":
            cost_cfg = {**OmegaConf.to_container(cfg.cost, resolve=True),
                        "layers_per_stage": list(schedule.meta["plan"]["layers_per_stage"])}
        if lengths is not None and cfg.cost.name == "analytic":
            # the split drives the analytic cost: unequal segments, unequal times and memory
            cost_cfg = {**OmegaConf.to_container(cfg.cost, resolve=True), "segment_lengths": lengths}
        try:
            cost = build_cost_model(cost_cfg, schedule.num_stages, spec, cfg.pipeline.microbatch_size)
        except ValueError as err:
            raise _naming_key("cost", cfg.cost.name, err) from None
    topology = _build_topology(cfg, schedule, cost)
    if cfg.export == "torch_csv":
        try:
            check_exportable(schedule)
        except ValueError as err:
            raise ConfigError(f"export=torch_csv: {err}") from None
    return SimulationInputs(schedule, spec, cost, topology, lengths)


# ---------------------------------------------------------------------------- training


@dataclass
class TrainingInputs:
    """What a train config composes into; built once by :func:`prepare_training`."""

    schedule: Schedule  # generated and validated
    spec: TransformerSpec | None  # None for a concurrent-branch model (two branches, no one spec)
    topology: Topology

    @property
    def world_size(self) -> int:
        """One rank per device of the schedule."""
        return self.schedule.num_devices


def _number(key: str, value: Any, rule: str, ok: bool) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {rule}")


def _at_least(key: str, value: Any, low: int) -> None:
    _number(key, value, f"must be a whole number >= {low}", _whole(value) and value >= low)


def _check_trainer(trainer: DictConfig) -> None:
    _at_least("trainer.steps", trainer.steps, 1)
    _at_least("trainer.log_every", trainer.log_every, 1)
    _at_least("trainer.val_every", trainer.val_every, 0)  # 0: never
    _at_least("trainer.val_batches", trainer.val_batches, 1 if trainer.val_every > 0 else 0)
    _at_least("trainer.save_every", trainer.save_every, 0)  # 0: only the final checkpoint
    if trainer.timeline_step is not None:
        _at_least("trainer.timeline_step", trainer.timeline_step, 1)  # steps count from 1


def _check_optim(optim: DictConfig) -> None:
    if optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={optim.name}: unknown optimizer; allowed values: {', '.join(OPTIMIZERS)}")
    _number("optim.lr", optim.lr, "the learning rate must be > 0", optim.lr > 0)
    _number("optim.weight_decay", optim.weight_decay, "must be >= 0", optim.weight_decay >= 0)
    for key in ("beta1", "beta2"):
        _number(f"optim.{key}", optim[key], "must be in [0, 1)", 0 <= optim[key] < 1)
    _number("optim.eps", optim.eps, "must be > 0", optim.eps > 0)
    _at_least("optim.warmup_steps", optim.warmup_steps, 0)
    _number("optim.min_lr_ratio", optim.min_lr_ratio, "must be in [0, 1]", 0 <= optim.min_lr_ratio <= 1)
    if optim.grad_clip is not None:
        _number("optim.grad_clip", optim.grad_clip, "must be >= 0, or null for no clipping", optim.grad_clip >= 0)


def _cuda_devices() -> int:
    # torch is imported only when a config asks for CUDA, so checking a CPU config stays fast
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_runtime(rt: DictConfig, world_size: int) -> None:
    if rt.backend not in BACKENDS:
        raise ConfigError(f"runtime.backend={rt.backend}: unknown backend; allowed values: {', '.join(BACKENDS)}")
    if rt.device not in RUNTIME_DEVICES:
        raise ConfigError(f"runtime.device={rt.device}: unknown device; allowed values: {', '.join(RUNTIME_DEVICES)}")
    if rt.backend == "nccl" and rt.device == "cpu":
        raise ConfigError("runtime.backend=nccl: NCCL moves CUDA tensors only; use runtime.backend=gloo (or auto) "
                          "with runtime.device=cpu")
    if rt.backend == "nccl" or rt.device == "cuda":
        key, value = ("runtime.backend", rt.backend) if rt.backend == "nccl" else ("runtime.device", rt.device)
        gpus = _cuda_devices()
        if gpus == 0:
            raise ConfigError(f"{key}={value}: no CUDA device is available here; use {key}=auto (gloo on CPU)")
        if gpus < world_size:
            # NCCL refuses two ranks on one GPU
            raise ConfigError(
                f"{key}={value}: the schedule needs {world_size} ranks but only {gpus} CUDA devices are visible; "
                f"use fewer pipeline.stages or runtime.device=cpu"
            )
    _number("runtime.timeout_s", rt.timeout_s, "must be > 0 seconds", rt.timeout_s > 0)
    _at_least("runtime.threads_per_rank", rt.threads_per_rank, 1)
    if rt.master_port is not None:
        _number("runtime.master_port", rt.master_port, "must be null (a free port) or in 1..65535",
                _whole(rt.master_port) and 1 <= rt.master_port <= 65535)
    if (rt.fail_at_step is None) != (rt.fail_rank is None):
        unset = "runtime.fail_rank" if rt.fail_rank is None else "runtime.fail_at_step"
        raise ConfigError(f"{unset}=null: the failure test hook needs both runtime.fail_rank and runtime.fail_at_step")
    if rt.fail_rank is not None:
        _number("runtime.fail_rank", rt.fail_rank, f"must be a rank in 0..{world_size - 1}",
                _whole(rt.fail_rank) and 0 <= rt.fail_rank < world_size)
        _at_least("runtime.fail_at_step", rt.fail_at_step, 1)
        if rt.fail_mode not in FAIL_MODES:
            raise ConfigError(f"runtime.fail_mode={rt.fail_mode}: allowed values: {', '.join(FAIL_MODES)}")


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


def data_file_list(files: Any) -> list[str] | None:
    """``data.files`` as the list of files it names: one path or a list, globs expanded
    (sorted), or None for the data set's default corpus. Raises ConfigError naming the
    first entry that matches nothing."""
    if files is None:
        return None
    found: list[str] = []
    for pattern in [files] if isinstance(files, str) else list(files):
        path = os.path.expanduser(str(pattern))
        if glob.has_magic(path):
            matches = sorted(m for m in glob.glob(path) if os.path.isfile(m))
            what = "no file matches"
        else:
            matches = [path] if os.path.isfile(path) else []
            what = "no such file"
        if not matches:
            raise ConfigError(
                f"data.files={pattern}: {what} (relative paths start at {os.getcwd()}); "
                f"give existing files or globs, or data.files=null"
            )
        found += matches
    return found


def _check_data_files(data: DictConfig) -> None:
    files = data.get("files")
    if files is not None and not isinstance(files, str) and len(files) == 0:
        raise ConfigError(
            "data.files=[]: the list is empty; list at least one file, or set data.files=null for the default data"
        )
    data_file_list(files)


def _check_resume(resume: str | None) -> None:
    if resume is None:
        return
    if not Path(resume).expanduser().is_dir():
        raise ConfigError(
            f"resume={resume}: no such directory; give a previous run's folder (outputs/train/<date>/<time>) "
            f"or one of its checkpoints/step_N folders"
        )
    # The runtime's own reading of `resume` (run dir -> latest checkpoint), torch-free
    from pipeflow.runtime.checkpoint import resolve

    try:
        resolve(str(Path(resume).expanduser()))
    except (OSError, ValueError) as err:
        raise _naming_key("resume", resume, err) from None


def _check_profiled_partition(part: DictConfig, spec: TransformerSpec, num_stages: int) -> None:
    """partition=profiled: a memory limit in bytes, and a profile file that fits the model
    (null: pipeflow-train profiles before launching); with a file, the split is computed
    now, so a memory limit nothing fits stops the run here."""
    limit, path = part.get("memory_limit"), part.get("profile")
    if limit is not None:
        _number("partition.memory_limit", limit, "must be a number of bytes > 0, or null for no limit",
                isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0)
    if path is None:
        return
    from pipeflow.planning.partition import partition_layers

    try:
        partition_layers("profiled", spec, num_stages, {"profile": str(Path(path).expanduser()), "memory_limit": limit})
    except ValueError as err:
        msg = str(err)
        raise (ConfigError(msg) if msg.startswith("partition.") else _naming_key("partition.profile", path, err)) from None


def prepare_training(cfg: DictConfig) -> TrainingInputs:
    """Check a train config and build (and validate) its schedule, or raise ConfigError,
    one sentence naming the key and the allowed values. Nothing is spawned, loaded or
    written, so a bad config fails before any rank starts."""
    _check_pipeline(cfg)
    _resolve_auto_data(cfg)
    name, pipe = cfg.schedule.name, cfg.pipeline
    if not schedule_spec(cfg.schedule).runtime:
        raise ConfigError(
            f"schedule.name={name}: the runtime does not execute this schedule yet (pipeflow-simulate does); "
            f"allowed values: {', '.join(runtime_schedules())}"
        )
    if name == "chimera" and pipe.stages == 1:
        # pipeline.stages=1 is the single-process reference run; Chimera's two opposite
        # pipelines need two devices at least, so there is nothing to mean here.
        raise ConfigError(
            "pipeline.stages=1: schedule 'chimera' needs an even number of stages (2, 4, ...); "
            "for single-process reference training use schedule=1f1b"
        )
    model = cfg.model
    if model.get("family") == "cbm":
        return _prepare_branched(cfg)
    schedule = _generate_schedule(cfg)
    spec = _model_spec(cfg, schedule)
    topology = _build_topology(cfg, schedule)

    if model.family not in TRAIN_FAMILIES:
        raise ConfigError(
            f"model.family={model.family}: the runtime cannot train this family; allowed values: "
            f"{', '.join(TRAIN_FAMILIES)} (e.g. model=gpt_tiny or model=bert_tiny)"
        )
    _number("model.dropout", model.dropout, "a probability; use a number in [0, 1)", 0 <= model.dropout < 1)
    if pipe.segments > 1 and model.family != "gpt":
        raise ConfigError(
            f"pipeline.segments={pipe.segments}: sequence segments attend causally across segments, which the "
            f"runtime implements for model.family=gpt; model.family={model.family} trains with pipeline.segments=1"
        )
    segment_lengths(cfg)  # a split the sequence cannot take fails here, naming its key
    feeds = DATA_FAMILY.get(cfg.data.name)
    if feeds is not None and feeds != model.family:
        fits = [d for d, f in DATA_FAMILY.items() if f == model.family]
        raise ConfigError(
            f"data.name={cfg.data.name}: it feeds {feeds} models, not model.family={model.family} "
            f"(model={model.name}); allowed values: {', '.join(fits) or 'a data set made for ' + model.family}"
        )
    need = DATA_VOCAB.get(cfg.data.name)
    if need is not None and model.vocab_size < need:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size}: data '{cfg.data.name}' feeds token ids 0..{need - 1}; "
            f"use model.vocab_size >= {need}"
        )
    if cfg.partition.name == "planner" and cfg.schedule.name != PLANNED:
        raise ConfigError(f"partition.name=planner: the planner's cut comes with its device mapping; "
                          f"use it with schedule={PLANNED}")
    if cfg.partition.name not in (*PARTITIONERS, "planner"):
        raise ConfigError(
            f"partition.name={cfg.partition.name}: the runtime cannot split a model this way; "
            f"allowed values: {', '.join(PARTITIONERS)}, planner"
        )
    if schedule.name == PLANNED:
        used = {d for row in schedule.placement.table for d in row}
        if len(used) != schedule.num_devices:
            idle = sorted(set(range(schedule.num_devices)) - used)
            raise ConfigError(f"pipeline.stages={cfg.pipeline.stages}: the plan leaves devices {idle} without a "
                              f"stage, and every rank needs one; plan for {len(used)} devices or give a plan that "
                              f"uses all {schedule.num_devices}")
    if cfg.partition.name == "profiled":
        _check_profiled_partition(cfg.partition, spec, schedule.num_stages)
    _check_trainer(cfg.trainer)
    _check_optim(cfg.optim)
    _check_runtime(cfg.runtime, schedule.num_devices)
    check_logger(cfg.logger)
    _check_data_files(cfg.data)
    _check_resume(cfg.resume)

    # Generators are tested to be valid, but the runtime would deadlock on a schedule that
    # is not, so one validation here (milliseconds at training sizes) is cheap insurance.
    validate(schedule)
    return TrainingInputs(schedule, spec, topology)


def _resolve_auto_data(cfg: DictConfig) -> None:
    """data=auto: replace the data group by the option file of the model family's data set."""
    if cfg.data.get("name") != "auto":
        return
    family = cfg.model.get("family")
    if family not in DATA_FOR_FAMILY:
        raise ConfigError(
            f"data.name=auto: no default data set for model.family={family}; pick one of {', '.join(DATA_FAMILY)}"
        )
    chosen = OmegaConf.load(CONF_DIR / "data" / f"{DATA_FOR_FAMILY[family]}.yaml")
    chosen.pop("defaults", None)
    for key, value in cfg.data.items():
        if key == "name" or value is None:
            continue  # null keeps the chosen data set's default
        if key not in chosen:
            raise ConfigError(
                f"data.{key}={value}: data set '{chosen.name}' (data=auto for model.family={family}) has no such key; "
                f"its keys: {', '.join(k for k in chosen if k != 'name')}"
            )
        chosen[key] = value
    with open_dict(cfg):
        cfg.data = chosen


def _branched_schedule(cfg: DictConfig) -> tuple[Schedule, list]:
    """A concurrent-branch model's stage graph (cut at the interaction layers), grouped
    onto the schedule's chain of devices; generated, not validated. Building the graph
    imports the model module (and so torch): only configs of this family pay for it."""
    from pipeflow.models.cbm import cbm_shape, cbm_stage_graph
    from pipeflow.runtime.adapters import cbm_stage_counts

    plain = OmegaConf.to_container(cfg.model, resolve=True)
    sched_spec = schedule_spec(cfg.schedule)
    bapp = sched_spec.branch_aware
    try:
        shape = cbm_shape(plain)
        # bapp cuts each branch into pipeline.stages stages; chain schedules group the graph
        counts = (cfg.pipeline.stages, cfg.pipeline.stages) if bapp else cbm_stage_counts(shape, cfg.pipeline.stages)
        graph, specs = cbm_stage_graph(plain, *counts)
    except ValueError as err:
        raise _naming_key("model", cfg.model.name, err) from None
    pipe = cfg.pipeline
    options = schedule_options(cfg.schedule)
    try:
        if "coordinate" in sched_spec.config_keys and cfg.schedule.get("coordinate", True) is not False:
            if options:
                raise ConfigError(f"schedule.{next(iter(options))}={next(iter(options.values()))}: the coordinator "
                                  f"chooses bapp's policy; set schedule.coordinate=false to give it yourself")
            from pipeflow.schedules.coordinator import coordinate

            cost = _branched_cost(cfg, specs) if "cost" in cfg else _default_branched_cost(cfg, specs)
            topology = build_topology(cfg.topology, pipe.stages, needed_for=devices_needed_for(cfg))
            limit = cfg.schedule.get("memory_limit_gb")
            schedule = coordinate(pipe.stages, pipe.microbatches, graph, cost, topology,
                                  memory_limit=None if limit is None else float(limit) * 1e9).schedule
        else:
            schedule = build_schedule(cfg.schedule.name, pipe.stages, pipe.microbatches, pipe.virtual_stages,
                                      pipe.segments, check=False, graph=graph, **options)
    except (ScheduleConfigError, ValueError) as err:
        raise ConfigError(str(err)) from None
    return schedule, specs


def branched_schedule(cfg: Any) -> tuple[Schedule, list]:
    """The schedule a concurrent-branch config runs (what pipeflow-train's ranks build):
    ``cfg`` composed or plain dicts."""
    return _branched_schedule(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg))


def _default_branched_cost(cfg: DictConfig, specs: list) -> CostModel:
    """Training configs carry no cost group: the coordinator orders by FLOPs (analytic defaults)."""
    from pipeflow.planning.branched_cost import BranchedAnalyticCost

    return BranchedAnalyticCost(OmegaConf.to_container(cfg.model, resolve=True),
                                [(s.branch, s.lo, s.hi) for s in specs], cfg.pipeline.microbatch_size)


def _branched_cost(cfg: DictConfig, specs: list) -> CostModel:
    from pipeflow.planning.branched_cost import BranchedAnalyticCost

    params = {k: v for k, v in OmegaConf.to_container(cfg.cost, resolve=True).items() if v is not None}
    name = params.pop("name")
    try:
        if name in ("unit", "calibrated"):
            return build_cost_model(cfg.cost, len(specs), None, cfg.pipeline.microbatch_size)
        if name == "analytic":
            params.pop("layers_per_stage", None)
            params.pop("segment_lengths", None)
            return BranchedAnalyticCost(OmegaConf.to_container(cfg.model, resolve=True),
                                        [(s.branch, s.lo, s.hi) for s in specs], cfg.pipeline.microbatch_size, **params)
    except (TypeError, ValueError) as err:
        raise _naming_key("cost", name, err) from None
    raise ConfigError(f"cost.name={name}: a concurrent-branch model is priced by analytic, unit or calibrated; "
                      f"allowed values: analytic, unit, calibrated")


def _prepare_branched(cfg: DictConfig) -> TrainingInputs:
    """A concurrent-branch model: its stage DAG grouped onto the schedule's chain of devices."""
    schedule, _ = _branched_schedule(cfg)
    if cfg.data.name != "image_text":
        raise ConfigError(
            f"data.name={cfg.data.name}: model.family=cbm trains on image-text pairs; allowed values: image_text"
        )
    if cfg.partition.name != "uniform":
        raise ConfigError(
            f"partition.name={cfg.partition.name}: a concurrent-branch model's stages are cut at its "
            f"interaction layers (pipeflow.models.cbm.cbm_stage_graph); allowed values: uniform"
        )
    _number("model.dropout", cfg.model.dropout, "a probability; use a number in [0, 1)", 0 <= cfg.model.dropout < 1)
    topology = _build_topology(cfg, schedule)
    _check_trainer(cfg.trainer)
    _check_optim(cfg.optim)
    _check_runtime(cfg.runtime, schedule.num_devices)
    check_logger(cfg.logger)
    _check_data_files(cfg.data)
    if cfg.data.get("files"):
        # the user's own image-text files: missing columns or mixed image sizes must stop
        # the run here, not in every rank after start-up
        import datasets

        from pipeflow.data.image_text import build_image_text_data

        datasets.disable_progress_bars()  # a config check prints its verdict, nothing else
        try:
            build_image_text_data(OmegaConf.to_container(cfg.data, resolve=True),
                                  OmegaConf.to_container(cfg.model, resolve=True), int(cfg.seed))
        except ValueError as err:
            raise ConfigError(str(err).strip().splitlines()[0]) from None
    _check_resume(cfg.resume)
    validate(schedule)
    return TrainingInputs(schedule, None, topology)


def check_group_choices(args: Sequence[str], config_dir: Path = CONF_DIR) -> None:
    """Refuse a command-line group choice that names no option file (``schedule=nope``)
    with one sentence, before Hydra composes: Hydra's own report spans many lines.

    ``args`` are the command-line arguments; only ``group=option`` overrides (and choice
    sweeps of them) of groups under ``config_dir`` are checked. With an extra config
    directory (``--config-dir``, ``hydra.searchpath``) options may live elsewhere, so
    nothing is checked and Hydra reports as usual; so are overrides it cannot parse.
    """
    if any(a.startswith(("-cd", "--config-dir", "hydra.searchpath")) for a in args):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:  # noqa: BLE001 - malformed overrides are Hydra's to report
        return
    for override in overrides:
        group = override.key_or_group
        if override.package is not None or override.is_delete() or not (config_dir / group).is_dir():
            continue
        try:
            values = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                      else [override.get_value_element_as_str()])
        except Exception:  # noqa: BLE001 - ranges and the like are not group choices
            continue
        options = sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        for value in values:
            if value not in options:
                raise ConfigError(f"{group}={value}: unknown {group}; allowed values: {', '.join(options)}")
