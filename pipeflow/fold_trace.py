"""``python -m pipeflow.fold_trace RUN_DIR --profile FILE [--out FILE] [-- OVERRIDES]``:
a run's own operators beside a device profile's prices, and the profile corrected by them.

Prices the job of a run traced with ``runtime.trace_steps=N`` (``op_trace.json``) under
the profile, with the run's own config and layers per stage, and prints each device's
classes: measured seconds, priced ones, their ratio. ``--out`` writes the profile with
each class's median ratio as a correction (and, for a CPU's host, the run's seconds per
message as ``message_host``). Refusals, one sentence each: docs/simulation.md, "Checking
a profile against a run's own trace"."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml
from omegaconf import DictConfig, open_dict

from .faults import Fault, WriteFailed
from .formats.files import check_file, write_aside
from .planning.operators import CLASSES

CORRECTED = tuple(c for c in CLASSES if c != "host")


class FoldError(Fault, ValueError):
    """A run or a trace this cannot fold: one sentence naming the file or key."""


def run_config(run_dir: Path, given: list[str]) -> DictConfig:
    """The run's own training config, every key as it ran: ``given`` (its overrides, after
    ``--``) composed as pipeflow-train does; else its ``.hydra/config.yaml``; else its
    ``config.json``."""
    from omegaconf import OmegaConf

    from .config import compose

    if given:
        return compose("train", given)
    for name in (".hydra/config.yaml", "config.json"):
        f = run_dir / name
        if f.is_file():
            try:
                cfg = OmegaConf.load(f) if f.suffix == ".yaml" else OmegaConf.create(json.loads(f.read_text()))
            except (OSError, ValueError, yaml.YAMLError) as err:
                raise FoldError(f"{f}: not the run's config ({type(err).__name__}); give the run's overrides "
                                f"after --") from None
            if not isinstance(cfg, DictConfig) or "pipeline" not in cfg or "model" not in cfg:
                raise FoldError(f"{f}: not the run's config (no pipeline or model); give the run's overrides after --")
            return cfg
    raise FoldError(f"{run_dir}: no .hydra/config.yaml or config.json (not a pipeflow-train run folder?); give the "
                    f"run's overrides after --")


def check_foldable(cfg: DictConfig) -> None:
    """FoldError for a run the profile's prices cannot be set beside: a compiled run, or ranks
    that are not the schedule's devices one for one (data or tensor parallel)."""
    if cfg.get("compile"):
        raise FoldError("compile=true: a compiled run's fused kernels are not the eager operators a device profile "
                        "prices, so its trace cannot be folded; trace an eager run (compile=false)")
    for key in ("data_parallel", "tensor_parallel"):
        n = cfg.pipeline.get(key, 1)
        if n != 1:
            raise FoldError(f"pipeline.{key}={n}: the run's ranks are not the schedule's devices one for one (each "
                            f"device's prices would be shared by {n} ranks); fold a run with pipeline.{key}=1")


def measured(run_dir: Path) -> list[dict]:
    """Each rank's traced seconds per step (``op_trace.json``), or FoldError naming the file."""
    f = run_dir / "op_trace.json"
    if not f.is_file():
        raise FoldError(f"{run_dir}: no op_trace.json; run pipeflow-train with runtime.trace_steps=N (N >= 1)")
    try:
        ranks = json.loads(f.read_text())["ranks"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FoldError(f"{f}: not a whole trace ({type(err).__name__}: {err}); trace the run again with "
                        f"pipeflow-train ... runtime.trace_steps=N") from None
    if not isinstance(ranks, list) or not ranks:
        raise FoldError(f"{f}: no rank's trace in it; trace the run again with pipeflow-train ... runtime.trace_steps=N")
    if not all(isinstance(r, dict) and isinstance(r.get("per_step"), dict) for r in ranks):
        # (every rank of a traced run writes its part)
        raise FoldError(f"{f}: a rank wrote no trace; trace the run again with pipeflow-train ... runtime.trace_steps=N")
    return ranks


def run_layers(run_dir: Path | None, planned: list[int], stages: int) -> list[int]:
    """The blocks each stage held in the run: its summary's (a profiled cut measured as the
    run started), else the run plan's."""
    summary = run_dir / "summary.json" if run_dir is not None else None
    if summary is not None and summary.is_file():
        try:
            layers = json.loads(summary.read_text()).get("layers_per_stage")
        except (OSError, ValueError, AttributeError):
            layers = None
        if isinstance(layers, list) and len(layers) == stages:
            return [int(n) for n in layers]
    if len(planned) != stages:
        raise FoldError(f"partition.name=profiled: the cut the run measured is in its summary.json, which "
                        f"{'is not in ' + str(run_dir) if run_dir else 'a run given by its overrides lacks'}; give "
                        f"the cut as partition.profile=FILE")
    return list(planned)


def _gpu_preset(profile: Path) -> str:
    """The topology.device preset of the GPU ``profile`` was measured on (a100-80g where
    no preset is its model: the simulation then says so)."""
    from .topology.presets import DEVICES, measured_on

    gpu = (measured_on(profile) or ("", ""))[1].lower().replace(" ", "")
    return next((name for name in DEVICES if name != "cpu" and name.split("-")[0] in gpu), "a100-80g")


def simulation_config(run: DictConfig, resolved: DictConfig, layers: list[int], profile: Path,
                      device: str, devices: int) -> DictConfig:
    """The simulator's config of the run's own job: the keys training and simulation share as
    the run had them (their defaults differ), its layers per stage, the profile on its
    devices (GPUs under local_cpu: one node of the profile's GPU)."""
    from omegaconf import OmegaConf, open_dict

    from .config import CONF_DIR, PLANNED, compose

    groups = [f"schedule={run.schedule.name}", "cost=analytic"]
    if (CONF_DIR / "model" / f"{run.model.name}.yaml").is_file():
        groups.append(f"model={run.model.name}")
    gpus = device != "cpu" and run.topology.name == "local_cpu"
    groups += ["topology=cluster", "topology.nodes=1", f"topology.gpus_per_node={devices}",
               f"topology.device={_gpu_preset(profile)}"] if gpus else [f"topology={run.topology.name}"]
    shared = {k: run[k] for k in ("pipeline", "model", "schedule", "topology") if not (gpus and k == "topology")}
    try:
        cfg = OmegaConf.merge(compose("simulate", groups), shared)
    except Exception as err:  # noqa: BLE001 - omegaconf's errors for a key the simulator lacks
        raise FoldError(f"the run's config holds what the simulator does not take ({type(err).__name__}: "
                        f"{str(err).splitlines()[0]}); give the run's overrides after --") from None
    with open_dict(cfg):
        cfg.precision = resolved.precision  # (as the run resolved auto: on its own topology)
        cfg.topology.device_profile = str(profile)
        if cfg.schedule.name != PLANNED:  # (a plan's cut is its own; prepare_simulation takes it)
            cfg.cost.layers_per_stage = list(layers)
    return cfg


def priced(run: DictConfig | list[str], profile: Path, device: str, run_dir: Path | None = None
           ) -> tuple[list[dict], str | None]:
    """Each device's seconds per step by class as ``profile`` prices the run's schedule
    (``run``: its config, or the overrides that compose it), and the line saying a GPU
    profile prices another GPU's preset (or None)."""
    from .config import compose, prepare_training
    from .config.prepare import prepare_simulation
    from .simulate import operator_breakdown
    from .topology.presets import profile_note

    run = compose("train", run) if isinstance(run, list) else run.copy()
    check_foldable(run)
    with open_dict(run):
        run.resume = None  # (the schedule is the run's whatever it resumed from)
    inputs = prepare_training(run)
    ran = inputs.schedule
    layers = run_layers(run_dir, list(inputs.plan.layers_per_stage or []), ran.num_stages)
    cfg = simulation_config(run, inputs.config, layers, profile, device, ran.num_devices)
    sim = prepare_simulation(cfg)
    rows = operator_breakdown(ran, sim.cost, sim.topology)
    if rows is None:
        raise FoldError(f"model={run.model.name}: the simulator prices its actions whole, not operator by operator "
                        f"from a device profile (chain transformers only), so its trace has no prices to fold against")
    windows = max(1, getattr(ran, "windows", 1) or 1)
    return [{c: v / windows for c, v in r.items()} if r else {} for r in rows], profile_note(sim.topology.devices)


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
    """The profile's JSON with ``factors`` folded into its corrections and, where it has a
    reference pipeline's host, the run's seconds per message as ``message_host``."""
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
    """Fold the run's trace against the profile; the exit status (2: a run, trace, profile
    or --out refused before any work; 1: --out could not be written)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m pipeflow.fold_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run folder of pipeflow-train ... runtime.trace_steps=N")
    ap.add_argument("--profile", type=Path, required=True, help="the device profile to check (measure_device --out)")
    ap.add_argument("--out", type=Path, default=None, help="write the profile corrected by the run's ratios here")
    args = ap.parse_args(argv)
    try:
        why = check_file(args.out) if args.out is not None else None
        if why is not None:
            raise FoldError(f"--out={args.out}: {why}; give a file's path in a folder you can write")
        meas = measured(args.run_dir)
        price, note = priced(run_config(args.run_dir, given), args.profile, meas[0].get("device", "cpu"), args.run_dir)
        factors = fold(meas, price)
    except Fault as err:  # (the config's, the profile's and the trace's refusals)
        print(err, file=sys.stderr)
        return 2
    steps = min(m.get("steps", 0) for m in meas)
    print(f"{args.run_dir}: {steps} traced steps, each rank's seconds per step beside {args.profile}'s prices")
    if note:
        print(note)
    print(table(meas, price))
    print("measured / priced, median over the devices: "
          + ", ".join(f"{c} {f:.3f}" for c, f in factors.items()))
    posting = message_host(meas)
    if posting is not None:
        from .planning.from_sweep import load_profile

        had = load_profile(args.profile).host.get("message_host")
        counts = ", ".join(f"{m.get('posts_per_step', 0):.0f}" for m in meas)
        print(f"posting a message: {posting * 1e3:.3f} ms on the run's host (median over the ranks; "
              f"{counts} posts a step); "
              + (f"the profile's reference pipeline: {had * 1e3:.3f} ms" if had is not None else
                 "the profile holds no host (it calibrated no reference pipeline)"))
    if args.out is not None:
        doc = corrected(args.profile, factors, args.run_dir, steps, posting)
        try:
            write_aside(args.out, json.dumps(doc, indent=1) + "\n")
        except WriteFailed as err:
            print(err, file=sys.stderr)
            return 1
        print(f"wrote {args.out}: {args.profile} with these corrections (topology.device_profile={args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
