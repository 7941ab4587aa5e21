"""Measure this machine's operators into a device profile (the sweep: :mod:`pipeflow.topology.op_sweep`).

    python -m pipeflow.measure_device --out device_profile.json [--device auto|cpu|cuda] [--budget-s 180]
                                      [--threads N] [--smoke]

On a CPU two more sections: ``blocks`` (each family's block host time,
:mod:`pipeflow.runtime.block_host`) and ``pipeline`` (``--ranks N``, 0 skips it: a
calibration of gpt_tiny under 1F1B, :mod:`pipeflow.runtime.calibration_run`). Exits 1
where the file cannot price a step; docs/simulation.md, "Measuring a device"."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pipeflow.faults import Fault
from pipeflow.formats.files import check_file
from pipeflow.topology.op_sweep import CPU_SECTIONS, SECTIONS, sections_for, sweep

DEVICES = ("auto", "cpu", "cuda")
BLOCK_MODELS = ("gpt_tiny", "bert_tiny", "llama_tiny")  # one shipped model of each transformer family


def block_rows(rows: list, deadline: float, smoke: bool = False) -> bool:
    """Section ``blocks``: per family, one block's F, B, I and W at a tiny size
    (:func:`pipeflow.runtime.block_host.measure_block`), with the kernels its operators launch."""
    import time

    from omegaconf import OmegaConf

    from pipeflow.config import compose
    from pipeflow.hf import resolve
    from pipeflow.planning.operators import Shape, kernels
    from pipeflow.planning.stage_operators import StageOperators
    from pipeflow.planning.transformer import TransformerSpec
    from pipeflow.runtime.block_host import TOKENS, measure_block

    for name in BLOCK_MODELS:
        if time.monotonic() > deadline:
            return False
        model = OmegaConf.to_container(compose("train", [f"model={name}"]).model, resolve=True)
        if model["family"] == "hf_causal":
            model.update(resolve(model))
        spec = TransformerSpec.from_config(model)
        ops = StageOperators(Shape(spec, 1, TOKENS, TOKENS, 4), 1, False, False)
        row = measure_block(model["family"], model, spec.n_layer, repeats=5 if smoke else 30)
        row["kernels"] = {k: sum(kernels(o) * o.count for o in ops.action(k)) for k in "FBIW"}
        rows.append(row)
    return True


def reference(ranks: int, threads: int | None, smoke: bool) -> list[str]:
    """The reference pipeline section ``pipeline`` calibrates: gpt_tiny under 1F1B on ``ranks``
    local ranks (smoke: one block a stage, 32 tokens)."""
    over = ["model=gpt_tiny", "schedule=1f1b", f"pipeline.stages={ranks}", f"pipeline.microbatches={2 * ranks}",
            "pipeline.microbatch_size=2", f"model.n_layer={(1 if smoke else 2) * ranks}",
            f"runtime.threads_per_rank={threads or 1}", "logger=none"]
    return over + (["model.seq_len=32"] if smoke else [])


def pipeline_rows(rows: list, deadline: float, path: Path, ranks: int, threads: int | None, smoke: bool) -> bool:
    """Section ``pipeline``: calibrate the reference pipeline; its host keys, and per action kind
    its time beyond the profile's price, per block
    (:func:`pipeflow.planning.device_profile.in_step_rows`)."""
    import tempfile

    from pipeflow.calibrate import calibrate
    from pipeflow.config import compose, prepare_simulation
    from pipeflow.planning.device_profile import in_step_rows, sync_collectives

    over = reference(ranks, threads, smoke)
    with tempfile.TemporaryDirectory(prefix="pipeflow-measure-") as tmp:
        calib = Path(tmp) / "calibration.json"
        data = calibrate(compose("train", over), calib)
        # the operators priced by the sweep as written so far (this section's own rows aside)
        sim = [o for o in over if not o.startswith(("runtime.", "logger="))]
        inputs = prepare_simulation(compose("simulate", [*sim, "cost=analytic", "topology=local_cpu",
                                                         f"topology.device_profile={path}"]))
        device = inputs.topology.devices[0]
        priced = {key: inputs.cost.compute_time(key.split("|")[0], int(key.split("|")[1]), 0, device)
                  for key in data["times"] if key[0] in "FBIW" and not key.startswith("I|0|")}
    # (the all-reduce's rate as the calibration measured it at 1 and 8 MiB, not from the
    # step's synchronisation: its tied embedding is 128 KiB, whose all-reduce is its fixed cost)
    keep = ("cores", "contention", "latency", "bandwidth", "message_host", "collective_bandwidth")
    rows.append({"reference": over, "host": {k: data["host"][k] for k in keep if k in data["host"]},
                 "times": {k: data["times"][k] for k in priced}, "priced": priced,
                 "in_step": in_step_rows(data["times"], priced, list(inputs.cost.layers_per_stage)),
                 "sync_s": data.get("sync_s"), "sync_collectives": sync_collectives(inputs.cost.spec, inputs.schedule)})
    return True


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, as given (checked by :func:`refusal`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device_profile.json", help="where to write the device profile")
    parser.add_argument("--device", default="auto", help="auto (cuda if visible, else cpu), cpu or cuda")
    parser.add_argument("--budget-s", default="180", help="wall-clock seconds for the whole sweep (default 180)")
    parser.add_argument("--threads", default=None,
                        help="torch's intra-op threads while measuring (default: torch's own); pipeflow-train's "
                             "CPU ranks run runtime.threads_per_rank, 1 by default")
    parser.add_argument("--ranks", default="2",
                        help="CPU: local ranks of the reference pipeline the host is calibrated on (default 2; 0 skips "
                             "section pipeline)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes only: a check that the sweep runs")
    return parser.parse_args(argv)


def cuda_visible() -> bool:
    """Whether torch sees a CUDA device here."""
    import torch

    return torch.cuda.is_available()


def refusal(args: argparse.Namespace) -> str | None:
    """The one line that names a bad flag and what it allows; None when the flags hold."""
    if args.device not in DEVICES:
        return f"--device={args.device}: unknown device; allowed values: {', '.join(DEVICES)}"
    if args.device == "cuda" and not cuda_visible():
        return "--device=cuda: no CUDA device is visible here; allowed values: auto, cpu"
    try:
        budget = float(args.budget_s)
    except ValueError:
        budget = float("nan")
    if not budget > 0 or budget == float("inf"):
        return f"--budget-s={args.budget_s}: not a positive number of seconds; allowed values: seconds > 0, e.g. 180"
    # a section starts where 1 s of its share is left, and the first's share is the least
    name, first, _ = min(SECTIONS[0], CPU_SECTIONS[0], key=lambda section: section[1])
    if budget * first < 1:
        return (f"--budget-s={args.budget_s}: too short for any section (the first, {name}, has {first:.0%} of the "
                f"budget and a section needs 1 s); allowed values: seconds >= {math.ceil(1 / first)}, 180 by default")
    if args.threads is not None and not (args.threads.isdigit() and int(args.threads) > 0):
        return f"--threads={args.threads}: not a whole number of threads; allowed values: 1, 2, ... (default: torch's)"
    if not (args.ranks.isdigit() and int(args.ranks) != 1):
        return f"--ranks={args.ranks}: not a number of ranks; allowed values: 0 (no pipeline section), 2, 3, ..."
    if Path(args.out).is_dir():
        return f"--out={args.out}: a folder; allowed values: a file's path, e.g. device_profile.json"
    why = check_file(args.out)
    if why is not None:
        return f"--out={args.out}: {why}; allowed values: a file's path in a folder you can write"
    return None


def main(argv: list[str] | None = None) -> int:
    """Check the flags, measure, say where the file is; the exit status (2: a bad flag)."""
    args = parse(argv)
    wrong = refusal(args)
    if wrong:
        print(wrong, file=sys.stderr)
        return 2
    device = args.device if args.device != "auto" else ("cuda" if cuda_visible() else "cpu")
    budget, out = float(args.budget_s), Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)  # (checked: refusal's check_file)
    names = ", ".join([name for name, _, _ in sections_for(device)] + ([] if device == "cuda" else ["blocks"])
                      + (["pipeline"] if device == "cpu" and int(args.ranks) else []))
    print(f"measuring {device}{' (smoke sizes)' if args.smoke else ''} for at most {budget:.0f} s: {names}", flush=True)
    threads = int(args.threads) if args.threads else None
    ranks = int(args.ranks)
    extra = [] if device == "cuda" else [("blocks", 1.0, lambda rows, deadline: block_rows(rows, deadline, args.smoke))]
    if device == "cpu" and ranks:
        extra.append(("pipeline", 1.0, lambda rows, deadline: pipeline_rows(rows, deadline, out, ranks, threads,
                                                                             args.smoke)))
    from pipeflow.models.loss import cross_entropy_sum  # (the runs' loss: the sweep times it)

    try:
        doc = sweep(out, budget, device, smoke=args.smoke, say=lambda line: print(line, flush=True),
                    threads=threads, extra=tuple(extra), loss=cross_entropy_sum)
    except Fault as err:  # (the file as it was after the last section written whole, or none)
        print(err, file=sys.stderr)
        return 1
    print(f"wrote {out} ({doc['status']}, {doc['seconds']} s)")
    wrong = prices_nothing(doc, out, args.budget_s)
    if wrong:
        print(wrong, file=sys.stderr)
        return 1
    print(f"topology.device_profile={out} prices with it")
    return 0


def prices_nothing(doc: dict, out: Path, budget: str) -> str | None:
    """The line saying the sweep in ``out`` cannot price a step (a section it needs has no rows)
    and what to do; None where it can."""
    from pipeflow.planning.device_profile import ProfileError
    from pipeflow.planning.from_sweep import from_sweep

    try:
        from_sweep(doc, out.stem, str(out))
        return None
    except ProfileError as err:
        reason = str(err).removeprefix(f"{out}: ").split(";")[0]
    short = [name for name, sec in doc["sections"].items() if sec["status"] in ("skipped", "truncated (deadline)")]
    failed = [name for name, sec in doc["sections"].items() if sec["status"] == "error"]
    cause = (f"sections {', '.join(failed)} failed (their errors are in the file)" if failed and not short else
             f"--budget-s={budget} cut short or skipped sections {', '.join(short)}; measure again with a longer "
             f"--budget-s (180 by default)")
    return f"{out} cannot price a step ({reason}): {cause}"


if __name__ == "__main__":
    sys.exit(main())
