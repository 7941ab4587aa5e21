"""pipeflow-search's configuration: its schema (the ``search`` options beside the model,
topology, cost and precision groups every app shares), composition and the up-front
check that builds the search space and its pricer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from pipeflow.families import family_of
from pipeflow.planning.search import (GATHERS, GIB, PARTITIONS, RECOMPUTE, SHARDS, SPLITS, Pricer, SearchSpace, default_schedules,
                                      searchable)
from pipeflow.planning.search.host import fitted_host
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.registry import get_spec, schedule_names
from pipeflow.topology.presets import build_topology

from .checks import check_known_keys
from .groups.model import resolve_model
from .groups.precision import resolve_precision
from .schema import compose, register_configs
from .tensor_degree import grouped_topology
from .values import ConfigError, at_least


@dataclass
class SearchOptions:
    global_batch: int = 256  # sequences per update, the same for every candidate
    memory_limit_gb: Optional[float] = None  # GiB per device; null: each device's own memory
    devices: Optional[int] = None  # devices every candidate uses; null: the topology's
    schedules: Optional[List[str]] = None  # null: every synchronous chain schedule (with staleness: async too)
    staleness: bool = False  # allow asynchronous schedules (weights updated without a flush)
    stages: Optional[List[int]] = None  # null: every divisor of the devices up to the model's layers
    microbatch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    virtual_stages: List[int] = field(default_factory=lambda: [2, 3, 4, 6, 8])
    segments: List[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])
    recompute: List[str] = field(default_factory=lambda: list(RECOMPUTE))
    partitions: List[str] = field(default_factory=lambda: list(PARTITIONS))
    splits: List[str] = field(default_factory=lambda: list(SPLITS))
    # pipeline.shard of candidates with replicas (none and ZeRO-1 by default: ZeRO-2 and 3 rarely
    # lower a pipeline's peak, and every level is priced anew; docs/planning.md)
    shard: List[str] = field(default_factory=lambda: ["none", "optimizer"])
    gather: List[str] = field(default_factory=lambda: ["step"])  # pipeline.gather of shard=full candidates
    # pipeline.tensor_parallel: GPUs of one node splitting each pipeline device (those the model's heads, MLP
    # width and the topology's nodes take); sequence_parallel with it (true: always cheaper in time and memory)
    tensor_parallel: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    sequence_parallel: List[bool] = field(default_factory=lambda: [True])
    simulate: int = 16  # the fastest fitting candidates simulated (plus each schedule's fastest)
    workers: Optional[int] = None  # processes pricing side by side; null: one per core this process may use
    # topology=local_cpu: calibration.json files of this model (python -m pipeflow.calibrate), one or several
    # microbatch sizes, to fit the host (pipeflow.planning.search.host)
    calibration: Optional[List[str]] = None
    top: int = 12  # rows of the console table
    write_top: int = 8  # top candidates written as candidate/NN.yaml for sweeps/search_top.yaml
    progress: Optional[float] = 10.0  # seconds between progress lines while it prices; 0: at every chance; null: none


@dataclass
class SearchAppConfig:
    search: SearchOptions = field(default_factory=SearchOptions)
    model: Any = MISSING
    topology: Any = MISSING
    cost: Any = MISSING
    precision: str = "auto"  # auto | fp32 | bf16 | fp16: bytes per element, the devices' peak (auto: fp32 on CPUs)
    draw: bool = True  # pareto.png
    logger: Any = MISSING


def register_search_configs() -> None:
    register_configs()
    ConfigStore.instance().store(group="schema", name="search_app", node=SearchAppConfig)


register_search_configs()


def compose_search(overrides=()) -> DictConfig:
    """Compose conf/search.yaml outside ``@hydra.main`` (tests): the configuration
    layer's ``compose`` with the search's schema in the store."""
    register_search_configs()
    return compose("search", overrides)


def _choices(key: str, given, allowed) -> list:
    values = list(given)
    if not values:
        raise ConfigError(f"{key}=[]: give at least one; allowed values: {', '.join(map(str, allowed))}")
    for v in values:
        if v not in allowed:
            raise ConfigError(f"{key}: {v!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")
    return values


def _whole(key: str, given) -> list[int]:
    values = list(given)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ConfigError(f"{key}={values}: give a list of whole numbers >= 1")
    return values


def _tensor_options(cfg, spec: TransformerSpec, topology) -> tuple[list[tuple[int, bool]], dict]:
    """(tensor degree, sequence parallel) pairs to search: those a run could take
    (:func:`pipeflow.config.tensor_degree.grouped_topology`: the model's heads, key/value heads,
    MLP width and, with sequence parallelism, its sequence; groups inside a node); the
    others left out, counted by the sentence that refuses them."""
    opts = cfg.search
    degrees = _whole("search.tensor_parallel", opts.tensor_parallel)
    sps = [bool(v) for v in _choices("search.sequence_parallel", opts.sequence_parallel, (True, False))]
    out, left = [], {}
    for t in sorted(set(degrees)):
        for sp in ([False] if t == 1 else sps):
            why = grouped_topology(spec, topology, t, sp)
            if isinstance(why, str):
                left[why] = 1
            else:
                out.append((t, sp))
    if not out:
        raise ConfigError(f"search.tensor_parallel={degrees}: none of them splits model '{spec.name}' inside a node of "
                          f"the topology ({'; '.join(left)})")
    return out, left


@dataclass
class SearchInputs:
    space: SearchSpace
    pricer: Pricer
    spec: TransformerSpec


def prepare_search(cfg: DictConfig) -> SearchInputs:
    """Check a search config and build the space and the pricer, or raise ConfigError, one
    sentence naming the key and the allowed values. Nothing is priced or written."""
    check_known_keys(cfg)
    resolve_model(cfg)
    opts = cfg.search
    try:
        family = family_of(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not family.transformer:
        raise ConfigError(f"model.family={family.name}: pipeflow-search prices one transformer stack; "
                          f"allowed values: gpt, bert, hf_causal")
    if cfg.cost.name != "analytic":
        raise ConfigError(f"cost.name={cfg.cost.name}: the search prices thousands of configurations, which only the "
                          f"analytic cost model can (calibrated and profiled costs are measured per configuration); "
                          f"allowed values: analytic")
    at_least("search.global_batch", opts.global_batch, 1)
    at_least("search.simulate", opts.simulate, 1)
    at_least("search.top", opts.top, 1)
    if opts.workers is not None:
        at_least("search.workers", opts.workers, 1)
    if opts.devices is not None:  # before the topology reads it as its own num_devices
        at_least("search.devices", opts.devices, 1)
    at_least("search.write_top", opts.write_top, 0)
    every = opts.progress
    if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or every < 0):
        raise ConfigError(f"search.progress={every}: seconds between progress lines, a number >= 0 (0: at every "
                          f"chance), or null for none")
    limit = opts.memory_limit_gb
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        raise ConfigError(f"search.memory_limit_gb={limit}: a number > 0 (GiB per device), or null for each "
                          f"device's own memory")
    if opts.devices is None and cfg.topology.name == "local_cpu" and cfg.topology.get("num_devices") is None:
        raise ConfigError("search.devices=null: topology=local_cpu has as many ranks as asked for; "
                          "set search.devices (or topology.num_devices) to the ranks to search over, e.g. 4")
    try:
        spec = TransformerSpec.from_config(cfg.model)
        topo_cfg = OmegaConf.to_container(cfg.topology, resolve=True)
        dtype = 4 if resolve_precision(cfg, build_topology(topo_cfg, opts.devices)) == "fp32" else 2
        if opts.calibration is not None:
            if cfg.topology.name != "local_cpu":
                raise ValueError(f"search.calibration={opts.calibration}: it fits the CPU ranks of this host; "
                                 f"use it with topology=local_cpu")
            topo_cfg.update(fitted_host(list(opts.calibration), spec, float(cfg.cost.efficiency), dtype))
        topology = build_topology(topo_cfg, opts.devices)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    ok = [n for n in schedule_names() if searchable(get_spec(n)) is None]
    if opts.schedules is None:
        names = default_schedules(bool(opts.staleness))
    else:
        names = _choices("search.schedules", opts.schedules, ok)
        if not opts.staleness:
            stale = [n for n in names if get_spec(n).asynchronous]
            if stale:
                raise ConfigError(f"search.schedules: {', '.join(stale)} update weights without a flush; allow it "
                                  f"with search.staleness=true, or leave them out")
    for n in names:
        if n not in ok:
            raise ConfigError(f"search.schedules: {n} cannot be searched ({searchable(get_spec(n))}); "
                              f"allowed values: {', '.join(ok)}")
    tensors, left_out = _tensor_options(cfg, spec, topology)
    space = SearchSpace(
        devices=topology.num_devices, tensors=tensors, global_batch=int(opts.global_batch), n_layer=spec.n_layer, schedules=names,
        stages=None if opts.stages is None else _whole("search.stages", opts.stages),
        microbatch_sizes=_whole("search.microbatch_sizes", opts.microbatch_sizes),
        virtual_stages=_whole("search.virtual_stages", opts.virtual_stages),
        segments=_whole("search.segments", opts.segments),
        recompute=_choices("search.recompute", opts.recompute, RECOMPUTE),
        partitions=_choices("search.partitions", opts.partitions, PARTITIONS),
        splits=_choices("search.splits", opts.splits, SPLITS),
        shards=_choices("search.shard", opts.shard, SHARDS), gathers=_choices("search.gather", opts.gather, GATHERS))
    space.skipped.update(left_out)
    if space.stages is not None and not any(space.stage_counts(t) for t, _ in tensors):
        raise ConfigError(f"search.stages={list(space.stages)}: none divides the {space.devices} devices")
    pricer = Pricer(spec, topology, float(cfg.cost.efficiency), dtype, float(cfg.cost.get("overlap") or 0.0),
                    None if limit is None else float(limit) * GIB)
    return SearchInputs(space, pricer, spec)
