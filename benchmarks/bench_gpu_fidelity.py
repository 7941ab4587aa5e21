"""One-GPU training steps, measured beside simulated: is the simulator's device profile
(pipeflow.planning.device_profile) right about a GPU?

For each configuration (GPT 350M and 1.5B, a 1B Llama at 2k tokens, recomputation none
and full, microbatches of 1-8 sequences), ``pipeflow-simulate`` on one GPU priced by the
profile (``topology.device=h200``, or ``--profile FILE``: a sweep of your GPU, made with
``python -m pipeflow.measure_device --out FILE``) beside the measured step:

- with ``--measure`` (a CUDA machine): ``pipeflow-train`` runs each configuration on the
  GPU here (median of steps 3-8);
- otherwise the steps recorded in ``benchmarks/measurements/*/steps.json`` (the H200 of
  2026-12-04; the GPT-2 medium step of 2026-11-28 from shared/measurements).

Beside them, the old model (the H100's peak at cost.efficiency 0.5: what pipeflow
priced before profiles), and then the profile's own fit error per operator class
(leave-one-out for the interpolated products and attention).

    .venv/bin/python -m benchmarks.bench_gpu_fidelity                  # recorded H200 steps
    .venv/bin/python -m benchmarks.bench_gpu_fidelity --measure        # on a CUDA machine
    .venv/bin/python -m benchmarks.bench_gpu_fidelity --profile mine.json --measure
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RECORDED = sorted((ROOT / "benchmarks" / "measurements").glob("*/steps.json"))
# shared/measurements/h200-2026-11-28/README.md: pipeflow's one-stage gpt_medium step, bf16, 4 x 8 x 1,024
REFERENCE_2026_11_28 = {"gpt_medium_mbs8": 0.319}
LLAMA_1B = ["model=llama_tiny", "model.hf.hidden_size=2048", "model.hf.intermediate_size=5632",
            "model.hf.num_hidden_layers=16", "model.hf.num_attention_heads=32", "model.hf.num_key_value_heads=8",
            "model.hf.max_position_embeddings=2048", "model.seq_len=2048"]
CONFIGS = [  # name (as the recorded steps.json names it), model overrides, microbatch size, microbatches
    ("gpt_medium_mbs8", ["model=gpt_medium"], 8, 4),
    ("gpt_medium_mbs8_recompute_full", ["model=gpt_medium", "model.recompute=full"], 8, 4),
    ("gpt_medium_mbs1", ["model=gpt_medium"], 1, 8),
    ("gpt_1.5b_mbs4", ["model=gpt_1.5b"], 4, 2),
    ("gpt_1.5b_mbs2_recompute_full", ["model=gpt_1.5b", "model.recompute=full"], 2, 4),
    ("llama_1b_2k_mbs2", LLAMA_1B, 2, 4),
]


def overrides(model: list[str], mbs: int, m: int) -> list[str]:
    return [*model, "precision=bf16", "pipeline.stages=1", f"pipeline.microbatch_size={mbs}",
            f"pipeline.microbatches={m}"]


def simulated(shared: list[str], device: str, profile: str | None) -> dict:
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    over = [*shared, "topology=cluster", "topology.nodes=1", "topology.gpus_per_node=1", f"topology.device={device}",
            *([f"topology.device_profile={profile}"] if profile else []), "draw=false"]
    with tempfile.TemporaryDirectory(prefix="pf_gpu_fid_") as d:
        s = run_simulation(compose("simulate", over), d)
    return {"makespan": s["makespan"], "operator_seconds": (s.get("operator_seconds") or [None])[0]}


def recorded_steps() -> dict[str, tuple[float, str]]:
    """Each configuration's measured step from the recorded sessions (the newest wins)."""
    out = {name: (t, "h200-2026-11-28") for name, t in REFERENCE_2026_11_28.items()}
    for path in RECORDED:
        runs = json.loads(path.read_text()).get("runs", {})
        for name, r in runs.items():
            if r.get("median_step_time_after_2"):
                out[name] = (r["median_step_time_after_2"], path.parent.name)
    return out


def measure(shared: list[str]) -> float | None:
    from benchmarks.gpu_session import measure_steps

    with tempfile.TemporaryDirectory(prefix="pf_gpu_fid_run_") as d:
        r = measure_steps(shared, Path(d) / "run", timeout_s=300, smoke=False)
    return r.get("median_step_time_after_2")


def rows(measure_here: bool, profile: str | None, names: list[str] | None = None) -> list[dict]:
    recorded = {} if measure_here else recorded_steps()
    out = []
    for name, model, mbs, m in CONFIGS:
        if names and name not in names:
            continue
        shared = overrides(model, mbs, m)
        got = (measure(shared), "measured here") if measure_here else recorded.get(name, (None, "not recorded"))
        sim = simulated(shared, "h200", profile)
        old = simulated(shared, "h100-80g", None)
        out.append({"config": name, "overrides": shared, "measured_s": got[0], "source": got[1],
                    "simulated_s": sim["makespan"], "old_simulated_s": old["makespan"],
                    "ratio": sim["makespan"] / got[0] if got[0] else None,
                    "old_ratio": old["makespan"] / got[0] if got[0] else None,
                    "operator_seconds": sim["operator_seconds"]})
    return out


def table(results: list[dict]) -> str:
    head = f"{'config':<32} {'measured s':>10} {'simulated s':>11} {'sim/meas':>8} {'old sim s':>9} {'old/meas':>8}  source"
    lines = [head]
    for r in results:
        meas = f"{r['measured_s']:.3f}" if r["measured_s"] else "-"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        old = f"{r['old_ratio']:.3f}" if r["old_ratio"] else "-"
        lines.append(f"{r['config']:<32} {meas:>10} {r['simulated_s']:>11.3f} {ratio:>8} {r['old_simulated_s']:>9.3f} "
                     f"{old:>8}  {r['source']}")
    return "\n".join(lines)


def fit_table(profile_path: str) -> str:
    from pipeflow.planning.from_sweep import load_profile

    prof = load_profile(profile_path)
    lines = [f"the profile's fit error per operator class ({profile_path}; relative RMS on its own rows, "
             f"leave-one-out for products and attention)"]
    lines += [f"  {k:<40} {v:6.1%}" for k, v in prof.fit_errors().items()]
    lines.append(f"  host: {prof.launch_s * 1e6:.1f} us a launch, {prof.backward_call_s * 1e6:.0f} us a backward pass, "
                 f"device {prof.kernel_s * 1e6 if prof.kernel_s else 0:.2f} us a kernel")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="run each step on this machine's GPU")
    ap.add_argument("--profile", default=None, help="a device profile (default: the h200 preset's)")
    ap.add_argument("--configs", default=None, help="comma-separated config names (default: all)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    from pipeflow.topology.presets import DEVICES

    profile = args.profile or DEVICES["h200"].profile
    results = rows(args.measure, args.profile, args.configs.split(",") if args.configs else None)
    print(table(results))
    print()
    print(fit_table(profile))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
