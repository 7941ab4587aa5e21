"""compile=true against compile=false over the whole grid the suite covers only in part:
GPT, BERT and Llama under 1F1B, ZB-H1, interleaved 1F1B, Seq1F1B and Chimera (where the
family takes the schedule), 2 CPU ranks, fp32, dropout off, 3 steps each way.

``tests/test_compile.py`` trains a cover of this grid (each schedule on one family, each
family under one schedule) within the suite's budget; this runs every cell and prints
the largest relative difference of the compiled run's losses from the eager run's, and
the compiled run's first step (the compile's seconds: a cell that did not compile would
show an eager first step).

    .venv/bin/python -m benchmarks.bench_compile_grid
    .venv/bin/python -m benchmarks.bench_compile_grid --families gpt --schedules zb_h1,seq1f1b

It reports, it does not fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeflow.config import ConfigError, compose, prepare_training  # noqa: E402
from pipeflow.runtime.launch import TrainJob, launch  # noqa: E402

SMALL = ["pipeline.microbatches=4", "pipeline.microbatch_size=2", "optim.warmup_steps=2", "trainer.val_every=0",
         "trainer.val_batches=1", "trainer.timeline_step=null", "logger=none", "model.dropout=0", "trainer.steps=3",
         "pipeline.stages=2"]
FAMILIES = {"gpt": ["model.n_layer=8", "model.n_embd=64", "model.n_head=4", "model.seq_len=64"],
            "bert": ["model=bert_tiny", "data=mlm_corpus", "model.seq_len=64"],
            "llama": ["model=llama_tiny", "model.seq_len=64"]}
SCHEDULES = {"1f1b": [], "zb_h1": [], "interleaved_1f1b": ["pipeline.virtual_stages=2"],
             "seq1f1b": ["pipeline.segments=2"], "chimera": []}


def _train(run_dir: Path, overrides: list[str]) -> list[dict]:
    launch(TrainJob(prepare_training(compose("train", overrides)).plan, str(run_dir)))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cell(family: str, schedule: str) -> dict:
    """One cell: the eager and the compiled run's losses, or why the config is refused."""
    over = [*FAMILIES[family], *SMALL, f"schedule={schedule}", *SCHEDULES[schedule]]
    try:
        prepare_training(compose("train", [*over, "compile=true"]))
    except ConfigError as err:
        return {"refused": str(err)}
    with tempfile.TemporaryDirectory(prefix="pipeflow-grid-") as tmp:
        rows = {c: _train(Path(tmp) / c, [*over, f"compile={c}"]) for c in ("false", "true")}
    eager, compiled = ([r["loss"] for r in rows[c]] for c in ("false", "true"))
    return {"eager": eager, "compiled": compiled,
            "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(compiled, eager)),
            "first_step_s": {c: rows[c][0]["step_time"] for c in ("false", "true")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args(argv)
    print(f"{'family':<7} {'schedule':<18} {'losses: compiled vs eager':<28} first step eager / compiled")
    for family in args.families.split(","):
        for schedule in args.schedules.split(","):
            r = cell(family, schedule)
            if "refused" in r:
                print(f"{family:<7} {schedule:<18} refused: {r['refused']}")
                continue
            first = r["first_step_s"]
            print(f"{family:<7} {schedule:<18} {'largest rel. diff ' + format(r['max_rel_diff'], '.1e'):<28} "
                  f"{first['false']:.2f} s / {first['true']:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
