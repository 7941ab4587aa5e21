"""Does the profiled partition beat the uniform one on a model with a heavy LM head?

gpt_tiny widened to an 8192-word vocabulary and 8 blocks (the data is bytes, so token
ids stay below 256; only the head's size changes): the head with its loss costs several
blocks, so the uniform split leaves the last stage the slowest. The model is profiled
once here (:func:`pipeflow.models.profiler.profile_model`, one thread, as each rank
has), then for 2 and 4 stages (1F1B, m = 8 microbatches of 4 sequences):

- simulated: the step time the simulator predicts with ``cost=profiled`` on
  ``local_cpu`` for the uniform and the profiled split;
- measured: real runs (``trainer.steps``, logger=none), summary.json's mean_step_time,
  for ``partition=uniform`` and ``partition=profiled`` with the same profile file.

Prints both ratios profiled / uniform (below 1: the profiled split is faster). On a
host with fewer cores than ranks the 4-stage measured figures mix in time-sharing.

    .venv/bin/python -m benchmarks.bench_partition
    .venv/bin/python -m benchmarks.bench_partition --steps 8 --stages 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose, prepare_simulation, prepare_training  # noqa: E402
from pipeflow.models.profiler import profile_model  # noqa: E402
from pipeflow.planning.partitioners import partition_layers  # noqa: E402
from pipeflow.runtime.launch import TrainJob, launch  # noqa: E402
from pipeflow.sim import simulate  # noqa: E402

MODEL = ["model=gpt_tiny", "model.vocab_size=8192", "model.n_layer=8"]
PIPE = ["schedule=1f1b", "pipeline.microbatches=8", "pipeline.microbatch_size=4"]


def simulated(profile: Path, stages: int, layers: list[int]) -> float:
    cfg = compose("simulate", MODEL + PIPE + [
        f"pipeline.stages={stages}", "cost=profiled", f"cost.profile={profile}",
        f"cost.layers_per_stage=[{','.join(map(str, layers))}]", "topology=local_cpu", "draw=false",
    ])
    inputs = prepare_simulation(cfg)
    return simulate(inputs.schedule, inputs.cost, inputs.topology, record=False).makespan


def measured(profile: Path, stages: int, partition: str, steps: int, run_dir: Path) -> float:
    extra = [f"partition.profile={profile}"] if partition == "profiled" else []
    cfg = compose("train", MODEL + PIPE + [
        f"pipeline.stages={stages}", f"partition={partition}", *extra, f"trainer.steps={steps}",
        "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null",
        "runtime.threads_per_rank=1", "logger=none",
    ])
    inputs = prepare_training(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(TrainJob(inputs.plan, str(run_dir)))
    return json.loads((run_dir / "summary.json").read_text())["mean_step_time"]


def results(stages=(2, 4), steps: int = 8) -> dict:
    """Profile the model once, then for each stage count the uniform and the profiled
    split, simulated and measured.

    Returns ``profile`` (the head's and the mean block's F+B time, s) and ``rows``: per
    stage count the ``splits`` (layers per stage), ``sim_uniform`` / ``sim_profiled``
    (predicted step time, s), ``run_uniform`` / ``run_profiled`` (measured mean step
    time, s) and the ratios profiled / uniform ``sim_ratio`` and ``run_ratio``.
    """
    from pipeflow.planning import TransformerSpec

    model_cfg = OmegaConf.to_container(compose("train", MODEL).model, resolve=True)
    spec = TransformerSpec.from_config(compose("train", MODEL).model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prof = profile_model(model_cfg, microbatch_size=4, threads=1)
        path = prof.save(tmp / "profile.json")
        head, block = prof.head.time_s, sum(b.time_s for b in prof.blocks) / len(prof.blocks)
        for n in stages:
            splits = {
                "uniform": partition_layers("uniform", spec, n),
                "profiled": partition_layers("profiled", spec, n, {"profile": str(path)}),
            }
            row = {"stages": n, "splits": splits}
            for name, layers in splits.items():
                row[f"sim_{name}"] = simulated(path, n, layers)
                row[f"run_{name}"] = measured(path, n, name, steps, tmp / f"{name}_{n}")
            row["sim_ratio"] = row["sim_profiled"] / row["sim_uniform"]
            row["run_ratio"] = row["run_profiled"] / row["run_uniform"]
            rows.append(row)
    return {"profile": {"head_s": head, "block_s": block}, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    res = results(args.stages, args.steps)
    head, block = res["profile"]["head_s"], res["profile"]["block_s"]
    print(f"profile: head F+B {head * 1e3:.1f} ms = {head / block:.2f} mean blocks ({block * 1e3:.1f} ms)")
    print(f"\n{'stages':>6}  {'uniform':>14}  {'profiled':>14}  {'sim uni':>8}  {'sim prof':>8}  {'ratio':>6}"
          f"  {'run uni':>8}  {'run prof':>8}  {'ratio':>6}")
    for r in res["rows"]:
        print(f"{r['stages']:>6}  {str(r['splits']['uniform']):>14}  {str(r['splits']['profiled']):>14}  "
              f"{r['sim_uniform'] * 1e3:7.1f}ms {r['sim_profiled'] * 1e3:7.1f}ms  {r['sim_ratio']:6.3f}  "
              f"{r['run_uniform'] * 1e3:7.1f}ms {r['run_profiled'] * 1e3:7.1f}ms  {r['run_ratio']:6.3f}")
    if args.json:
        args.json.write_text(json.dumps(res["rows"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
