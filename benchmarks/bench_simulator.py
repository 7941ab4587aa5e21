"""How fast is the simulator? The planner calls it in its inner loop.

Target (the simulator issue's acceptance): 1F1B with 64 stages and 1024 microbatches
(131k compute actions) on the analytic cost of a 128-layer, hidden-4096 GPT over a
64-GPU cluster (8 nodes x 8, NVSwitch inside, InfiniBand between) simulates in at most
one second, compiling the schedule included, generating and validating it excluded.

Run from the repository root:

    .venv/bin/python -m benchmarks.bench_simulator
    .venv/bin/python benchmarks/bench_simulator.py --repeats 5

Prints a table of median wall times; it reports, it does not fail.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeflow.planning.cost import AnalyticCost  # noqa: E402
from pipeflow.planning.transformer import TransformerSpec  # noqa: E402
from pipeflow.schedules.registry import build_schedule  # noqa: E402
from pipeflow.schedules.validate import validate  # noqa: E402
from pipeflow.sim.engine import compile_schedule, simulate  # noqa: E402
from pipeflow.topology import get_topology  # noqa: E402

TARGET_S = 1.0
# large enough that every one of 64 stages holds two layers
MODEL = TransformerSpec("gpt-128L-4096H", n_layer=128, n_head=32, n_embd=4096, vocab_size=50304, seq_len=2048)
CASES = [("1f1b", 64, 1024, 8), ("1f1b", 8, 32, 1)]  # schedule, stages, microbatches, nodes


def median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench(name: str, p: int, m: int, nodes: int, repeats: int) -> dict:
    topo = get_topology("cluster", nodes=nodes, gpus_per_node=p // nodes)
    cost = AnalyticCost(MODEL, p)
    t_gen, sched = median_time(lambda: build_schedule(name, p, m, check=False), repeats)
    t_val, _ = median_time(lambda: validate(sched), repeats)
    t_sim, result = median_time(lambda: simulate(sched, cost, topo, record=False), repeats)
    t_rec, _ = median_time(lambda: simulate(sched, cost, topo, record=True), repeats)
    t_cmp, compiled = median_time(lambda: compile_schedule(sched), repeats)
    t_warm, _ = median_time(lambda: simulate(compiled, cost, topo, record=False), repeats)
    return {
        "case": f"{name} p={p} m={m}",
        "actions": sum(len(o) for o in sched.orders),
        "generate": t_gen,
        "validate": t_val,
        "simulate": t_sim,
        "simulate+record": t_rec,
        "compile only": t_cmp,
        "precompiled": t_warm,
        "makespan": result.makespan,
        "bubble": result.bubble_ratio,
    }


def results(repeats: int = 3) -> list[dict]:
    """:func:`bench` of every case; the first is the target's."""
    return [bench(*case, repeats=repeats) for case in CASES]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    args = ap.parse_args(argv)

    print(f"model {MODEL.name}; cost AnalyticCost; topology cluster (nodes x 8 A100, NVSwitch + 25 GB/s IB)")
    print(f"median of {args.repeats} runs, wall seconds\n")
    cols = ["case", "actions", "generate", "validate", "simulate", "simulate+record", "compile only", "precompiled"]
    rows = results(args.repeats)
    widths = [max(len(c), 9) for c in cols]
    widths[0] = max(len(r["case"]) for r in rows)
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        cells = [r["case"].ljust(widths[0]), str(r["actions"]).rjust(widths[1])]
        cells += [f"{r[c]:.3f}".rjust(w) for c, w in zip(cols[2:], widths[2:])]
        print("  ".join(cells))
    print()
    for r in rows:
        print(f"{r['case']}: simulated iteration {r['makespan']:.3f} s, bubble {r['bubble']:.1%}")
    big = rows[0]
    verdict = "met" if big["simulate"] <= TARGET_S else "NOT met"
    print(
        f"\ntarget: {big['case']} simulate (compile included, record=False) <= {TARGET_S:.1f} s: "
        f"{big['simulate']:.3f} s -> {verdict}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
