"""What sharding the replicas of a stage costs and saves, per schedule: the simulator's
step time and per-GPU peak for each ``pipeline.shard`` level and gather policy
(``pipeline.gather``), for a 7B and a 70B model on the ``cluster`` topology. Simulated,
so deterministic: the figures in docs/training.md come from this command.

    .venv/bin/python -m benchmarks.bench_sharding                 # both models
    .venv/bin/python -m benchmarks.bench_sharding --model gpt_7b
"""

from __future__ import annotations

import argparse
import time

from pipeflow.config import compose, prepare_simulation
from pipeflow.schedules.sharding import gathers_per_step
from pipeflow.sim.engine import simulate
from pipeflow.sim.device_memory import device_memory, library_workspace

# (model, its run on `cluster`): 7B on 2 nodes (4 stages x 4 replicas), 70B on 8 nodes
# (16 stages x 4 replicas, every layer recomputed); one 8k sequence a microbatch, 2 rounds
# of microbatches a stage
RUNS = {
    "gpt_7b": ["model=gpt_7b", "topology=cluster", "topology.nodes=2", "pipeline.stages=4",
               "pipeline.data_parallel=4", "pipeline.microbatches=16"],
    "llama3_70b": ["model=llama3_70b", "model.recompute=full", "topology=cluster", "topology.nodes=8", "pipeline.stages=16",
                   "pipeline.data_parallel=4", "pipeline.microbatches=32"],
}
SCHEDULES = [("gpipe", []), ("1f1b", []), ("interleaved_1f1b", ["pipeline.virtual_stages=2"]), ("zb_h1", []),
             ("zb_v", ["pipeline.virtual_stages=2"]), ("seq1f1b", ["pipeline.segments=2"])]
LEVELS = [("none", []), ("optimizer", []), ("gradients", []), ("full", ["pipeline.gather=step"]),
          ("full", ["pipeline.gather=chunk"]), ("full", ["pipeline.gather=microbatch"])]


def row(over: list[str]) -> dict:
    prep = prepare_simulation(compose("simulate", over))
    sched = prep.schedule
    result = simulate(sched, prep.cost, prep.topology)
    memory = device_memory(sched, prep.cost, result.per_device, library_workspace(prep.topology, sched.num_devices))
    gathers = gathers_per_step(sched)
    limit = min(d.memory_bytes for d in prep.topology.devices)
    peak = max(m["peak_bytes"] for m in memory)
    return {"step": result.makespan, "peak": peak / 2**30, "fits": peak <= limit,
            "gathers": max(gathers.values()) if gathers else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(RUNS), action="append", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    for model in args.model or list(RUNS):
        print(f"\n### {model}: `{' '.join(RUNS[model])}`\n")
        print("| schedule | shard | gather | gathers a stage, a step | step (s) | peak GiB (most of any GPU) | fits 80 GB |")
        print("|---|---|---|---:|---:|---:|---|")
        for name, extra in SCHEDULES:
            for level, policy in LEVELS:
                r = row([*RUNS[model], f"schedule={name}", *extra, f"pipeline.shard={level}", *policy])
                gather = policy[0].split("=")[1] if policy else "-"
                print(f"| {name} | {level} | {gather} | {r['gathers']} | {r['step']:.3f} | {r['peak']:.1f} | "
                      f"{'yes' if r['fits'] else 'no'} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
