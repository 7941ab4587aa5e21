"""pipeflow-search: which schedule should I use? Every schedule, stage count, data
parallelism, microbatch size, chunk count, segment count, recomputation and partition
for a model on a topology, a global batch and a memory limit per device; no GPU needed.

    pipeflow-search                                            # llama3_8b on 2 x 8 A100s
    pipeflow-search topology.nodes=8 search.global_batch=1024  # 64 GPUs
    pipeflow-search model=gpt_small topology=local_cpu topology.num_devices=4 search.memory_limit_gb=2
    pipeflow-search search.schedules=[1f1b,zb_h1,zb_v] search.recompute=[none]
    pipeflow-search search.staleness=true                      # asynchronous schedules too

Each candidate is priced in closed form and the fastest simulated
(:mod:`pipeflow.planning.search`); the files it writes: docs/planning.md."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeflow.config import CONF_DIR, ConfigError, check_logger, drop_empty_run_dir, run_app, save_hydra_config
from pipeflow.faults import Fault
from pipeflow.formats.files import write_aside
from pipeflow.planning.search import (NothingFits, SearchResult, collector_off,
                                      default_workers, pareto, search)
from pipeflow.planning.search.verdicts import (candidate_config, draw_pareto, format_search, train_config,
                                             write_candidates_csv, write_json)
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.tracking.record import run_key, write_summary


from pipeflow.config.search_app import (SearchAppConfig, SearchInputs, SearchOptions, compose_search,  # noqa: F401
                                    prepare_search, register_search_configs)

log = logging.getLogger("pipeflow.search")


def run_search(cfg: DictConfig, out_dir: str | Path) -> tuple[SearchResult, list[str]]:
    """Search and write the files; return the result and the file names. ConfigError naming the
    key for a config that cannot be searched, or the smallest requirement where nothing fits."""
    with collector_off():  # (the search's objects are kept until its files are written)
        return _run_search(cfg, out_dir)


def _run_search(cfg: DictConfig, out_dir: str | Path) -> tuple[SearchResult, list[str]]:
    inputs = prepare_search(cfg)
    try:
        workers = cfg.search.workers or default_workers()
        every = cfg.search.get("progress")
        result = search(inputs.space, inputs.pricer, int(cfg.search.simulate), int(workers),
                        progress_every=None if every is None else float(every), say=log.info)
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
    write_aside(out / "best.yaml", train_config(result.best, model, header, attention, cfg.precision))
    k = min(int(cfg.search.write_top), len(result.ranked))
    (out / "candidate").mkdir(exist_ok=True)
    for n, q in enumerate(result.ranked[:k], 1):
        write_aside(out / "candidate" / f"c{n}.yaml", candidate_config(q, n, model, attention, cfg.precision))
        (out / "predicted" / f"c{n}").mkdir(parents=True, exist_ok=True)
        write_summary(out / "predicted" / f"c{n}", predicted_summary(q, cfg, topology, n))
    if k:
        files += [f"candidate/c1..c{k}.yaml", f"predicted/c1..c{k}/summary.json"]
    write_summary(out, predicted_summary(result.best, cfg, topology, 1))
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
        "microbatch_size": c.microbatch_size, "partition": c.partition, "split": c.split, "shard": c.shard,
        "gather": c.gather if c.shard == "full" else None,
        "num_devices": c.devices, "makespan": q.step_time, "bubble_ratio": q.bubble,
        "peak_memory_bytes": q.peak_memory, "memory_limit_bytes": q.memory_limit, "fits": q.fits,
        "tokens_per_s": q.tokens_per_s, "model": model,
        "cost": {"name": "analytic", "efficiency": float(cfg.cost.efficiency), "precision": cfg.precision},
        "topology": topology.to_dict(), "overrides": c.overrides(), "files": ["summary.json"],
        "precision": cfg.precision,
        # the run best.yaml (or the sweep's +candidate=cN) trains
        "run_key": run_key({"pipeline": {key: getattr(c, key) for key in ("stages", "microbatches", "virtual_stages",
                                                                          "segments", "microbatch_size",
                                                                          "data_parallel", "shard", "gather")},
                            "schedule": {"name": c.schedule}, "model": model, "partition": {"name": c.partition},
                            "precision": cfg.precision, "topology": {"name": cfg.topology.name}}),
    }


@hydra.main(config_path=str(CONF_DIR), config_name="search", version_base="1.3")
def search_app(cfg: DictConfig) -> None:
    out_dir = HydraConfig.get().runtime.output_dir
    try:
        save_hydra_config(cfg)
        check_logger(cfg.logger)
        result, files = run_search(cfg, out_dir)
    except Fault as err:  # a bad config, a file that could not be written: one sentence
        drop_empty_run_dir(out_dir)
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
