"""pipeflow-plan: a pipeline plan for a model on a topology, no GPU needed.

    pipeflow-plan                                          # gpt_1.5b on heterogeneous, m = 16
    pipeflow-plan model=bert_1b topology=pcie_8 plan.memory_limit_gb=40
    pipeflow-plan topology=cluster topology.nodes=4 plan.stages=16
    pipeflow-plan model=gpt_7b topology=cluster topology.nodes=2 plan.tensor_parallel=[1,2,4,8]

    pipeflow-plan -m --config-dir sweeps --config-name plan_topologies   # presets x methods

The plan (:mod:`pipeflow.planning.planner`) and the baselines
(:mod:`pipeflow.planning.baselines`) at each tensor degree, printed; plan.json,
summary.json and timeline.png written to the run directory (docs/planning.md)."""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeflow.config import CONF_DIR, ConfigError, check_logger, drop_empty_run_dir, run_app, save_hydra_config
from pipeflow.faults import Fault
from pipeflow.formats.files import write_aside
from pipeflow.planning.baselines import BASELINES
from pipeflow.planning.planner import GB, Plan, evaluate, fits, plan
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.sim.engine import SimResult
from pipeflow.sim.gantt import draw_timeline
from pipeflow.topology.topology import Topology
from pipeflow.tracking.record import run_key, write_summary

from pipeflow.config.plan_app import (METHODS, PlanAppConfig, PlanInputs, PlanOptions, PlanPipelineConfig,  # noqa: F401
                                  compose_plan, prepare_plan, register_plan_configs)

def run_plan(cfg: DictConfig, out_dir: str | Path) -> dict:
    """Plan the configured run, write plan.json, summary.json (and timeline.png); return the
    plan, the baselines and the summary. ConfigError (one sentence naming the key) where the
    config cannot be planned."""
    pipe, opts = cfg.pipeline, cfg.plan
    inputs = prepare_plan(cfg)
    spec, limit, kw = inputs.spec, inputs.limit, inputs.kw
    best, degrees = _chosen_plan(opts.method, spec, inputs, pipe, opts)
    # the chosen degree's topology (its devices tensor groups at T > 1) and cost (one rank)
    topology = inputs.tensors[best.tensor_parallel]
    tkw = dict(tensor_parallel=best.tensor_parallel, sequence_parallel=inputs.sequence_parallel)

    baselines = {}
    if cfg.baselines:
        for name, fn in BASELINES.items():
            if name == opts.method:
                continue
            try:
                b = fn(spec, topology, pipe.microbatches, pipe.microbatch_size, limit, opts.stages, **kw, **tkw)
            except ValueError:
                continue
            baselines[name] = {
                "predicted_iteration_time": b.predicted_iteration_time,
                "fits": fits(b, topology, limit),
                "layers_per_stage": b.layers_per_stage,
                "device_of_stage": b.device_of_stage,
                "peak_memory_bytes": b.peak_memory_bytes,
            }

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ["plan.json"]
    _, res = evaluate(spec, topology, best.layers_per_stage, best.device_of_stage, pipe.microbatches,
                      pipe.microbatch_size, limit, record=cfg.draw, replica_devices=best.replica_devices, **kw, **tkw)
    if cfg.draw:
        draw_timeline(res.timeline, out / "timeline.png", title=timeline_title(best, topology.name))
        files.append("timeline.png")
    files.append("summary.json")
    doc = {
        **best.to_dict(),
        "baselines": baselines,
        "tensor_degrees": degrees,
        "topology_summary": topology.to_dict(),
        "model_config": OmegaConf.to_container(cfg.model, resolve=True),
        "files": files,
    }
    write_aside(out / "plan.json", json.dumps(doc, indent=2) + "\n")
    summary = simulated_summary(best, res, topology, cfg, fits(best, topology, limit), files)
    write_summary(out, summary)
    return {"plan": best, "baselines": baselines, "degrees": degrees, "files": files, "devices": topology.devices,
            "limit": limit, "summary": summary}


def _chosen_plan(method: str, spec: TransformerSpec, inputs: PlanInputs, pipe: DictConfig,
                 opts: DictConfig) -> tuple[Plan, dict]:
    """The plan of ``plan.method`` at each degree of plan.tensor_parallel the model and nodes
    take, the fastest that fits (a baseline's at the lowest degree when none does), and per
    degree (str keys) the best plan's figures or why it has none."""
    limit, kw, sp = inputs.limit, inputs.kw, inputs.sequence_parallel
    plans: dict[int, Plan] = {}
    degrees: dict[str, dict] = {str(t): {"left_out": why} for t, why in inputs.left_out.items()}
    for t, topology in inputs.tensors.items():
        try:
            if method == "planner":
                got = plan(spec, topology, pipe.microbatches, pipe.microbatch_size, limit, opts.stages,
                           top_k=int(opts.top_k), replicas=opts.replicas, tensor_parallel=t, sequence_parallel=sp, **kw)
            else:
                got = BASELINES[method](spec, topology, pipe.microbatches, pipe.microbatch_size, limit, opts.stages,
                                        tensor_parallel=t, sequence_parallel=sp, **kw)
        except ValueError as err:
            degrees[str(t)] = {"no_plan": str(err)}
            continue
        plans[t] = got
        degrees[str(t)] = {"predicted_iteration_time": got.predicted_iteration_time, "stages": got.num_stages,
                           "replicas": got.replicas, "gpus": got.num_devices_used * t,
                           "peak_memory_bytes": got.peak_memory_bytes, "fits": fits(got, topology, limit)}
    degrees = dict(sorted(degrees.items(), key=lambda kv: int(kv[0])))
    if not plans:
        last = max(inputs.tensors)
        why = degrees[str(last)]["no_plan"]
        if len(inputs.tensors) > 1:
            why = f"plan.tensor_parallel={list(opts.tensor_parallel)}: no degree has a plan; at T={last}: {why}"
        raise ConfigError(why)
    fitting = [p for t, p in plans.items() if degrees[str(t)]["fits"]]
    best = min(fitting, key=lambda p: p.predicted_iteration_time) if fitting else plans[min(plans)]
    return best, degrees


def timeline_title(p: Plan, topology: str) -> str:
    """The title of a plan's predicted timeline."""
    who = "plan" if p.method == "planner" else f"{p.method} baseline"
    reps = f" x {p.replicas} replicas" if p.replicas > 1 else ""
    tensor = f" of {p.tensor_parallel} GPUs{' (SP)' if p.sequence_parallel else ''}" if p.tensor_parallel > 1 else ""
    return (f"{who}: {p.num_stages} stages{reps}{tensor}, m={p.microbatches}, {p.model} on {topology}, "
            f"{p.predicted_iteration_time * 1e3:.1f} ms")


def simulated_summary(p: Plan, res: SimResult, topology: Topology, cfg: DictConfig, fit: bool,
                      files: list[str]) -> dict:
    """summary.json of a plan: pipeflow-simulate's keys plus the plan's own; the bubble ratio
    and ``per_device`` cover the devices the plan uses."""
    used = sorted({d for row in p.pipelines for d in row})
    per_device = [d for d in res.summary()["per_device"] if d["device"] in used]
    busy = sum(d["busy"] for d in per_device)
    return {
        "kind": "simulated",
        "method": p.method,  # planner | uniform | pipedream | dapple
        "schedule": p.schedule,  # the microbatch order of every pipeline (1f1b)
        "stages": p.num_stages,
        "replicas": p.replicas,
        "microbatches": p.microbatches,
        "microbatch_size": p.microbatch_size,
        "num_devices": len(used),  # schedule devices: tensor groups of tensor_parallel GPUs each
        "tensor_parallel": p.tensor_parallel,
        "sequence_parallel": p.sequence_parallel,
        "makespan": res.makespan,
        "bubble_ratio": 1.0 - busy / (len(used) * res.makespan) if res.makespan > 0 else 0.0,
        "peak_activation_bytes": max(d["peak_activation_bytes"] for d in per_device),
        "peak_memory_bytes": p.peak_memory_bytes,  # activations + model state, the largest stage
        "memory_limit_bytes": p.memory_limit_bytes,
        "fits": fit,
        "p2p_bytes": res.p2p_bytes,
        "collective_bytes": res.collective_bytes,
        "layers_per_stage": p.layers_per_stage,
        "placement": p.pipelines,
        "per_device": per_device,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "cost": res.cost,
        "topology": topology.to_dict(),
        "precision": cfg.precision,
        "files": files,
        # what pipeflow-train schedule=planned schedule.plan=<its plan.json> measures
        "run_key": run_key(_with_tensor(cfg, p), schedule="planned", stages=p.num_stages, data_parallel=p.replicas),
    }


def _with_tensor(cfg: DictConfig, p: Plan) -> dict:
    """What run_key reads of the config, with the plan's tensor degree as its pipeline's."""
    pipe = {**OmegaConf.to_container(cfg.pipeline, resolve=True), "tensor_parallel": p.tensor_parallel,
            "sequence_parallel": p.sequence_parallel}
    return {"pipeline": pipe, "model": cfg.model, "precision": cfg.precision, "topology": cfg.topology}


def format_plan(summary: dict) -> str:
    """The console table: one row per stage, then the baselines."""
    p: Plan = summary["plan"]
    devs = summary["devices"]
    limit = summary["limit"]
    head = [
        f"model         {p.model} on {p.topology} ("
        + (f"{len(devs)} devices)" if p.tensor_parallel == 1
           else f"{len(devs)} tensor groups of {p.tensor_parallel} GPUs)"),
        *([f"method        {p.method} baseline (plan.method)"] if p.method != "planner" else []),
        f"stages        {p.num_stages}"
        + (f" x {p.replicas} data-parallel replicas ({p.num_devices_used} "
           f"{'devices' if p.tensor_parallel == 1 else 'groups'})" if p.replicas > 1 else "")
        + f", schedule {p.schedule}, {p.microbatches} microbatches of {p.microbatch_size}",
        *([f"tensor        T={p.tensor_parallel}: each device a group of {p.tensor_parallel} GPUs of one node"
           + (", sequence parallel" if p.sequence_parallel else "")
           + f" ({p.num_devices_used * p.tensor_parallel} GPUs); figures per GPU"]
          if p.tensor_parallel > 1 or len(summary.get("degrees", {})) > 1 else []),
        f"iteration     {p.predicted_iteration_time * 1e3:.3f} ms (simulated)",
        f"memory limit  {'device memory' if limit is None else f'{limit / GB:g} GB'} per device; "
        f"peak {p.peak_memory_bytes / GB:.2f} GB",
        "",
    ]
    where_col = "device" if p.tensor_parallel == 1 else "group"
    cols = ("stage", "layers", "blocks", where_col if p.replicas == 1 else where_col + "s", "kind",
            "F+B / mb (ms)", "memory (GB)")
    rows, start = [], 0
    for s, (n, d) in enumerate(zip(p.layers_per_stage, p.device_of_stage)):
        where = ",".join(str(row[s]) for row in p.pipelines)
        kinds = sorted({f"{devs[row[s]].name}@node{devs[row[s]].node}" for row in p.pipelines})
        rows.append((str(s), str(n), f"{start}-{start + n - 1}", where, ",".join(kinds),
                     f"{p.stage_compute_time[s] * 1e3:.3f}", f"{p.stage_memory_bytes[s] / GB:.2f}"))
        start += n
    lines = head + _table(cols, rows)
    if len(summary.get("degrees", {})) > 1:
        lines += ["", "tensor degrees (plan.tensor_parallel), the best plan of each:"]
        for t, d in summary["degrees"].items():
            if "predicted_iteration_time" in d:
                reps = f" x {d['replicas']} replicas" if d["replicas"] > 1 else ""
                mark = "   <- the plan" if int(t) == p.tensor_parallel else ""
                lines.append(f"  T={t}: {d['predicted_iteration_time'] * 1e3:.3f} ms, {d['stages']} stages{reps}, "
                             f"{d['gpus']} GPUs, peak {d['peak_memory_bytes'] / GB:.2f} GB"
                             + ("" if d["fits"] else ", does NOT fit") + mark)
            else:
                lines.append(f"  T={t}: " + (f"left out: {d['left_out']}" if "left_out" in d
                                              else f"no plan: {d['no_plan']}"))
    if summary["baselines"]:
        at = f", T={p.tensor_parallel}" if p.tensor_parallel > 1 else ""
        lines += ["", f"baselines (same simulator{at}):"]
        brow = []
        for name, b in summary["baselines"].items():
            t = b["predicted_iteration_time"]
            brow.append((name, f"{t * 1e3:.3f}", f"{t / p.predicted_iteration_time:.3f}x",
                         "yes" if b["fits"] else "NO", str(len(b["layers_per_stage"]))))
        lines += _table(("planner", "iteration (ms)", "vs plan", "fits", "stages"), brow)
    return "\n".join(lines)


def _table(cols, rows) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    out += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return out


@hydra.main(config_path=str(CONF_DIR), config_name="plan", version_base="1.3")
def plan_app(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    out_dir = hydra_cfg.runtime.output_dir
    try:
        save_hydra_config(cfg)
        check_logger(cfg.logger)
        summary = run_plan(cfg, out_dir)
    except Fault as err:  # a bad config, a file that could not be written: one sentence
        drop_empty_run_dir(out_dir)
        raise SystemExit(str(err)) from None
    print(format_plan(summary))
    print(f"\nwrote {', '.join(summary['files'])} to {out_dir}")
    if cfg.logger.name == "wandb":
        from pipeflow.tracking.simulated import log_simulated_run

        log_simulated_run(cfg, hydra_cfg, out_dir, summary["summary"],
                          timeline_title(summary["plan"], summary["summary"]["topology"]["name"]))


def main() -> None:
    """The console script: the command line checked before Hydra composes (one line for a
    bad group choice, key or output folder), then the app."""
    run_app(plan_app, "plan")


if __name__ == "__main__":
    main()
