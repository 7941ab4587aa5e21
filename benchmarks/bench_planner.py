"""How much faster are the topology-aware planner's plans than the baselines'?

For a GPT-1.5B-class (conf/model/gpt_1.5b.yaml) and a BERT-1B-class model
(conf/model/bert_1b.yaml) on several topologies (heterogeneous: A100 and V100 nodes on
a shared Ethernet NIC; pcie_8; two_node_ib; cluster of 4 DGX nodes), for a few
microbatch counts, the simulated 1F1B iteration time of

- the planner (:func:`pipeflow.planning.planner.plan`), which may replicate the
  pipeline (data parallel), and the same planner held to one pipeline (``replicas=1``:
  what the cut and the mapping alone gain; the baselines plan one pipeline too),
- uniform partition + identity mapping,
- the PipeDream-style planner (uniform bandwidth, homogeneous devices, no replication),
- the DAPPLE-style planner (placement policies, homogeneous devices, no replication),

all within each device's memory, printed as a markdown table with the best and median
speedup over each baseline; then the time to plan a 96-layer model over 64 devices
(cluster, 8 nodes of 8).

    .venv/bin/python -m benchmarks.bench_planner
    .venv/bin/python -m benchmarks.bench_planner --microbatches 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import CONF_DIR  # noqa: E402
from pipeflow.planning.baselines import BASELINES  # noqa: E402
from pipeflow.planning.planner import GB, plan  # noqa: E402
from pipeflow.planning.transformer import TransformerSpec  # noqa: E402
from pipeflow.topology.presets import get_topology  # noqa: E402

MODELS = ("gpt_1.5b", "bert_1b")
TOPOLOGIES = {
    "heterogeneous": {},
    "pcie_8": {},
    "two_node_ib": {},
    "cluster(4x8)": {"nodes": 4},
}


def model_spec(name: str) -> TransformerSpec:
    return TransformerSpec.from_config(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))


def topology(name: str):
    return get_topology(name.split("(")[0], **TOPOLOGIES[name])


def plan_row(model: str, tname: str, m: int) -> dict:
    """One (model, topology, m): the planner's and each baseline's simulated iteration time
    in seconds (None for a baseline that does not fit its devices' memory)."""
    spec, topo = model_spec(model), topology(tname)
    t0 = time.perf_counter()
    best = plan(spec, topo, m)
    took = time.perf_counter() - t0
    one = plan(spec, topo, m, replicas=1)
    row = {"model": model, "topology": tname, "devices": topo.num_devices, "microbatches": m,
           "planner": best.predicted_iteration_time, "stages": best.num_stages,
           "replicas": best.replicas, "planner_1pipe": one.predicted_iteration_time,
           "stages_1pipe": one.num_stages,
           "plan_seconds": took, "layers": best.layers_per_stage, "devices_used": best.device_of_stage}
    for name, fn in BASELINES.items():
        b = fn(spec, topo, m)
        # a baseline that does not fit its devices' memory cannot run: no time
        row[name] = b.predicted_iteration_time if b.peak_memory_bytes <= min(
            topo.devices[d].memory_bytes for d in b.device_of_stage) else None
    return row


def results(microbatches=(16, 64)) -> dict:
    """Every (model, topology, m) row, the best and median speedup of the planner over each
    baseline (``summary``: baseline -> best, median, best_1pipe, median_1pipe), and the
    time to plan a 96-layer model over 64 devices (``plan_96x64``)."""
    rows = []
    for model in MODELS:
        for tname in TOPOLOGIES:
            for m in microbatches:
                rows.append(plan_row(model, tname, m))
                print(f"{model} {tname} m={m}: planned in {rows[-1]['plan_seconds']:.2f} s", file=sys.stderr)
    summary = {}
    for n in BASELINES:
        sp = [r[n] / r["planner"] for r in rows if r[n] is not None]
        sp1 = [r[n] / r["planner_1pipe"] for r in rows if r[n] is not None]
        summary[n] = {"best": max(sp), "median": statistics.median(sp),
                      "best_1pipe": max(sp1), "median_1pipe": statistics.median(sp1)}

    spec96 = TransformerSpec("gpt_96l", 96, 32, 2048, 50257, 1024)
    topo64 = get_topology("cluster", nodes=8)
    t0 = time.perf_counter()
    big = plan(spec96, topo64, 64)
    big_row = {"seconds": time.perf_counter() - t0, "stages": big.num_stages, "replicas": big.replicas,
               "iteration": big.predicted_iteration_time, "peak_gb": big.peak_memory_bytes / GB}
    return {"rows": rows, "summary": summary, "plan_96x64": big_row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    res = results(args.microbatches)
    rows, summary = res["rows"], res["summary"]
    names = list(BASELINES)
    head = ("| model | topology | m | planner (ms) | stages x replicas | planner, 1 pipeline (ms) | stages | "
            + " | ".join(f"{n} (ms)" for n in names) + " | "
            + " | ".join(f"speedup vs {n} (1 pipeline)" for n in names) + " |")
    print(head)
    print("|" + "---|" * (7 + 2 * len(names)))
    for r in rows:
        cells = [r["model"], r["topology"], str(r["microbatches"]), f"{r['planner'] * 1e3:.1f}",
                 f"{r['stages']} x {r['replicas']}", f"{r['planner_1pipe'] * 1e3:.1f}", str(r["stages_1pipe"])]
        cells += ["OOM" if r[n] is None else f"{r[n] * 1e3:.1f}" for n in names]
        cells += ["-" if r[n] is None else f"{r[n] / r['planner']:.2f}x ({r[n] / r['planner_1pipe']:.2f}x)"
                  for n in names]
        print("| " + " | ".join(cells) + " |")
    print()
    print("| baseline | best speedup | median speedup | best, 1 pipeline | median, 1 pipeline |")
    print("|---|---|---|---|---|")
    for n, x in summary.items():
        print(f"| {n} | {x['best']:.2f}x | {x['median']:.2f}x | {x['best_1pipe']:.2f}x | {x['median_1pipe']:.2f}x |")

    big = res["plan_96x64"]
    print(f"\nplanning a 96-layer model (hidden 2048) over 64 devices (cluster, 8x8), m=64: {big['seconds']:.2f} s "
          f"-> {big['stages']} stages x {big['replicas']} replicas, {big['iteration'] * 1e3:.1f} ms, "
          f"peak {big['peak_gb']:.1f} GB")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary, "plan_96x64_seconds": big["seconds"]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
