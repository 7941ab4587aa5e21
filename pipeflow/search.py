"""pipeflow-search: which schedule should I use? Every schedule, stage count, data
parallelism, microbatch size, chunk count, segment count, recomputation and partition
for a model on a topology, a global batch and a memory limit per device; no GPU needed.

    pipeflow-search                                            # llama3_8b on 2 x 8 A100s
    pipeflow-search topology.nodes=8 search.global_batch=1024  # 64 GPUs
    pipeflow-search model=gpt_small topology=local_cpu topology.num_devices=4 search.memory_limit_gb=2
    pipeflow-search search.schedules=[1f1b,zb_h1,zb_v] search.recompute=[none]
    pipeflow-search search.staleness=true                      # asynchronous schedules too

Every candidate trains the same global batch (``search.global_batch`` sequences per
update) on all the devices. Each is priced in closed form (the schedule's bubble
formula, its memory exactly as the simulator counts it); the ``search.simulate``
fastest that fit, and the fastest of every schedule, are simulated, and the simulator's
order is the answer (:mod:`pipeflow.planning.search`). Writes to the Hydra run
directory: search.json (the table, the front, what did not fit), candidates.csv (every
priced candidate), pareto.png, best.yaml (``pipeflow-train --config-dir <dir>
--config-name best``), candidate/cN.yaml (the top ``search.write_top``, trained side by
side by ``sweeps/search_top.yaml``), predicted/cN/summary.json (their simulated
summaries) and summary.json (the pick's), which ``pipeflow-compare`` reads beside
measured runs. A budget nothing fits stops with one sentence naming the smallest
requirement found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf

from pipeflow.config import CONF_DIR, ConfigError, check_logger, compose, register_configs, run_app
from pipeflow.config.checks import check_known_keys, resolve_model
from pipeflow.config.values import PRECISIONS, _at_least
from pipeflow.families import family_of
from pipeflow.planning.search import (GIB, PARTITIONS, RECOMPUTE, SPLITS, NothingFits, Pricer, SearchResult,
                                      SearchSpace, default_schedules, default_workers, pareto, search, searchable)
from pipeflow.planning.search.host import fitted_host
from pipeflow.planning.search.report import (candidate_config, draw_pareto, format_search, train_config,
                                             write_candidates_csv, write_json)
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.registry import get_spec, schedule_names
from pipeflow.topology.presets import build_topology


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
    simulate: int = 16  # the fastest fitting candidates simulated (plus each schedule's fastest)
    workers: Optional[int] = None  # processes pricing side by side; null: one per core this process may use
    # topology=local_cpu: calibration.json files of this model (python -m pipeflow.calibrate), one or several
    # microbatch sizes, to fit the host (pipeflow.planning.search.host)
    calibration: Optional[List[str]] = None
    top: int = 12  # rows of the console table
    write_top: int = 8  # top candidates written as candidate/NN.yaml for sweeps/search_top.yaml


@dataclass
class SearchAppConfig:
    search: SearchOptions = field(default_factory=SearchOptions)
    model: Any = MISSING
    topology: Any = MISSING
    cost: Any = MISSING
    precision: str = "bf16"  # fp32 | bf16 | fp16: bytes per element and the devices' peak for it
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
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision={cfg.precision}: allowed values: {', '.join(PRECISIONS)}")
    _at_least("search.global_batch", opts.global_batch, 1)
    _at_least("search.simulate", opts.simulate, 1)
    _at_least("search.top", opts.top, 1)
    if opts.workers is not None:
        _at_least("search.workers", opts.workers, 1)
    _at_least("search.write_top", opts.write_top, 0)
    limit = opts.memory_limit_gb
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        raise ConfigError(f"search.memory_limit_gb={limit}: a number > 0 (GiB per device), or null for each "
                          f"device's own memory")
    if opts.devices is None and cfg.topology.name == "local_cpu" and cfg.topology.get("num_devices") is None:
        raise ConfigError("search.devices=null: topology=local_cpu has as many ranks as asked for; "
                          "set search.devices (or topology.num_devices) to the ranks to search over, e.g. 4")
    dtype = 4 if cfg.precision == "fp32" else 2
    try:
        spec = TransformerSpec.from_config(cfg.model)
        topo_cfg = OmegaConf.to_container(cfg.topology, resolve=True)
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
    space = SearchSpace(
        devices=topology.num_devices, global_batch=int(opts.global_batch), n_layer=spec.n_layer, schedules=names,
        stages=None if opts.stages is None else _whole("search.stages", opts.stages),
        microbatch_sizes=_whole("search.microbatch_sizes", opts.microbatch_sizes),
        virtual_stages=_whole("search.virtual_stages", opts.virtual_stages),
        segments=_whole("search.segments", opts.segments),
        recompute=_choices("search.recompute", opts.recompute, RECOMPUTE),
        partitions=_choices("search.partitions", opts.partitions, PARTITIONS),
        splits=_choices("search.splits", opts.splits, SPLITS))
    if space.stages is not None and not space.stage_counts():
        raise ConfigError(f"search.stages={list(space.stages)}: none divides the {space.devices} devices")
    pricer = Pricer(spec, topology, float(cfg.cost.efficiency), dtype, float(cfg.cost.get("overlap") or 0.0),
                    None if limit is None else float(limit) * GIB)
    return SearchInputs(space, pricer, spec)


def run_search(cfg: DictConfig, out_dir: str | Path) -> tuple[SearchResult, list[str]]:
    """Search and write the files; return the result and the file names. Raises
    ConfigError naming the key for a config that cannot be searched, or the smallest
    requirement found for a budget nothing fits."""
    inputs = prepare_search(cfg)
    try:
        workers = cfg.search.workers or default_workers()
        result = search(inputs.space, inputs.pricer, int(cfg.search.simulate), int(workers))
    except NothingFits as err:
        raise ConfigError(f"search.memory_limit_gb={cfg.search.memory_limit_gb}: {err}") from None
    except (ValueError, ScheduleConfigError) as err:
        raise ConfigError(str(err)) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    topology = inputs.pricer.topology
    model = cfg.model.name
    files = ["search.json", "candidates.csv", "best.yaml", "summary.json"]
    write_candidates_csv(result, out / "candidates.csv")
    header = f"pipeflow-search's pick for {model} on {topology.name} ({topology.num_devices} devices)"
    attention = str(cfg.model.get("attention") or "sdpa")  # what the search priced, trained the same
    (out / "best.yaml").write_text(train_config(result.best, model, header, attention))
    k = min(int(cfg.search.write_top), len(result.ranked))
    (out / "candidate").mkdir(exist_ok=True)
    for n, q in enumerate(result.ranked[:k], 1):
        (out / "candidate" / f"c{n}.yaml").write_text(candidate_config(q, n, model, attention))
        (out / "predicted" / f"c{n}").mkdir(parents=True, exist_ok=True)
        write_json(out / "predicted" / f"c{n}" / "summary.json", predicted_summary(q, cfg, topology, n))
    if k:
        files += [f"candidate/c1..c{k}.yaml", f"predicted/c1..c{k}/summary.json"]
    write_json(out / "summary.json", predicted_summary(result.best, cfg, topology, 1))
    if cfg.draw:
        draw_pareto(result, out / "pareto.png", f"{model} on {topology.name} ({topology.num_devices} devices), "
                                                f"global batch {inputs.space.global_batch}")
        files.append("pareto.png")
    write_json(out / "search.json", {
        "model": model, "topology": topology.to_dict(), "global_batch": inputs.space.global_batch,
        "memory_limit_bytes": inputs.pricer.memory_limit, "considered": result.considered,
        "priced": len(result.closed), "simulated": len(result.simulated), "seconds": result.seconds,
        "phases": result.phases, "refused": result.refused, "skipped": inputs.space.skipped,
        "pick": result.best.to_dict(), "ranked": [q.to_dict() for q in result.ranked],
        "pareto": [q.to_dict() for q in pareto(result.ranked)],
        "out_of_memory": {"count": len(result.out_of_memory),
                          "closest": [q.to_dict() for q in result.out_of_memory[:50]]},
        "files": files,
    })
    return result, files


def predicted_summary(q, cfg: DictConfig, topology, rank: int) -> dict:
    """A simulated candidate as pipeflow-simulate's summary.json (``kind: simulated``), so
    pipeflow-compare pairs it with a measured run of the same configuration."""
    c = q.candidate
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["recompute"] = c.recompute
    return {
        "kind": "simulated", "source": "pipeflow-search", "rank": rank, "schedule": c.schedule,
        "stages": c.stages, "data_parallel": c.data_parallel, "world_size": c.devices,
        "microbatches": c.microbatches, "virtual_stages": c.virtual_stages, "segments": c.segments,
        "microbatch_size": c.microbatch_size, "partition": c.partition, "split": c.split,
        "num_devices": c.devices, "makespan": q.step_time, "bubble_ratio": q.bubble,
        "peak_memory_bytes": q.peak_memory, "memory_limit_bytes": q.memory_limit, "fits": q.fits,
        "tokens_per_s": q.tokens_per_s, "model": model,
        "cost": {"name": "analytic", "efficiency": float(cfg.cost.efficiency), "precision": cfg.precision},
        "topology": topology.to_dict(), "overrides": c.overrides(), "files": ["summary.json"],
    }


@hydra.main(config_path=str(CONF_DIR), config_name="search", version_base="1.3")
def search_app(cfg: DictConfig) -> None:
    out_dir = HydraConfig.get().runtime.output_dir
    try:
        check_logger(cfg.logger)
        result, files = run_search(cfg, out_dir)
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    print(format_search(result, cfg.model.name, cfg.topology.name, result.best.candidate.devices, int(cfg.search.top)))
    print(f"\nwrote {', '.join(files)} to {out_dir}")
    print(f"train the pick:   pipeflow-train --config-dir {out_dir} --config-name best")
    k = min(int(cfg.search.write_top), len(result.ranked))
    if k:
        print(f"train the top {k}:  {sweep_command(out_dir, k)}")


def sweep_command(out_dir: str | Path, k: int) -> str:
    """The command that trains the top k candidates a search wrote (sweeps/search_top.yaml)."""
    return (f"pipeflow-train -m --config-dir sweeps --config-name search_top "
            f"hydra.searchpath=[file://{Path(out_dir).resolve()}] +candidate={','.join(f'c{n}' for n in range(1, k + 1))}")


def main() -> None:
    """The console script: the command line checked before Hydra composes, then the app."""
    run_app(search_app, "search")


if __name__ == "__main__":
    main()
