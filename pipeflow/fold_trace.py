"""``python -m pipeflow.fold_trace RUN_DIR --profile FILE [--out FILE] [-- OVERRIDES]``:
a run's own operators beside a device profile's prices, and the profile corrected by them.

The run traced its last steps (``pipeflow-train ... runtime.trace_steps=N``: each
rank's seconds per step in each operator class, ``op_trace.json``,
:mod:`pipeflow.runtime.op_trace`). This prices the same schedule's actions with the
profile (``cost=analytic topology.device_profile=FILE``, the run's own overrides, read
from its ``.hydra/overrides.yaml`` or given after ``--``) and prints, for each device and
class, the measured seconds, the priced ones and their ratio.

``--out FILE`` writes the profile again with a ``corrections`` section: each class's
median ratio over the devices, by which the profile then multiplies every operator of that
class it prices (a profile corrected before is corrected again: the factors multiply).
On a profile with a host (a CPU's reference pipeline), the run's own seconds per message
posted (gloo's send and receive calls, counted and timed by the trace) replace the
reference's ``message_host``: a schedule that posts more messages at once than the
reference 1F1B (interleaved, Chimera) blocks longer on each. The host's other time is not
corrected: the trace sees the dispatcher's share of it, not the Python around the
operators. A class the run does not hold (a loss on no device) keeps
its price. Runs whose ranks are not the schedule's devices one for one (data or tensor
parallel) are refused: their ranks share a device's prices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .planning.operators import CLASSES

CORRECTED = tuple(c for c in CLASSES if c != "host")


class FoldError(ValueError):
    pass


def run_overrides(run_dir: Path, given: list[str]) -> list[str]:
    if given:
        return given
    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        raise FoldError(f"{run_dir}: no .hydra/overrides.yaml; give the run's overrides after --")
    return [line[2:].strip().strip("'\"") for line in f.read_text().splitlines() if line.startswith("- ")]


def measured(run_dir: Path) -> list[dict]:
    f = run_dir / "op_trace.json"
    if not f.is_file():
        raise FoldError(f"{run_dir}: no op_trace.json; run pipeflow-train with runtime.trace_steps=N (N >= 1)")
    ranks = json.loads(f.read_text())["ranks"]
    if not all(ranks):  # (every rank of a traced run writes its part)
        raise FoldError(f"{f}: a rank wrote no trace")
    return ranks


def priced(overrides: list[str], profile: Path, device: str) -> list[dict]:
    """Each device's seconds per step by class, as ``profile`` prices the schedule the run
    ran (the training config's own, as bench_fidelity takes it)."""
    from .config import compose, prepare_training
    from .config.prepare import prepare_simulation
    from .simulate import operator_breakdown

    ran = prepare_training(compose("train", overrides)).schedule
    keep = [o for o in overrides if not o.startswith(("trainer.", "runtime.", "logger=", "data=", "hydra."))]
    if not any(o.startswith("topology=") for o in keep):
        keep += ["topology=local_cpu"] if device == "cpu" else \
            ["topology=cluster", "topology.nodes=1", f"topology.gpus_per_node={ran.num_devices}"]
    cfg = compose("simulate", [*keep, "cost=analytic", f"topology.device_profile={profile}"])
    inputs = prepare_simulation(cfg)
    rows = operator_breakdown(ran, inputs.cost, inputs.topology)
    if rows is None:
        raise FoldError(f"--profile {profile}: the simulator priced no operators with it")
    windows = max(1, getattr(ran, "windows", 1) or 1)
    return [{c: v / windows for c, v in r.items()} if r else {} for r in rows]


def fold(meas: list[dict], price: list[dict]) -> dict[str, float]:
    """Each class's median ratio of measured to priced seconds over the devices that hold it."""
    if len(meas) != len(price):
        raise FoldError(f"the run had {len(meas)} ranks and its schedule {len(price)} devices: only runs whose "
                        f"ranks are the devices one for one fold (no data or tensor parallelism)")
    out = {}
    for c in CORRECTED:
        ratios = [m["per_step"].get(c, 0.0) / p[c] for m, p in zip(meas, price)
                  if p.get(c, 0.0) > 0 and m["per_step"].get(c, 0.0) > 0]
        if ratios:
            out[c] = statistics.median(ratios)
    return out


def message_host(meas: list[dict]) -> float | None:
    """The host's seconds per message posted, the median over the ranks that posted any
    (the trace's own count of gloo's send and receive calls and their time)."""
    per = [m["post_s"] for m in meas if m.get("post_s")]
    return statistics.median(per) if per else None


def table(meas: list[dict], price: list[dict]) -> str:
    lines = [f"{'device':>6}  {'class':>10}  {'measured':>10}  {'priced':>10}  {'ratio':>6}"]
    for d, (m, p) in enumerate(zip(meas, price)):
        for c in (*CLASSES, "comm"):
            got, want = m["per_step"].get(c, 0.0), p.get(c, 0.0)
            if got <= 0 and want <= 0:
                continue
            ratio = f"{got / want:6.3f}" if want > 0 and c != "host" else "     -"
            lines.append(f"{d:>6}  {c:>10}  {got * 1e3:8.2f}ms  {want * 1e3:8.2f}ms  {ratio}")
    return "\n".join(lines)


def corrected(profile: Path, factors: dict[str, float], run_dir: Path, steps: int,
              posting: float | None = None) -> dict:
    """The profile's JSON with ``factors`` folded into its corrections, and, where it
    calibrated a reference pipeline (a CPU's host), the run's own seconds per message
    posted in place of the reference's (``message_host``)."""
    doc = json.loads(profile.read_text())
    old = doc.get("corrections") or {}
    before = old.get("classes", {})
    classes = {c: before.get(c, 1.0) * f for c, f in factors.items()}
    classes.update({c: v for c, v in before.items() if c not in classes})
    doc["corrections"] = {"classes": classes, "from": str(run_dir), "steps": steps}
    has_host = bool(((doc.get("sections") or {}).get("pipeline") or {}).get("rows"))
    posting = posting if posting is not None else old.get("message_host")
    if has_host and posting is not None:
        doc["corrections"]["message_host"] = posting
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    given = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m pipeflow.fold_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run folder of pipeflow-train ... runtime.trace_steps=N")
    ap.add_argument("--profile", type=Path, required=True, help="the device profile to check (measure_device --out)")
    ap.add_argument("--out", type=Path, default=None, help="write the profile corrected by the run's ratios here")
    args = ap.parse_args(argv)
    from .config.values import ConfigError
    from .planning.device_profile import ProfileError

    try:
        meas = measured(args.run_dir)
        price = priced(run_overrides(args.run_dir, given), args.profile, meas[0].get("device", "cpu"))
        factors = fold(meas, price)
    except (FoldError, ConfigError, ProfileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    steps = min(m.get("steps", 0) for m in meas)
    print(f"{args.run_dir}: {steps} traced steps, each rank's seconds per step beside {args.profile}'s prices")
    print(table(meas, price))
    print("measured / priced, median over the devices: "
          + ", ".join(f"{c} {f:.3f}" for c, f in factors.items()))
    posting = message_host(meas)
    if posting is not None:
        from .planning.device_profile import load_profile

        had = load_profile(args.profile).host.get("message_host")
        counts = ", ".join(f"{m.get('posts_per_step', 0):.0f}" for m in meas)
        print(f"posting a message: {posting * 1e3:.3f} ms on the run's host (median over the ranks; "
              f"{counts} posts a step); "
              + (f"the profile's reference pipeline: {had * 1e3:.3f} ms" if had is not None else
                 "the profile holds no host (it calibrated no reference pipeline)"))
    if args.out is not None:
        doc = corrected(args.profile, factors, args.run_dir, steps, posting)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}: {args.profile} with these corrections (topology.device_profile={args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
