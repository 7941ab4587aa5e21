"""Config -> what it names: the schedule (through its spec), the model's shape, segment
lengths, the cost model and the topology. The apps call these before any work starts;
a training job's ranks get what they decide in the run plan (:mod:`.to_runplan`), never
the config.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeflow.planning.cost import CostModel
from pipeflow.planning.cost_models import build_cost_model
from pipeflow.planning.machine_cost import CalibratedCost
from pipeflow.planning.seqsplit import split_sequence
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.ir import Schedule, WeightPolicy
from pipeflow.schedules.periods import periods_past_fill
from pipeflow.schedules.registry import build_schedule, get_spec, load_spec, register, specs
from pipeflow.schedules.sharding import with_gathers
from pipeflow.schedules.spec import ScheduleSpec
from pipeflow.topology.presets import build_topology
from pipeflow.topology.tensor import tensor_topology
from pipeflow.topology.topology import Topology

from .derive import schedule_schema
from .tensor_degree import tensor_degree
from .values import ConfigError, naming_key


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
    config_keys={"plan": str, "memory_limit_gb": float}, assemble=_assemble_planned, single_pipeline=False), replace=True)


def runtime_schedules() -> list[str]:
    """The schedules pipeflow-train runs: every registered one whose spec says so."""
    return [spec.name for spec in specs() if spec.runtime]


def devices_needed_for(cfg: DictConfig) -> str:
    """Why the schedule needs its device count, for the topology's too-small error."""
    return f"schedule.name={cfg.schedule.name} with pipeline.stages={cfg.pipeline.stages}"


def schedule_spec(schedule_cfg: Any) -> ScheduleSpec:
    """The spec of ``schedule.name``; a user's schedule (``schedule.generator``, the
    import path of its generator) is loaded and registered first. Raises ConfigError."""
    name, generator = schedule_cfg["name"], schedule_cfg.get("generator")
    try:
        return load_spec(str(generator), name) if generator else get_spec(name)
    except ScheduleConfigError as err:
        raise ConfigError(str(err)) from None


def schedule_options(schedule_cfg: Any, spec: ScheduleSpec | None = None) -> dict:
    """The generator's options as the config gives them (null ones left to the generator's
    defaults), each key checked against the schedule's schema: a key it does not have, or
    a value of the wrong type, raises ConfigError naming the key and the allowed ones.
    ``schedule_cfg`` composed or a plain dict; ``spec``: its :func:`schedule_spec`, where known."""
    spec = spec or schedule_spec(schedule_cfg)
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
    plain dicts."""
    from pipeflow.planning.planner import Plan, build_plan_schedule
    from pipeflow.planning.planner import plan as make_plan

    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    pipe, path = cfg.pipeline, cfg.schedule.get("plan")
    limit = cfg.schedule.get("memory_limit_gb")
    if "partition" in cfg and cfg.partition.name not in ("uniform", "planner"):
        raise ConfigError(f"partition.name={cfg.partition.name}: schedule=planned cuts the model as its plan says; "
                          f"allowed values: planner (or the default uniform, which the plan replaces)")
    tensor, sp = tensor_degree(cfg)
    sp = sp and tensor > 1
    if path:
        try:
            p = Plan.from_json(Path(str(path)).expanduser().read_text())
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"schedule.plan={path}: not a plan.json written by pipeflow-plan ({err})") from None
        if (p.tensor_parallel, p.sequence_parallel and p.tensor_parallel > 1) != (tensor, sp):
            def said(t, s):
                return f"pipeline.tensor_parallel={t}" + (f" pipeline.sequence_parallel={s}".lower() if t > 1 else "")
            made = said(p.tensor_parallel, p.sequence_parallel)
            raise ConfigError(f"schedule.plan={path}: the plan was made for {made} (its devices are tensor groups "
                              f"of {p.tensor_parallel} GPUs), the run has {said(tensor, sp)}; run it with {made}, "
                              f"or plan with pipeflow-plan plan.tensor_parallel=[{tensor}]")
    else:
        spec = TransformerSpec.from_config(cfg.model)
        # with pipeline.tensor_parallel=T the plan maps stages onto the T-GPU groups, each
        # candidate priced per tensor rank (the groups' collectives included)
        topology = build_topology(cfg.topology, pipe.stages * tensor, needed_for=devices_needed_for(cfg))
        try:
            topology = tensor_topology(topology, tensor)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            p = make_plan(spec, topology, pipe.microbatches, pipe.microbatch_size,
                          memory_limit_bytes=None if limit is None else float(limit) * 1e9,
                          tensor_parallel=tensor, sequence_parallel=sp)
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
    schedule = dataclasses.replace(schedule, name=PLANNED, layers_per_stage=tuple(p.layers_per_stage),
                                   meta={**schedule.meta, "plan": p.to_dict()})
    return schedule, p


def schedule_source(cfg: DictConfig) -> str:
    """Where the config's schedule came from, as the key a user set: a file's path, a
    generator of their own, or a schedule's name."""
    if cfg.schedule.name == "file":
        return f"schedule.path={cfg.schedule.get('path')}"
    if cfg.schedule.get("generator"):
        return f"schedule.generator={cfg.schedule.generator}"
    return f"schedule={cfg.schedule.name}"


MESSAGE_LIMIT = 600  # characters of a refusal: one sentence, not every device of a large schedule


def validated(schedule: Schedule, cfg: DictConfig) -> list:
    """The validator's verdict (:func:`~pipeflow.schedules.validate.completion_order`) as
    one sentence that names where the schedule came from; a schedule that cannot run is
    refused before any rank starts. Returns its dry run's completion order."""
    from pipeflow.schedules.validate import ScheduleError, completion_order

    try:
        return completion_order(schedule)
    except ScheduleError as err:
        raise schedule_refusal(err, schedule, cfg) from None


def schedule_refusal(err: Exception, schedule: Schedule, cfg: DictConfig) -> ConfigError:
    """The validator's ``err`` about ``schedule`` as the config error train and simulate raise."""
    return ConfigError(refusal(schedule_source(cfg), str(err), prefix=f"schedule '{schedule.name}'"))


def refusal(where: str, message: str, prefix: str = "") -> str:
    """``where: message`` on one line, ``prefix`` (the message's own naming of the
    thing) left out, cut to :data:`MESSAGE_LIMIT` characters."""
    text = " ".join(message.split())
    if prefix and text.startswith(prefix):
        text = text[len(prefix):].lstrip(" :")
    line = f"{where}: {text}"
    return line if len(line) <= MESSAGE_LIMIT else line[:MESSAGE_LIMIT - 16].rstrip(" ,|") + " ... (cut short)"


def generate_schedule(cfg: DictConfig, spec: ScheduleSpec | None = None) -> Schedule:
    """The schedule the config names, generated but not validated; ``spec``: its
    :func:`schedule_spec`, where known."""
    pipe = cfg.pipeline
    spec = spec or schedule_spec(cfg.schedule)
    options = schedule_options(cfg.schedule, spec)
    if spec.assemble is not None:
        if pipe.get("data_parallel", 1) != 1:
            raise ConfigError(f"pipeline.data_parallel={pipe.data_parallel}: schedule '{spec.name}' is assembled "
                              f"whole (the planner places its own replicas); use pipeline.data_parallel=1")
        return sharded(spec.assemble(cfg), pipe.get("shard", "none"), pipe.get("gather", "step"))
    # The schedule's own size rules (even stages for Chimera, ...) live with the
    # generators; generating is cheap, validating is not needed to learn the sizes.
    try:
        schedule = build_schedule(
            cfg.schedule.name, pipe.stages, pipe.microbatches, pipe.virtual_stages, pipe.segments, check=False,
            data_parallel=pipe.get("data_parallel", 1), **options,
        )
    except ScheduleConfigError as err:
        raise ConfigError(str(err)) from None
    return sharded(schedule, pipe.get("shard", "none"), pipe.get("gather", "step"))


def short_schedules(cfg: DictConfig, spec: ScheduleSpec | None = None) -> tuple | None:
    """((the schedule at m0 microbatches, at m0 + 2 periods), k) where the config's m is k
    periods past m0 (:mod:`pipeflow.schedules.periods`): its memory walk follows from
    theirs (:func:`pipeflow.sim.device_memory.device_memory`'s ``periods``). None where
    the schedule has no period rule, or the two short walks would be no shorter than
    the whole one."""
    pipe = cfg.pipeline
    got = periods_past_fill(str(cfg.schedule.name), int(pipe.stages), int(pipe.virtual_stages),
                            int(pipe.segments), int(pipe.microbatches))
    if got is None or pipe.microbatches <= 2 * (got[0] + got[1]):
        return None
    m0, q, k = got
    pair = []
    for m in (m0, m0 + 2 * q):
        resized = copy.deepcopy(cfg)
        resized.pipeline.microbatches = m
        try:
            pair.append(generate_schedule(resized, spec))
        except ConfigError:  # (a size the generator refuses: walk the whole schedule)
            return None
    return tuple(pair), k


def sharded(schedule: Schedule, shard: str, gather: str = "step") -> Schedule:
    """The schedule with what its replicas of a stage shard (``pipeline.shard``): a
    synchronous schedule's replicas (data parallelism, Chimera's two pipes, a plan's
    replicas) run AdamW on their slices, and under ``full`` gather their parameters by
    the GATHER and FREE actions ``pipeline.gather`` places
    (:func:`pipeflow.schedules.sharding.with_gathers`); an asynchronous one shards with
    its own option."""
    if shard != "none" and schedule.policy != WeightPolicy.SYNC:
        from ..schedules.registry import get_spec

        own = "zero" in get_spec(schedule.name).options
        raise ConfigError(f"pipeline.shard={shard}: schedule '{schedule.name}' is asynchronous"
                          + ("; its replicas shard the optimizer state with schedule.zero=true" if own else "")
                          + " (allowed values here: none)")
    placement = schedule.placement
    if shard != "none" and not any(len({d for _, d in placement.replicas(st)}) > 1
                                   for st in range(schedule.num_stages)):
        # (a run so set sharded nothing and was reported sharded)
        raise ConfigError(f"pipeline.shard={shard}: no stage of schedule '{schedule.name}' has a replica to share "
                          f"its state with at pipeline.data_parallel={schedule.data_parallel}; set "
                          f"pipeline.data_parallel to 2 or more, or pipeline.shard=none")
    if shard == "full":
        schedule = with_gathers(schedule, gather)
    return dataclasses.replace(schedule, shard=shard)


def model_spec(cfg: DictConfig, schedule: Schedule) -> TransformerSpec:
    """The model's shape, checked against the number of stages the schedule cuts it into."""
    pipe = cfg.pipeline
    try:
        spec = TransformerSpec.from_config(cfg.model)
    except ValueError as err:
        raise naming_key("model", cfg.model.name, err) from None
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
    if not schedule_spec(cfg["schedule"]).segments:
        return None
    try:
        spec = TransformerSpec.from_config(cfg["model"])
    except ValueError as err:
        raise naming_key("model", cfg["model"].get("name"), err) from None
    tensor, sequence = tensor_degree(cfg)
    return split_segments(cfg, spec, tensor if sequence else 1)


def split_segments(cfg: Any, spec: TransformerSpec, multiple: int) -> list[int]:
    """``schedule.split``'s cut (uniform where null) of the model's ``spec.seq_len`` tokens
    into ``pipeline.segments`` segments, each a multiple of ``multiple`` (sequence
    parallelism cuts each segment into its tensor ranks' slices). Raises ConfigError."""
    split = cfg["schedule"].get("split")
    try:
        return split_sequence("uniform" if split is None else split, spec.seq_len, cfg["pipeline"].get("segments", 1),
                              spec, multiple=multiple)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def simulation_segments(cfg: DictConfig, schedule: Schedule, lengths: list[int] | None) -> list[int] | None:
    """The segment lengths the cost model prices (None: whole sequences), the run's
    ``lengths`` checked against the cost group: analytic takes them as
    cost.segment_lengths (an explicit list there wins, if it has one length per
    segment), unit prices every segment alike, profiled measured whole sequences only."""
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


def host_calibrated(cfg: DictConfig, cost: CostModel | None) -> bool:
    """Whether a calibration describes the host the run's devices sit on (``local_cpu``
    under ``cost=calibrated``): its topology is then the calibration's."""
    return isinstance(cost, CalibratedCost) and cfg.topology.name == "local_cpu"


def _profile(path: str):
    """The device profile at ``path``, or a ConfigError saying what is wrong with it."""
    from pipeflow.planning.device_profile import ProfileError
    from pipeflow.planning.from_sweep import load_profile

    try:
        return load_profile(path)
    except ProfileError as err:
        raise ConfigError(str(err)) from None


def profiled_host(path: str) -> dict:
    """The ``local_cpu`` keys a CPU profile measured (its cores, their contention, a gloo
    message's cost, the all-reduce's rate: section ``pipeline``), none where it has none."""
    return dict(_profile(path).host)


def profiled_sync(path: str, spec, schedule: Schedule) -> float:
    """Seconds of a synchronous step's synchronisation on a profiled CPU host
    (:meth:`pipeflow.planning.device_profile.DeviceProfile.step_sync`); 0 where the
    profile calibrated no reference pipeline."""
    from pipeflow.planning.device_profile import sync_collectives

    return _profile(path).step_sync(sync_collectives(spec, schedule))


def check_profile_cost(cfg: DictConfig, cost: CostModel) -> None:
    """A device profile (topology.device_profile) is read by the analytic cost alone: under
    another cost model it would be ignored, so it is refused; under the analytic cost it
    is read now, so that one that prices nothing (a sweep whose sections were skipped) is
    refused before the simulation, not in the middle of it."""
    profile = cfg.topology.get("device_profile")
    if profile and cost.name != "analytic":
        raise ConfigError(f"topology.device_profile={profile}: a device profile prices the operators of "
                          f"cost=analytic, and cost={cost.name} prices its actions its own way; use cost=analytic, "
                          f"or leave topology.device_profile null")
    if profile:
        _profile(profile)


def run_topology(cfg: DictConfig, schedule: Schedule, tensor: int = 1, host: dict | None = None) -> Topology:
    """The topology the run's devices sit on. ``tensor`` > 1 (pipeline.tensor_parallel):
    T physical devices per schedule device, seen as their tensor groups
    (:class:`pipeflow.topology.tensor.TensorTopology`, T consecutive devices of one node).
    ``host``: topology keys a calibration measured of this host (:func:`host_calibrated`)."""
    topo_cfg = cfg.topology
    if host is not None:
        topo_cfg = {**OmegaConf.to_container(cfg.topology, resolve=True), **host}
    elif cfg.topology.name == "local_cpu" and cfg.topology.get("device_profile"):
        # the host's cores, their contention and a gloo message's cost, as the profile's own
        # reference pipeline measured them (section pipeline)
        topo_cfg = {**OmegaConf.to_container(cfg.topology, resolve=True), **profiled_host(cfg.topology.device_profile)}
    needed = devices_needed_for(cfg)
    if tensor > 1:
        needed += f" and pipeline.tensor_parallel={tensor}: {schedule.num_devices} x {tensor} devices"
    try:
        physical = build_topology(topo_cfg, schedule.num_devices * tensor, needed_for=needed)
    except ValueError as err:
        raise naming_key("topology", cfg.topology.name, err) from None
    try:
        return tensor_topology(physical, tensor)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def branched_schedule(cfg: DictConfig, sched_spec: ScheduleSpec | None = None) -> tuple[Schedule, list]:
    """A concurrent-branch model's stage graph (cut at the interaction layers), grouped
    onto the schedule's chain of devices, and what each stage holds; generated, not
    validated (bapp's coordinator runs here, once per job). ``sched_spec``: the
    schedule's :func:`schedule_spec`, where known."""
    from pipeflow.planning.cbm_shape import cbm_shape, cbm_stage_counts, cbm_stage_graph

    if cfg.pipeline.get("data_parallel", 1) != 1:
        raise ConfigError(f"pipeline.data_parallel={cfg.pipeline.data_parallel}: a branched model's stages are "
                          f"placed by its own graph; data parallelism wraps chain models (use pipeline.data_parallel=1)")
    if cfg.pipeline.get("shard", "none") != "none":
        raise ConfigError(f"pipeline.shard={cfg.pipeline.shard}: a branched model's stages are not sharded "
                          f"(allowed values: none)")
    plain = OmegaConf.to_container(cfg.model, resolve=True)
    sched_spec = sched_spec or schedule_spec(cfg.schedule)
    bapp = sched_spec.branch_aware
    try:
        shape = cbm_shape(plain)
        # bapp cuts each branch into pipeline.stages stages; chain schedules group the graph
        counts = (cfg.pipeline.stages, cfg.pipeline.stages) if bapp else cbm_stage_counts(shape, cfg.pipeline.stages)
        graph, specs = cbm_stage_graph(plain, *counts)
    except ValueError as err:
        raise naming_key("model", cfg.model.name, err) from None
    pipe = cfg.pipeline
    options = schedule_options(cfg.schedule, sched_spec)
    try:
        if "coordinate" in sched_spec.config_keys and cfg.schedule.get("coordinate", True) is not False:
            if options:
                raise ConfigError(f"schedule.{next(iter(options))}={next(iter(options.values()))}: the coordinator "
                                  f"chooses bapp's policy; set schedule.coordinate=false to give it yourself")
            from pipeflow.planning.coordinator import coordinate

            cost = branched_cost(cfg, specs) if "cost" in cfg else _default_branched_cost(cfg, specs)
            topology = build_topology(cfg.topology, pipe.stages, needed_for=devices_needed_for(cfg))
            limit = cfg.schedule.get("memory_limit_gb")
            schedule = coordinate(pipe.stages, pipe.microbatches, graph, cost, topology,
                                  memory_limit=None if limit is None else float(limit) * 1e9).schedule
        else:
            schedule = build_schedule(cfg.schedule.name, pipe.stages, pipe.microbatches, pipe.virtual_stages,
                                      pipe.segments, check=False, graph=graph,
                                      data_parallel=pipe.get("data_parallel", 1), **options)
    except (ScheduleConfigError, ValueError) as err:
        raise ConfigError(str(err)) from None
    return schedule, specs


def _default_branched_cost(cfg: DictConfig, specs: list) -> CostModel:
    """Training configs carry no cost group: the coordinator orders by FLOPs (analytic defaults)."""
    from pipeflow.planning.branched_cost import BranchedAnalyticCost

    return BranchedAnalyticCost(OmegaConf.to_container(cfg.model, resolve=True),
                                [(s.branch, s.lo, s.hi) for s in specs], cfg.pipeline.microbatch_size)


def branched_cost(cfg: DictConfig, specs: list, dtype_bytes: int | None = None) -> CostModel:
    """The cost of a concurrent-branch model's stages; ``dtype_bytes``: the precision's,
    where ``cost.dtype_bytes`` is unset (the analytic cost's default is 16 bits)."""
    from pipeflow.planning.branched_cost import BranchedAnalyticCost

    params = {k: v for k, v in OmegaConf.to_container(cfg.cost, resolve=True).items() if v is not None}
    name = params.pop("name")
    if name == "analytic" and "dtype_bytes" not in params and dtype_bytes is not None:
        params["dtype_bytes"] = dtype_bytes
    try:
        if name in ("unit", "calibrated"):
            return build_cost_model(cfg.cost, len(specs), None, cfg.pipeline.microbatch_size)
        if name == "analytic":
            params.pop("layers_per_stage", None)
            params.pop("segment_lengths", None)
            overlap = params.pop("overlap", 0.0)
            cost = BranchedAnalyticCost(OmegaConf.to_container(cfg.model, resolve=True),
                                        [(s.branch, s.lo, s.hi) for s in specs], cfg.pipeline.microbatch_size, **params)
            cost.overlap = float(overlap)
            return cost
    except (TypeError, ValueError) as err:
        raise naming_key("cost", name, err) from None
    raise ConfigError(f"cost.name={name}: a concurrent-branch model is priced by analytic, unit or calibrated; "
                      f"allowed values: analytic, unit, calibrated")
