"""Calibrate the simulator to this machine (the measurements: :mod:`pipeflow.runtime.calibration_run`).

    python -m pipeflow.calibrate --out calibration.json schedule=zb_h1 pipeline.stages=2
    pipeflow-simulate schedule=zb_h1 pipeline.stages=2 cost=calibrated cost.calibration=calibration.json

starts the configuration's ranks as ``pipeflow-train`` would and writes what a real step
of it costs here; ``cost=calibrated`` reads the file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig

from pipeflow.config import compose, prepare_training
from pipeflow.runtime import calibration_run as measure


def calibrate(cfg: DictConfig, out: str | Path | None = None) -> dict:
    """Calibrate a composed train config (checked first, as pipeflow-train checks it, and
    run as its run plan says); write ``out``."""
    return measure.calibrate(prepare_training(cfg).plan, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="calibration.json", help="where to write the calibration")
    parser.add_argument("overrides", nargs="*", help="pipeflow-train overrides, e.g. schedule=1f1b pipeline.stages=4")
    args = parser.parse_args(argv)
    result = calibrate(compose("train", list(args.overrides) + ["logger=none"]), args.out)
    print(f"wrote {args.out}")
    host = result["host"]
    print(f"host: {host['cores']} cores, contention {host['contention']:.3f}, message "
          f"{host['latency'] * 1e6:.0f} us + bytes / {host['bandwidth'] / 1e9:.2f} GB/s, "
          f"sync {result['sync_s'] * 1e3:.2f} ms")
    for key, v in sorted(result["times"].items(), key=lambda kv: (int(kv[0].split("|")[1]), kv[0])):
        print(f"  {key:<10} {v * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
