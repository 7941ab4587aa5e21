"""BAPP against the flattened baselines, simulated on an A100 node and measured on CPU ranks.

Simulated (``dgx_a100_8`` cut to p GPUs, analytic FLOP cost at 50 % of peak, microbatch
4, m = 2p): BAPP with the coordinator's policy, BAPP uncoordinated (first come first
served, vision first), Chimera and 1F1B over the same concurrent-branch model flattened
onto a chain (its stage graph grouped onto the devices). Configurations: a balanced
model (24 + 24 layers, co-attention at depths 7, 13, 19, conf/model/cbm_large.yaml) and
unbalanced ones (a 32-layer vision tower with a 24-layer text tower) with two
placements of the interaction depths. The coordinator's search time is reported.

Measured: the tiny CBM (conf/model/cbm_tiny.yaml) on 2 CPU ranks, bapp / chimera / 1f1b
alternating run by run in one invocation; mean step time of each run's second half.

    .venv/bin/python -m benchmarks.bench_bapp [--steps 30] [--repeats 2]

It reports, it does not fail.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose, prepare_training  # noqa: E402
from pipeflow.models.cbm import cbm_shape, cbm_stage_counts, cbm_stage_graph  # noqa: E402
from pipeflow.planning.branched_cost import BranchedAnalyticCost  # noqa: E402
from pipeflow.runtime.launch import TrainJob, launch  # noqa: E402
from pipeflow.planning.coordinator import coordinate  # noqa: E402
from pipeflow.schedules.registry import build_schedule  # noqa: E402
from pipeflow.sim import simulate  # noqa: E402
from pipeflow.topology.presets import get_topology  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"
MICROBATCH = 4


def configs() -> list[tuple[str, dict]]:
    large = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "cbm_large.yaml"))
    out = [("balanced 24+24, interactions 7/13/19", large)]
    for depths in ([7, 13, 19], [9, 17]):
        m = copy.deepcopy(large)
        m["vision"]["n_layer"], m["text"]["n_layer"] = 32, 24
        m["interaction_layers"] = depths
        out.append((f"unbalanced 32+24, interactions {'/'.join(map(str, depths))}", m))
    return out


def flattened(name: str, model: dict, p: int, m: int, topo) -> float:
    graph, specs = cbm_stage_graph(model, *cbm_stage_counts(cbm_shape(model), p))
    cost = BranchedAnalyticCost(model, [(s.branch, s.lo, s.hi) for s in specs], MICROBATCH)
    return simulate(build_schedule(name, p, m, graph=graph), cost, topo, record=False).makespan


def simulated() -> list[dict]:
    """One dict per (model, p = 4 and 8): simulated makespans (s) of the coordinated BAPP,
    the uncoordinated one and the flattened Chimera and 1F1B, m = 2p, with the
    coordinator's policy and its search time."""
    rows = []
    for label, model in configs():
        for p in (4, 8):
            m = 2 * p
            topo = get_topology("dgx_a100_8", p)
            graph, specs = cbm_stage_graph(model, p, p)
            cost = BranchedAnalyticCost(model, [(s.branch, s.lo, s.hi) for s in specs], MICROBATCH)
            c = coordinate(p, m, graph, cost, topo)
            rows.append({"model": label, "p": p, "m": m, "bapp": c.makespan,
                         "uncoordinated": c.uncoordinated_makespan, "chimera": flattened("chimera", model, p, m, topo),
                         "1f1b": flattened("1f1b", model, p, m, topo), "policy": c.policy.describe(),
                         "search_s": c.seconds})
    return rows


def measured(schedule: str, steps: int, run_dir: Path) -> float:
    cfg = compose("train", ["model=cbm_tiny", f"schedule={schedule}", "pipeline.stages=2", "pipeline.microbatches=8",
                            "pipeline.microbatch_size=4", f"trainer.steps={steps}", "trainer.val_every=0",
                            "trainer.val_batches=1", "trainer.timeline_step=null", "logger=none"])
    inputs = prepare_training(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(TrainJob(inputs.plan, str(run_dir)))
    return json.loads((run_dir / "summary.json").read_text())["mean_step_time"]


def measured_times(steps: int = 30, repeats: int = 2) -> dict[str, list[float]]:
    """schedule -> mean step time (s) of each of ``repeats`` CPU runs, schedules alternating run by run."""
    times: dict[str, list[float]] = {"bapp": [], "chimera": [], "1f1b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name in times:
                times[name].append(measured(name, steps, Path(tmp) / f"{name}-{r}"))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-measure", action="store_true")
    args = ap.parse_args()
    print("Simulated step time, dgx_a100_8, analytic cost, microbatch 4 (published BAPP vs Chimera: +20% on average)")
    print("| model | p | m | bapp (ms) | uncoordinated (ms) | chimera (ms) | 1f1b (ms) | bapp / chimera | "
          "bapp / 1f1b | coordinator policy | search (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in simulated():
        print(f"| {r['model']} | {r['p']} | {r['m']} | {r['bapp'] * 1e3:.1f} | {r['uncoordinated'] * 1e3:.1f} | "
              f"{r['chimera'] * 1e3:.1f} | {r['1f1b'] * 1e3:.1f} | **{r['chimera'] / r['bapp']:.2f}x** | "
              f"{r['1f1b'] / r['bapp']:.2f}x | {r['policy']} | {r['search_s']:.2f} |")
    if args.no_measure:
        return
    times = measured_times(args.steps, args.repeats)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    print("\nMeasured on 2 CPU ranks, cbm_tiny, 8 microbatches of 4 (mean step time of each run's second half)")
    print("| schedule | step times (s) | mean (s) | throughput vs bapp |")
    print("|---|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {', '.join(f'{x:.4f}' for x in v)} | {mean[k]:.4f} | {mean[k] / mean['bapp']:.2f}x |")
    print(f"\nbapp / chimera throughput ratio: {mean['chimera'] / mean['bapp']:.3f}; "
          f"bapp / 1f1b: {mean['1f1b'] / mean['bapp']:.3f}")


if __name__ == "__main__":
    main()
