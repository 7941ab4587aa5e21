"""The simulated side of bench_memory and bench_fidelity, recorded to compare two commits:
a refactor keeps every byte and every time.

    python -m benchmarks.simulated_figures --out now.json          # at each commit (a worktree)
    python -m benchmarks.simulated_figures --compare then.json now.json

Records, with no run measured: ``pipeflow-simulate``'s summary (step time, bubble, bytes
sent, each device's memory: its peak, what holds it, the action then, each category's
own most) for every case of bench_memory's matrix and real-width set, each action's own
most on every device (what bench_memory reads where a rank measured its peak), and
bench_fidelity's cases at 2 and 4 ranks on ``local_cpu`` (their calibrated costs are
measured; the analytic ones price the same schedules through the same engine).
``--compare`` prints the records that differ and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeflow.config import compose, prepare_simulation  # noqa: E402
try:
    from pipeflow.sim.device_walk import tapes  # noqa: E402
except ImportError:  # a commit before issue 61 split the walk out of sim/memory.py
    from pipeflow.sim.memory import tapes  # noqa: E402
from pipeflow.sim.engine import simulate  # noqa: E402
from pipeflow.simulate import run_simulation  # noqa: E402

from benchmarks import bench_fidelity, bench_memory  # noqa: E402

KEPT = ("makespan", "bubble_ratio", "peak_activation_bytes", "p2p_bytes", "collective_bytes", "per_device", "fits",
        "placement")


def _pipeline(train_overrides: list[str]) -> list[str]:
    """The trained job's pipeline, every key (pipeflow-simulate's own defaults are a cluster's)."""
    return [f"pipeline.{k}={v}" for k, v in compose("train", [*train_overrides, "logger=none"]).pipeline.items()]


def record(overrides: list[str], folder: Path, actions: bool = False) -> dict | str:
    """What pipeflow-simulate says of ``overrides`` (``actions``: each action's own most
    on every device too), or the error it raised."""
    try:
        cfg = compose("simulate", [*overrides, "draw=false"])
        summary = run_simulation(cfg, folder)
        out = {k: summary[k] for k in KEPT}
        if actions:
            inputs = prepare_simulation(cfg)
            per = simulate(inputs.schedule, inputs.cost, inputs.topology, record=False).per_device
            cache: dict = {}
            out["action_peaks"] = [t.walk(t.values(inputs.cost, per, cache), every=True)["action_peaks"]
                                   for t in tapes(inputs.schedule)]
        return out
    except Exception as err:  # noqa: BLE001 - an error is a figure too: it must stay the same
        return f"{type(err).__name__}: {err}"


def cases() -> dict[str, tuple[list[str], bool]]:
    """label -> (simulate overrides, whether each action's most is recorded)."""
    out = {}
    for label, over in bench_memory.cases() + bench_memory.real_cases():
        train = [*bench_memory.SHAPE, *over]
        out[f"memory {label}"] = ([*train, *_pipeline(train), "topology=local_cpu"], True)
    for p in (2, 4):
        for name, over in bench_fidelity.CASES.items():
            if p < bench_fidelity.MIN_RANKS.get(name, 0):
                continue
            train = [*bench_fidelity.base(p, 16, bench_fidelity.ranks_per_device(name)), *over,
                     *bench_fidelity.sized(name, p)]
            model = [o for o in train if o.startswith("model")]
            schedule = [o for o in over if o.startswith(("schedule", "pipeline"))]
            out[f"fidelity p{p} {name}"] = ([*model, *schedule, *_pipeline(train), "topology=local_cpu"], False)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the records here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("THEN", "NOW"), help="two records files to compare")
    args = ap.parse_args(argv)
    if args.compare:
        then, now = (json.loads(Path(p).read_text()) for p in args.compare)
        differ = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
        print(f"{len(then)} and {len(now)} records; {len(differ)} differ" + "".join(f"\n  {k}" for k in differ))
        raise SystemExit(1 if differ else 0)
    if not args.out:
        ap.error("give --out FILE, or --compare THEN NOW")
    with tempfile.TemporaryDirectory(prefix="pipeflow-figures-") as tmp:
        out = {label: record(over, Path(tmp) / "run", actions) for label, (over, actions) in cases().items()}
    Path(args.out).write_text(json.dumps(out, sort_keys=True, default=str) + "\n")
    errors = sum(isinstance(v, str) for v in out.values())
    print(f"{len(out)} records ({errors} errors) written to {args.out}")


if __name__ == "__main__":
    main()
