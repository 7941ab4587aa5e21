"""Measure this machine's operators into a device profile (the sweep: :mod:`pipeflow.topology.op_sweep`).

    python -m pipeflow.measure_device --out device_profile.json [--device auto|cpu|cuda] [--budget-s 180]
                                      [--threads N] [--smoke]

times matrix products, attention, norms and elementwise ops, cross-entropy, AdamW and the
cost per launch on one device (auto: the GPU when one is visible, else the CPU) within
the budget, writing the file after every section; ``topology.device_profile=<file>``
prices with it. ``--smoke`` measures tiny sizes only (seconds; for tests).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeflow.topology.op_sweep import sections_for, sweep

DEVICES = ("auto", "cpu", "cuda")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, as given (checked by :func:`refusal`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device_profile.json", help="where to write the device profile")
    parser.add_argument("--device", default="auto", help="auto (cuda if visible, else cpu), cpu or cuda")
    parser.add_argument("--budget-s", default="180", help="wall-clock seconds for the whole sweep (default 180)")
    parser.add_argument("--threads", default=None,
                        help="torch's intra-op threads while measuring (default: torch's own); pipeflow-train's "
                             "CPU ranks run runtime.threads_per_rank, 1 by default")
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
    if args.threads is not None and not (args.threads.isdigit() and int(args.threads) > 0):
        return f"--threads={args.threads}: not a whole number of threads; allowed values: 1, 2, ... (default: torch's)"
    if Path(args.out).is_dir():
        return f"--out={args.out}: a folder; allowed values: a file's path, e.g. device_profile.json"
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
    out.parent.mkdir(parents=True, exist_ok=True)
    names = ", ".join(name for name, _, _ in sections_for(device))
    print(f"measuring {device}{' (smoke sizes)' if args.smoke else ''} for at most {budget:.0f} s: {names}", flush=True)
    threads = int(args.threads) if args.threads else None
    doc = sweep(out, budget, device, smoke=args.smoke, say=lambda line: print(line, flush=True), threads=threads)
    print(f"wrote {out} ({doc['status']}, {doc['seconds']} s)")
    print(f"topology.device_profile={out} prices with it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
