"""How long does the pipeflow-simulate command line take at scale, files written?

Target (issue 16, item 8): 1F1B with 64 stages and 1024 microbatches of a 128-layer
gpt_7b on an 8 x 8 GPU cluster, run as a user runs it,

    pipeflow-simulate schedule=1f1b pipeline.stages=64 pipeline.microbatches=1024 \
        topology=cluster topology.nodes=8 model=gpt_7b model.n_layer=128

completes, its outputs written (summary.json, the timeline, the picture when it can be
read), in at most 1.5 s more than the same command at pipeline.stages=2
pipeline.microbatches=2. The small command pays what every run pays (starting Python,
importing, composing the config, drawing its picture); the difference is what the scale
costs: generating, checking and simulating 131k actions and writing 260k timeline
events.

Each command runs as a subprocess of the venv's console script, small and large
alternating, so that a shared host's drifting load falls on both alike; each run writes
into its own fresh folder (``hydra.run.dir``). Reported: every run's wall time, the
median of each command, the difference of the medians (the verdict), the median of
the differences of adjacent runs, the difference of the median CPU seconds (user +
system, which another job on the host inflates less than wall time), and the host's
load average before and after.

Run from the repository root:

    .venv/bin/python -m benchmarks.bench_simulate_cli
    .venv/bin/python benchmarks/bench_simulate_cli.py --repeats 5 --json outputs/bench_simulate_cli.json

Prints a table; it reports, it does not fail.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 1.5  # the large command may take this much longer than the small one
COMMON = ["schedule=1f1b", "topology=cluster", "topology.nodes=8", "model=gpt_7b", "model.n_layer=128"]
SMALL = ["pipeline.stages=2", "pipeline.microbatches=2"]
LARGE = ["pipeline.stages=64", "pipeline.microbatches=1024"]


def console_script() -> list[str]:
    """pipeflow-simulate beside this interpreter (the venv's), else the module entry."""
    script = Path(sys.executable).with_name("pipeflow-simulate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipeflow.simulate"]


def command(size: list[str], run_dir: Path, common: list[str] = COMMON) -> list[str]:
    """The command line of one run: the shared overrides, the size, its own folder."""
    return [*console_script(), *common, *size, f"hydra.run.dir={run_dir}"]


def outputs(run_dir: Path) -> list[str]:
    """The files a finished run left in ``run_dir``: summary.json, the timeline (plain or
    gzipped), timeline.png when drawn. FileNotFoundError when summary.json or the
    timeline is missing: a run that did not write them does not count."""
    names = sorted(p.name for p in run_dir.iterdir() if p.is_file())
    if "summary.json" not in names or not {"timeline.json", "timeline.json.gz"} & set(names):
        raise FileNotFoundError(f"{run_dir}: no summary.json or timeline (found {', '.join(names) or 'nothing'})")
    return [n for n in names if n.startswith(("summary", "timeline"))]


def time_run(cmd: list[str], run_dir: Path) -> tuple[float, float, str]:
    """Wall seconds of one run, its CPU seconds (user + system: what other work on the
    host slows less), and its last line of output (what it says about the picture)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    outputs(run_dir)
    lines = proc.stdout.strip().splitlines()
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, lines[-1] if lines else ""


def summarize(small: list[float], large: list[float], limit: float = TARGET_S) -> dict:
    """Medians, their difference, the median difference of adjacent (paired) runs, and
    whether the difference of medians is within ``limit``."""
    small_median, large_median = statistics.median(small), statistics.median(large)
    difference = large_median - small_median
    return {
        "small_median": small_median,
        "large_median": large_median,
        "difference": difference,
        "paired_difference": statistics.median(b - a for a, b in zip(small, large)),
        "limit": limit,
        "within": difference <= limit,
    }


def results(repeats: int = 3, small: list[str] = SMALL, large: list[str] = LARGE, common: list[str] = COMMON,
            out: Path | None = None) -> dict:
    """Run the two commands ``repeats`` times each, alternating (small first)."""
    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {"small": [], "large": []}
    cpu: dict[str, list[float]] = {"small": [], "large": []}
    files: dict[str, list[str]] = {}
    said: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_simulate_cli_") as tmp:
        root = Path(out) if out is not None else Path(tmp)
        for i in range(repeats):
            for name, size in (("small", small), ("large", large)):
                run_dir = root / f"{name}_{i}"
                wall, seconds, last = time_run(command(size, run_dir, common), run_dir)
                runs[name].append(wall)
                cpu[name].append(seconds)
                files[name], said[name] = outputs(run_dir), last
    return {
        "command": {name: " ".join(["pipeflow-simulate", *common, *size]) for name, size in
                    (("small", small), ("large", large))},
        "runs": runs,
        "cpu": cpu,
        "cpu_difference": statistics.median(cpu["large"]) - statistics.median(cpu["small"]),
        "files": files,
        "last_line": said,
        # the host's 1-minute load average around the runs: other work on a shared host slows both
        "load_average": [load_before, os.getloadavg()[0]],
        **summarize(runs["small"], runs["large"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each command; medians are reported")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--keep", type=Path, help="write the runs' folders here (default: a temporary folder)")
    args = ap.parse_args(argv)

    res = results(args.repeats, out=args.keep)
    print(f"pipeflow-simulate {' '.join(COMMON)} ...")
    print(f"{args.repeats} runs of each size, alternating; wall seconds; host load average "
          f"{res['load_average'][0]:.2f} before, {res['load_average'][1]:.2f} after\n")
    for name, size in (("small", SMALL), ("large", LARGE)):
        times = ", ".join(f"{t:.2f}" for t in res["runs"][name])
        print(f"{name}  {' '.join(size):47s} median {res[f'{name}_median']:.2f}  ({times})")
        print(f"{'':6s} wrote {', '.join(res['files'][name])}")
    print(f"\nlarge - small: {res['difference']:.2f} s (difference of medians; "
          f"median of adjacent pairs {res['paired_difference']:.2f} s; CPU seconds {res['cpu_difference']:.2f})")
    if res["last_line"]["large"].startswith("timeline.png not drawn"):
        print(f"large: {res['last_line']['large']}")
    verdict = "met" if res["within"] else "NOT met"
    print(f"target: large - small <= {res['limit']:.1f} s: {res['difference']:.2f} s -> {verdict}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
