"""prepare_simulation and prepare_training: check a composed config and build what it
names, before any work starts (for training: before any rank is spawned). Each resolves
the run once (:func:`.resolved.resolve`) and checks that one value.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from pipeflow.families import FAMILIES, family_of
from pipeflow.formats.runplan import RunPlan
from pipeflow.planning.cost import AnalyticCost, CostModel
from pipeflow.planning.cost_models import build_cost_model
from pipeflow.planning.optimizer_step import step_impl
from pipeflow.planning.partitioners import PARTITIONERS
from pipeflow.planning.transformer import TransformerSpec, kv_repeat_on
from pipeflow.schedules.export import check_exportable
from pipeflow.schedules.ir import Schedule
from pipeflow.topology.topology import Topology

from .assembly import (
    PLANNED,
    branched_cost,
    check_profile_cost,
    host_calibrated,
    profiled_sync,
    run_topology,
    runtime_schedules,
    schedule_spec,
    short_schedules,
    validated,
)
from .checks import check_export, check_known_keys
from .groups.compile import check_compile, check_compile_cost, compiled
from .groups.data import DATA_FAMILY, DATA_VOCAB, check_data_files, check_text_data, resolve_auto_data
from .groups.logger import check_logger
from .groups.model import check_recompute, check_vocab_memory, resolve_model
from .groups.optim import check_optim
from .groups.partition import check_profiled_partition
from .groups.pipeline import check_pipeline
from .groups.precision import check_precision
from .groups.resume import check_resume, resume_expect
from .groups.runtime import check_runtime
from .groups.trainer import check_trainer
from .resolved import Resolved, resolve
from .to_runplan import Measure, build_run_plan
from .values import EXPORT_FORMATS, ConfigError, naming_key, number


def _family(cfg: DictConfig):
    """The spec of model.family (pipeflow.families), or ConfigError naming the key."""
    try:
        return family_of(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None


@dataclass
class SimulationInputs:
    """What a simulate config composes into; built once by :func:`prepare_simulation`."""

    schedule: Schedule  # generated, not yet validated
    spec: TransformerSpec
    cost: CostModel
    topology: Topology
    segment_lengths: list[int] | None = None  # tokens per sequence segment (segmented schedules)
    # the schedule at two short sizes a memory walk follows from, and how many periods
    # past the shorter one it is (assembly.short_schedules); None: walk it whole
    periods: tuple | None = None


def prepare_simulation(cfg: DictConfig) -> SimulationInputs:
    """Build the schedule, model shape, cost model and topology a config names, or raise
    ConfigError, one sentence naming the key and the allowed values. Nothing is
    simulated or written, so a bad config fails before any work."""
    if cfg.export is not None and cfg.export not in EXPORT_FORMATS:
        raise ConfigError(f"export={cfg.export}: unknown format; allowed values: null, {', '.join(EXPORT_FORMATS)}")
    check_known_keys(cfg)
    if compiled(cfg) and cfg.cost.name != "calibrated":
        raise ConfigError(f"compile=true: cost.name={cfg.cost.name} prices eager kernels (its formulas or its device "
                          f"profile's operators), and a compiled block's are measured by a calibration: "
                          f"python -m pipeflow.calibrate --out calibration.json compile=true <the run's overrides>, "
                          f"then cost=calibrated cost.calibration=calibration.json (or compile=false)")
    resolve_model(cfg)
    check_pipeline(cfg)
    family = _family(cfg)
    run = resolve(cfg, schedule_spec(cfg.schedule), family, priced=True)
    spec, dtype_bytes = run.spec, 4 if run.precision == "fp32" else 2  # (the precision the run would train in)
    if family.branched:
        cost = branched_cost(cfg, run.parts, dtype_bytes=dtype_bytes)
    else:
        if kv_repeat_on(spec, dtype_bytes, run.topology.on_gpus):
            spec = dataclasses.replace(spec, kv_repeat=True)
        cost = _chain_cost(cfg, run, spec)
    check_profile_cost(cfg, cost)
    check_compile_cost(cfg, run.schedule, cost)
    topology = _on_its_devices(cfg, run, cost)
    if cfg.export == "torch_csv":
        try:
            check_exportable(run.schedule)
        except ValueError as err:
            raise ConfigError(f"export=torch_csv: {err}") from None
    periods = None if family.branched else short_schedules(cfg, run.schedule_spec)
    return SimulationInputs(run.schedule, spec, cost, topology, run.segments, periods)


def _chain_cost(cfg: DictConfig, run: Resolved, spec: TransformerSpec) -> CostModel:
    """The cost group's model of a chain model's run; the analytic cost takes from the run
    what its group leaves unset (the precision's bytes per element), a plan's cut and
    the segments' lengths (unequal segments, unequal times and memory)."""
    cost_cfg, extra = cfg.cost, {}
    if cfg.cost.name == "analytic":
        if cfg.cost.get("dtype_bytes") is None:
            extra["dtype_bytes"] = 4 if run.precision == "fp32" else 2
        if run.schedule.name == PLANNED:
            extra["layers_per_stage"] = list(run.schedule.layers_per_stage)
        if run.segments is not None:
            extra["segment_lengths"] = run.segments
    if extra:
        cost_cfg = {**OmegaConf.to_container(cfg.cost, resolve=True), **extra}
    try:
        return build_cost_model(cost_cfg, run.schedule.num_stages, spec, cfg.pipeline.microbatch_size,
                                tensor_parallel=run.tensor, sequence_parallel=run.sequence)
    except ValueError as err:
        raise naming_key("cost", cfg.cost.name, err) from None


def _on_its_devices(cfg: DictConfig, run: Resolved, cost: CostModel) -> Topology:
    """The topology the simulation runs on (a calibration's host where it describes this
    one), with what ``cost`` reads of those devices set on it: a profiled host's step
    synchronisation, the tensor groups, the ranks' AdamW, this host's kernels' scratch."""
    schedule = run.schedule
    if isinstance(cost, AnalyticCost) and cfg.topology.name == "local_cpu" and cfg.topology.get("device_profile"):
        # a synchronous step's all-reduces, as the profile's reference pipeline measured them
        # (what cost=calibrated charges as its calibration's step_sync)
        cost.step_sync = profiled_sync(cfg.topology.device_profile, cost.spec, schedule)
    # (the devices once more only where a calibration describes this host's: its cores,
    # their contention, and a gloo message's cost)
    topology = run_topology(cfg, schedule, run.tensor, cost.host) if host_calibrated(cfg, cost) else run.topology
    if run.tensor > 1:  # each device's tensor group's collectives, on the group's own links
        cost.place_tensor_groups(topology)
    # torch's AdamW as the ranks will run it (optim.impl on the topology's device; a
    # simulate config has no optim group: its default, auto)
    if isinstance(cost, AnalyticCost):
        cost.step_impl = step_impl(OmegaConf.select(cfg, "optim.impl", default=None) or "auto",
                                   "cuda" if topology.on_gpus else "cpu")
    if not topology.on_gpus:
        # this host's kernels: the math library's scratch inside a 16-bit product (the
        # analytic and the branched cost models price it), the fused attention's backward's
        from pipeflow.topology.kernel_scratch import attention_scratch, product_scratch

        # (on a rank's threads: both allocate per thread; a simulate config has no runtime
        # group, and a rank runs one by default)
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(run.precision, "float32")
        threads = int(OmegaConf.select(cfg, "runtime.threads_per_rank", default=None) or 1)
        if run.precision in ("bf16", "fp16"):
            cost.product_scratch = functools.partial(product_scratch, dtype=dtype, threads=threads)
        cost.attention_scratch = functools.partial(attention_scratch, dtype=dtype, threads=threads)
    return topology


# ---------------------------------------------------------------------------- training


@dataclass
class TrainingInputs:
    """What a train config composes into; built once by :func:`prepare_training`."""

    schedule: Schedule  # generated and validated
    spec: TransformerSpec | None  # None for a concurrent-branch model (two branches, no one spec)
    topology: Topology
    plan: RunPlan  # what the ranks instantiate (pipeflow.config.to_runplan)
    # the config as resolved (a model preset's shape, data=auto, precision=auto): a copy,
    # the one given to prepare_training is left as it was
    config: DictConfig | None = None

    @property
    def world_size(self) -> int:
        """One rank per device of the schedule and tensor-parallel rank."""
        return self.plan.world_size


def prepare_training(cfg: DictConfig, hydra: DictConfig | None = None, measure: Measure | None = None
                     ) -> TrainingInputs:
    """Check a train config and build (and validate) its schedule and its run plan, or
    raise ConfigError, one sentence naming the key and the allowed values. Nothing is
    spawned, loaded or written (but where ``measure`` profiles the model for
    ``partition=profiled``, after every check), so a bad config fails before any rank
    starts. ``cfg`` is left alone: what is resolved (a model preset, data=auto,
    precision=auto) is resolved in a copy, the inputs' ``config``. ``hydra``: the app's
    Hydra config (a multirun's W&B labels); ``measure``: see :func:`.to_runplan.build_run_plan`."""
    check_known_keys(cfg)
    cfg = copy.deepcopy(cfg)
    resolve_model(cfg)
    check_pipeline(cfg)
    resolve_auto_data(cfg)
    family = _family(cfg)
    sched = schedule_spec(cfg.schedule)
    _check_runs_it(cfg, sched)
    run = resolve(cfg, sched, family)
    check_trainer(cfg.trainer)
    check_optim(cfg.optim)
    check_runtime(cfg.runtime, run.schedule.num_devices * run.tensor)  # (its ranks)
    check_precision(cfg, run.schedule)
    check_recompute(cfg.model)
    check_logger(cfg.logger)
    check_data_files(cfg.data)
    if family.branched:
        _check_branched(cfg, run)
    else:  # a padded vocabulary's memory, a compiler for compile=true, text data as the ranks read it
        _check_model_and_data(cfg, family)
        _check_partition(cfg, run.schedule, run.spec)
        check_vocab_memory(cfg, run.spec, run.tensor)
        check_compile(cfg, run.schedule, run.topology.on_gpus)
        check_text_data(cfg.data, run.spec.seq_len)
    check_export(cfg.get("export"), family.name)
    check_resume(cfg.resume, resume_expect(cfg, run.schedule), cfg.trainer.steps)
    # Generators are tested to be valid, but the runtime would deadlock on a schedule that
    # is not, so one validation here (milliseconds at training sizes) is cheap insurance.
    completion = validated(run.schedule, cfg)
    plan = build_run_plan(cfg, run, completion, hydra=hydra, measure=measure)
    return TrainingInputs(run.schedule, run.spec, run.topology, plan, cfg)


def _check_runs_it(cfg: DictConfig, sched) -> None:
    """The runtime executes the schedule (``sched``, its spec) at this size."""
    name, pipe = cfg.schedule.name, cfg.pipeline
    if not sched.runtime:
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


def _check_model_and_data(cfg: DictConfig, family) -> None:
    """The dropout, segments only for causal families, and data the model can read:
    a data set made for its family, token ids its vocabulary covers."""
    model, pipe = cfg.model, cfg.pipeline
    number("model.dropout", model.dropout, "a probability; use a number in [0, 1)", 0 <= model.dropout < 1)
    if pipe.segments > 1 and not family.causal:
        raise ConfigError(
            f"pipeline.segments={pipe.segments}: sequence segments attend causally across segments, which the "
            f"runtime implements for causal families ({', '.join(f.name for f in FAMILIES.values() if f.causal)}); "
            f"model.family={model.family} trains with pipeline.segments=1"
        )
    feeds = DATA_FAMILY.get(cfg.data.name)
    if feeds is not None and model.family not in feeds:
        fits = [d for d, f in DATA_FAMILY.items() if model.family in f]
        raise ConfigError(
            f"data.name={cfg.data.name}: it feeds {' and '.join(feeds)} models, not model.family={model.family} "
            f"(model={model.name}); allowed values: {', '.join(fits) or 'a data set made for ' + model.family}"
        )
    need = DATA_VOCAB.get(cfg.data.name)
    if cfg.data.get("tokenizer"):
        from pipeflow.data.text import load_tokenizer

        try:
            need = len(load_tokenizer(cfg.data.tokenizer))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if need is not None and model.vocab_size < need:
        feeds = f"tokenizer {cfg.data.tokenizer}" if cfg.data.get("tokenizer") else f"data '{cfg.data.name}'"
        key = "model.hf.vocab_size" if model.family == "hf_causal" else "model.vocab_size"  # where it is set
        raise ConfigError(
            f"{key}={model.vocab_size}: {feeds} feeds token ids 0..{need - 1}; use {key} >= {need}"
        )


def _check_partition(cfg: DictConfig, schedule: Schedule, spec: TransformerSpec) -> None:
    """A partitioner the runtime cuts by, the planner's cut with its plan, a plan that
    gives every device a stage, a profiled cut's profile and limit."""
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
        check_profiled_partition(cfg.partition, spec, schedule.num_stages)


def _check_branched(cfg: DictConfig, run: Resolved) -> None:
    """A concurrent-branch model's run: its stage DAG grouped onto the schedule's chain of
    devices, on its family's data (a user's image-text files read now), cut uniformly."""
    family = run.family
    if cfg.data.name != family.data:
        raise ConfigError(
            f"data.name={cfg.data.name}: model.family={cfg.model.family} trains on {family.data}; "
            f"allowed values: {family.data}"
        )
    if cfg.partition.name != "uniform":
        raise ConfigError(
            f"partition.name={cfg.partition.name}: a concurrent-branch model's stages are cut at its "
            f"interaction layers (pipeflow.planning.cbm_shape.cbm_stage_graph); allowed values: uniform"
        )
    number("model.dropout", cfg.model.dropout, "a probability; use a number in [0, 1)", 0 <= cfg.model.dropout < 1)
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
