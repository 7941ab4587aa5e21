"""Does the simulator predict what the runtime measures, for every schedule it executes?

For each world size (2 and 4 CPU ranks by default) and each schedule the runtime runs
(synchronous: gpipe, 1f1b, zb_h1, chimera, interleaved_1f1b, zb_h2, interleaved_zb, zb_v,
dualpipe_v, looped_bfs; asynchronous: pipedream,
pipedream_2bw, amdp; segmented: seq1f1b; planned; branched: bapp and chimera on the
concurrent-branch model; sharded: 1F1B under ZeRO-2 and interleaved 1F1B under ZeRO-3,
each 2 replicas of a pipeline half the ranks deep, so twice the global batch; tensor
parallel: 1f1b_tp2, 1F1B over 2 stages of 2 tensor ranks each, sequence parallel, on 4
ranks only), with the same model and global batch (gpt_tiny, or cbm_tiny for the
branched pair; 8 microbatches of 4; on 4 ranks gpt_tiny with 8 layers, two per stage as
on 2 (four per stage of 1f1b_tp2), and cbm_tiny with 4-layer branches, which BAPP cuts
into 4 stages each):

- **measured**: ``pipeflow-train`` for real, schedules alternating and repeated; the
  median step time of the steady steps (the second half; an asynchronous step is its
  chunk's time over its steps);
- **simulated**: ``pipeflow-simulate`` of the same configuration with
  ``cost=calibrated``: the costs :mod:`pipeflow.runtime.calibration_run` measures on this
  machine right before each run, one calibration per configuration and run (it
  replays the schedule's own actions, so each schedule has its own); the median of
  the runs' predictions.

Reported per schedule: both step times, both as ratios to 1F1B's, and the error
(simulated - measured) / measured; then, for every pair of schedules whose measured
step times differ by more than 5%, whether the simulator orders them the same way.
Targets: within 10% on 2 ranks, 15% on 4; every such pair ordered alike.

    .venv/bin/python -m benchmarks.bench_fidelity                      # 2 and 4 ranks, 2 repeats
    .venv/bin/python -m benchmarks.bench_fidelity --ranks 2 --repeats 1 --json out.json
    .venv/bin/python -m benchmarks.bench_fidelity --ranks 2 --schedules 1f1b,zb_h1 --override compile=true

``--override`` adds a config override to every case (its calibration, its prediction
and its run): with ``compile=true`` each case's blocks are compiled in the calibration
as in the run (a zero-bubble case's with its weight products eager), so the simulator
prices the compiled step from what the calibration measured of it.

It reports, it does not fail. Run it on a quiet machine: the ranks share its cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from pipeflow.config import compose, prepare_simulation, prepare_training  # noqa: E402
from pipeflow.calibrate import calibrate  # noqa: E402
from pipeflow.runtime.launch import TrainJob, launch  # noqa: E402
from pipeflow.formats.timeline import Timeline, timeline_file  # noqa: E402
from pipeflow.sim import simulate  # noqa: E402

TARGETS = {2: 0.10}  # world size -> allowed |error|; larger worlds: TARGET_MANY
TARGET_MANY = 0.15
ORDER_GAP = 0.05  # pairs whose measured times differ by more than this must be ordered alike
MICROBATCHES, MICROBATCH_SIZE = 8, 4

# the --quick subset of benchmarks/reproduce.py: the pairs the acceptance names
QUICK = ("1f1b", "zb_h1", "bapp", "chimera_cbm")

# name -> the overrides of its configuration; each is calibrated on its own: the
# calibration replays the schedule's own actions (see pipeflow.runtime.calibration_run)
CASES: dict[str, list[str]] = {
    "1f1b": ["schedule=1f1b"],
    "gpipe": ["schedule=gpipe"],
    "zb_h1": ["schedule=zb_h1"],
    "chimera": ["schedule=chimera"],
    "interleaved_1f1b": ["schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
    # issue 17's: zero bubble's H2 and interleaved forms, the V (ZB-V, DualPipeV), breadth first
    "zb_h2": ["schedule=zb_h2"],
    "interleaved_zb": ["schedule=interleaved_zb", "pipeline.virtual_stages=2"],
    "zb_v": ["schedule=zb_v", "pipeline.virtual_stages=2"],
    "dualpipe_v": ["schedule=dualpipe_v", "pipeline.virtual_stages=2"],
    "looped_bfs": ["schedule=looped_bfs", "pipeline.virtual_stages=2"],
    "pipedream": ["schedule=pipedream"],
    "pipedream_2bw": ["schedule=pipedream_2bw"],
    "amdp": ["schedule=amdp"],
    "seq1f1b": ["schedule=seq1f1b", "pipeline.segments=2"],
    "planned": ["schedule=planned"],
    "bapp": ["model=cbm_tiny", "data=image_text", "schedule=bapp"],
    "chimera_cbm": ["model=cbm_tiny", "data=image_text", "schedule=chimera"],
    # issue 34's: 2 replicas of a pipeline half as deep, their stages sharded (ZeRO-2, and
    # ZeRO-3 interleaved, gathering a chunk whenever the rank turns to it)
    "1f1b_zero2": ["schedule=1f1b", "pipeline.data_parallel=2", "pipeline.shard=gradients"],
    "interleaved_zero3": ["schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "pipeline.data_parallel=2",
                          "pipeline.shard=full", "pipeline.gather=chunk"],
    # tensor parallelism: a pipeline half the ranks deep, each device 2 ranks splitting its
    # stages (sequence parallel); the model and global batch of the other cases at 4 ranks
    "1f1b_tp2": ["schedule=1f1b", "pipeline.tensor_parallel=2", "pipeline.sequence_parallel=true"],
}
MIN_RANKS = {"1f1b_tp2": 4}  # cases that need more ranks than 2 (skipped below that)
SHARDING = ("pipeline.shard=", "pipeline.gather=")  # what the calibration leaves out (see results)


BRANCHED = {"bapp", "chimera_cbm"}  # the concurrent-branch model: compared with each other only


def ranks_per_device(name: str) -> int:
    """How many of the ranks each pipeline stage position takes: 2 for the cases of 2
    replicas or of 2 tensor ranks (a pipeline half the ranks deep), else 1."""
    case = CASES[name]
    return 2 if "pipeline.data_parallel=2" in case or "pipeline.tensor_parallel=2" in case else 1


def base(p: int, steps: int, replicas: int = 1) -> list[str]:
    return ["model=gpt_tiny", f"pipeline.stages={p // replicas}", f"pipeline.microbatches={MICROBATCHES}",
            f"pipeline.microbatch_size={MICROBATCH_SIZE}", f"trainer.steps={steps}", "trainer.val_every=0",
            "trainer.val_batches=1", "trainer.timeline_step=null", "runtime.threads_per_rank=1", "logger=none"]


def sized(name: str, p: int) -> list[str]:
    """The model at ``p`` ranks: gpt_tiny with two layers per stage (its own 4 on 2 ranks,
    8 on 4: interleaving two chunks per rank over 4 ranks needs 8), cbm_tiny with a
    text branch BAPP can cut into ``p`` stages."""
    if name in BRANCHED:
        return [f"model.text.n_layer={p}", f"model.vision.n_layer={p}"] if p > 3 else []
    return [f"model.n_layer={2 * p}"] if p != 2 else []


def measure(overrides: list[str], run_dir: Path, steps: int) -> tuple[float, dict]:
    """The median steady step time of one real run, and the durations of its last
    step's actions: (stage, kind) -> list of seconds (its recorded timeline)."""
    cfg = compose("train", [*overrides, f"trainer.timeline_step={steps}"])
    inputs = prepare_training(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(TrainJob(inputs.plan, str(run_dir)))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[len(rows) // 2:]
    actions: dict = {}
    try:
        path = timeline_file(run_dir)  # timeline.json, or timeline.json.gz when saved gzipped
    except FileNotFoundError:
        path = None
    if path is not None:
        for e in Timeline.load(path).events:
            if e.stream == "compute" and e.kind in ("F", "B", "I", "W"):
                actions.setdefault(f"{e.stage}{e.kind}", []).append(e.end - e.start)
    return statistics.median(r["step_time"] for r in steady), actions


def split_check(rows: dict, calibrations: dict | None = None) -> dict | None:
    """ZB-H1 against 1F1B from the same benchmark run: the step-time ratio, and per
    stage mean(I) + mean(W) over 1F1B's mean(B) (acceptance: ratio <= 1, sums <= 1.1),
    from the runs' recorded last steps; also the same sum from the calibrations' replays
    (``replay``: the median over repeats, each repeat's zb_h1 and 1f1b calibrations taken
    a minute apart, not a run apart)."""
    if "zb_h1" not in rows or "1f1b" not in rows:
        return None
    zb, ref = rows["zb_h1"]["actions"], rows["1f1b"]["actions"]
    mean = statistics.fmean
    stages = sorted({int(k[:-1]) for k in ref if k.endswith("B")})
    per_stage = {}
    for s in stages:
        b = mean(ref[f"{s}B"])
        iw = mean(zb.get(f"{s}I", [0.0])) + mean(zb.get(f"{s}W", [0.0]))
        per_stage[s] = {"B": b, "I": mean(zb.get(f"{s}I", [0.0])), "W": mean(zb.get(f"{s}W", [0.0])),
                        "I+W / B": iw / b}
        if calibrations and calibrations.get("zb_h1") and calibrations.get("1f1b"):
            sums = [(z["times"].get(f"I|{s}|0", 0.0) + z["times"].get(f"W|{s}|0", 0.0)) / f["times"][f"B|{s}|0"]
                    for z, f in zip(calibrations["zb_h1"], calibrations["1f1b"])]
            per_stage[s]["replay"] = statistics.median(sums)
    return {"step_ratio": rows["zb_h1"]["measured"] / rows["1f1b"]["measured"], "stages": per_stage}


def predict(overrides: list[str], calibration: Path) -> float:
    """The simulated step time of the schedule the runtime runs for ``overrides``, with
    calibrated costs. The schedule is taken from the training configuration, not
    composed again for the simulator: BAPP's coordinator and the planner choose by
    simulation, and under the calibrated costs they may choose otherwise than the
    training run did (BAPP: another head placement and warm-up), which would compare
    two different schedules."""
    ran = prepare_training(compose("train", overrides)).schedule
    sim_over = [o for o in overrides if not o.startswith(("trainer.", "runtime.", "logger=", "data="))]
    cfg = compose("simulate", [*sim_over, "cost=calibrated", f"cost.calibration={calibration}",
                               "topology=local_cpu"])
    inputs = prepare_simulation(cfg)
    res = simulate(ran, inputs.cost, inputs.topology, record=False)
    return res.makespan / max(1, getattr(res, "windows", 1) or 1)


def predict_profiled(overrides: list[str], profile: Path, calibration: Path) -> float:
    """The same schedule's step with ``cost=analytic`` on CPU ranks priced by a device
    profile (``topology.device_profile``: each action its operators as measured by
    ``python -m pipeflow.measure_device --device cpu``). The host beside the actions (the
    ranks' shared cores and contention, gloo's time per message, the links) is the
    profile's own where it calibrated its reference pipeline (section ``pipeline``), else
    the case's calibration's: nothing of this case's calibration prices it then."""
    from pipeflow.planning.from_sweep import load_profile
    from pipeflow.planning.machine_cost import CalibratedCost

    ran = prepare_training(compose("train", overrides)).schedule
    # a profile with its own reference pipeline (section pipeline) brings the host itself
    host = {} if load_profile(profile).host else CalibratedCost(ran.num_stages, str(calibration)).host
    sim_over = [o for o in overrides if not o.startswith(("trainer.", "runtime.", "logger=", "data="))]
    cfg = compose("simulate", [*sim_over, "cost=analytic", "topology=local_cpu", f"topology.device_profile={profile}",
                               *(f"topology.{k}={v}" for k, v in host.items() if v is not None)])
    inputs = prepare_simulation(cfg)
    res = simulate(ran, inputs.cost, inputs.topology, record=False)
    return res.makespan / max(1, getattr(res, "windows", 1) or 1)


def results(ranks=(2, 4), repeats: int = 2, steps: int = 16, names: list[str] | None = None,
            profile: Path | None = None, extra: list[str] | None = None) -> dict:
    """Per world size and repeat, each case calibrated and then run at once, cases
    alternating: a prediction and the measurement it is held to are taken seconds apart,
    so a host whose speed drifts over minutes moves both alike (calibrating every case
    first and measuring later put that drift, up to 20% on a shared host, into the error)."""
    names = list(names or CASES)
    out: dict = {"ranks": {}, "repeats": repeats, "steps": steps}
    with tempfile.TemporaryDirectory(prefix="pipeflow-fidelity-") as tmp:
        for p in ranks:
            t0 = time.perf_counter()
            here = [n for n in names if p >= MIN_RANKS.get(n, 2)]  # the 2-rank run skips 1f1b_tp2
            measured: dict[str, list[float]] = {n: [] for n in here}
            simulated: dict[str, list[float]] = {n: [] for n in here}
            actions: dict[str, dict] = {n: {} for n in here}
            calibrations: dict[str, list[dict]] = {n: [] for n in here}
            profiled: dict[str, list[float]] = {n: [] for n in here}
            for r in range(repeats):
                # alternate the order between repeats so drifting load hits every schedule alike
                for name in (here if r % 2 == 0 else here[::-1]):
                    overrides = [*base(p, steps, ranks_per_device(name)), *CASES[name], *sized(name, p),
                                 *(extra or [])]
                    path = Path(tmp) / f"p{p}-{name}-{r}.json"
                    # a sharded case is calibrated unsharded: the same compute, its whole
                    # optimizer step, whose share and collectives the simulator prices
                    # (the replay runs no GATHER, and a sharded step's all-gather is a wait)
                    plain = [o for o in overrides if not o.startswith(SHARDING)]
                    calibrations[name].append(calibrate(compose("train", plain), path))
                    simulated[name].append(predict(overrides, path))
                    if profile is not None and name not in BRANCHED:
                        profiled[name].append(predict_profiled(overrides, profile, path))
                    t, acts = measure(overrides, Path(tmp) / f"p{p}-{name}-{r}", steps)
                    measured[name].append(t)
                    for k, v in acts.items():
                        actions[name].setdefault(k, []).extend(v)
            rows = {}
            for name in here:
                meas, sim = statistics.median(measured[name]), statistics.median(simulated[name])
                rows[name] = {"measured": meas, "runs": measured[name], "simulated": sim,
                              "simulated_runs": simulated[name], "error": (sim - meas) / meas,
                              "run_errors": [(s - m) / m for s, m in zip(simulated[name], measured[name])],
                              "actions": actions[name]}
                if profiled[name]:
                    pro = statistics.median(profiled[name])
                    rows[name].update(profiled=pro, profiled_error=(pro - meas) / meas)
            out["ranks"][p] = {"rows": rows, "seconds": time.perf_counter() - t0, "calibrations": calibrations}
    for p, block in out["ranks"].items():
        rows = block["rows"]
        ref = rows.get("1f1b")
        for row in rows.values():
            row["measured_vs_1f1b"] = row["measured"] / ref["measured"] if ref else None
            row["simulated_vs_1f1b"] = row["simulated"] / ref["simulated"] if ref else None
        block["target"] = TARGETS.get(p, TARGET_MANY)
        block["within"] = all(abs(r["error"]) <= block["target"] for r in rows.values())
        block["misordered"] = misordered(rows)
        block["split"] = split_check(rows, block.get("calibrations"))
        block["spread"] = spread(rows)
        if "bapp" in rows and "chimera_cbm" in rows:
            meas = rows["bapp"]["measured"] / rows["chimera_cbm"]["measured"]
            sim = rows["bapp"]["simulated"] / rows["chimera_cbm"]["simulated"]
            block["branched_pair"] = {"measured": meas, "simulated": sim, "apart": (sim - meas) / meas}
    return out


def spread(rows: dict) -> dict | None:
    """How far one schedule's repeated runs lie apart: per schedule (slowest run over
    fastest) - 1, and their median. The table's noise floor: an error or a gap between two
    schedules smaller than this is not told apart from the host's run-to-run variation.
    None with fewer than two runs per schedule."""
    per = {n: max(r["runs"]) / min(r["runs"]) - 1 for n, r in rows.items() if len(r.get("runs", ())) > 1}
    return {"schedules": per, "median": statistics.median(per.values())} if per else None


def misordered(rows: dict) -> list[tuple[str, str]]:
    """Pairs (a, b) measured more than ORDER_GAP apart that the simulator orders the other way
    (comparable only within one model: the branched pair with itself)."""
    bad = []
    names = list(rows)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if (a in BRANCHED) != (b in BRANCHED):
                continue  # different models
            ma, mb = rows[a]["measured"], rows[b]["measured"]
            if abs(ma - mb) / min(ma, mb) <= ORDER_GAP:
                continue
            if (ma < mb) != (rows[a]["simulated"] < rows[b]["simulated"]):
                bad.append((a, b))
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per schedule, alternating (default 2)")
    ap.add_argument("--steps", type=int, default=16, help="steps per run; the second half is timed (default 16)")
    ap.add_argument("--schedules", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument("--profile", type=Path, default=None,
                    help="a CPU device profile (python -m pipeflow.measure_device --device cpu --threads 1 --out F): "
                         "also price each run by its operators (cost=analytic) beside the calibration")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every case's calibration, prediction and run (repeatable), "
                         "e.g. --override compile=true")
    args = ap.parse_args(argv)
    if args.profile is not None and any(o.replace(" ", "") == "compile=true" for o in args.override):
        ap.error("--profile prices eager operators; compile=true is priced by each case's calibration alone")
    names = [n for n in args.schedules.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"--schedules: unknown {', '.join(unknown)}; allowed: {', '.join(CASES)}")
    res = results(tuple(int(x) for x in args.ranks.split(",")), args.repeats, args.steps, names, args.profile,
                  args.override)
    for p, block in res["ranks"].items():
        extra = f" with {' '.join(args.override)}" if args.override else ""
        print(f"\n{p} CPU ranks (gloo, 1 thread each){extra}, gpt_tiny (cbm_tiny for bapp, chimera_cbm; "
              f"{' '.join(sized('1f1b', p) + sized('bapp', p)) or 'as configured'}), m={MICROBATCHES}, "
              f"mbs={MICROBATCH_SIZE}; {args.repeats} run(s) x {args.steps} steps, median of the second halves; "
              f"{block['seconds']:.0f} s")
        head = f"{'schedule':<17} {'measured':>10} {'simulated':>10} {'meas/1f1b':>10} {'sim/1f1b':>9} {'error':>7}"
        print(head)
        print("-" * len(head))
        for name, r in block["rows"].items():
            mv = f"{r['measured_vs_1f1b']:.3f}" if r["measured_vs_1f1b"] else "-"
            sv = f"{r['simulated_vs_1f1b']:.3f}" if r["simulated_vs_1f1b"] else "-"
            flag = "" if abs(r["error"]) <= block["target"] else "  <- beyond target"
            pro = (f"   profiled {r['profiled'] * 1e3:.1f}ms {r['profiled_error']:+.1%}" if "profiled" in r else "")
            print(f"{name:<17} {r['measured'] * 1e3:>8.1f}ms {r['simulated'] * 1e3:>8.1f}ms {mv:>10} {sv:>9} "
                  f"{r['error']:>+7.1%}{flag}{pro}")
        order = ", ".join(f"{a}/{b}" for a, b in block["misordered"]) or "none"
        print(f"target: every error within {block['target']:.0%}: {'yes' if block['within'] else 'no'}; "
              f"pairs measured >{ORDER_GAP:.0%} apart but ordered the other way by the simulator: {order}")
        noise = block["spread"]
        if noise:
            widest = max(noise["schedules"], key=noise["schedules"].get)
            print(f"run-to-run spread of a schedule's measured steps (slowest / fastest run - 1): median "
                  f"{noise['median']:.1%}, widest {widest} {noise['schedules'][widest]:.1%}")
        pair = block.get("branched_pair")
        if pair:
            print(f"bapp / chimera_cbm step: measured {pair['measured']:.3f}, simulated {pair['simulated']:.3f}, "
                  f"apart {pair['apart']:+.1%} (target within 10%)")
        split = block["split"]
        if split:
            def one(s: int, v: dict) -> str:
                replay = f" (calibration replays: {v['replay']:.3f})" if "replay" in v else ""
                return (f"stage {s}: I {v['I'] * 1e3:.1f} + W {v['W'] * 1e3:.1f} ms over B {v['B'] * 1e3:.1f} ms "
                        f"= {v['I+W / B']:.3f}{replay}")
            stages = "; ".join(one(s, v) for s, v in split["stages"].items())
            print(f"zb_h1 / 1f1b measured step: {split['step_ratio']:.3f} (target <= 1); "
                  f"last step's means: {stages} (target <= 1.1)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
