"""Fused (scaled-dot-product) against eager attention, side by side in one run.

Three tables, each variant alternating with the other, repeated, medians:

1. **One attention layer**: forward + backward of causal attention over 4 heads of 32
   (4 sequences up to 4,096 tokens, one at 8,192), through
   :func:`pipeflow.models.attention.attention`, what every model runs; time and the bytes
   its forward saves for the backward (the runtime's meter).
2. **A gpt_small stage**: two of its 12 layers (one stage of a 6-stage pipeline), one
   sequence, forward + backward; time and saved bytes, measured, and the analytic cost
   model's prediction of the saved bytes (``pipeflow-simulate``'s ``activation_bytes``).
3. **The make run default** (gpt_tiny, 128 tokens, 1F1B on 2 CPU ranks, 4 microbatches of
   4): the training step's wall time with ``model.attention=sdpa`` against ``eager``, and
   with ``--before REV`` against the same default trained by that git revision of this
   repository (checked out into a temporary worktree and run from there, alternating).

    .venv/bin/python -m benchmarks.bench_attention [--tokens 128,1024,4096] [--repeats 3] [--threads 1]
    .venv/bin/python -m benchmarks.bench_attention --tokens 128 --train-repeats 5 --before 05dbdbf

Times are this host's and noisy (a shared machine): read the ratios. Saved bytes do
not depend on the load: they are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose  # noqa: E402
from pipeflow.models import gpt  # noqa: E402
from pipeflow.models.attention import Pattern, attention  # noqa: E402
from pipeflow.planning.cost import AnalyticCost  # noqa: E402
from pipeflow.planning.transformer import TransformerSpec  # noqa: E402
from pipeflow.runtime.saved_bytes import SavedBytes  # noqa: E402

TOKENS = (128, 512, 1024, 2048, 4096, 8192)
MODES = ("eager", "sdpa")
ROOT = Path(__file__).resolve().parents[1]


def _timed(run, exclude: set) -> tuple[float, int]:
    """(seconds, saved bytes) of one forward + backward; ``run(meter)`` does the forward
    under the meter's hooks and returns (output, its gradient). ``exclude``: the storages
    of the weights, which are not activations."""
    meter = SavedBytes(exclude)
    t = time.perf_counter()
    out, grad = run(meter)
    saved = meter.current
    out.backward(grad)
    return time.perf_counter() - t, saved


def _alternate(runs: dict, repeats: int, exclude: set = frozenset()) -> dict:
    """Each variant's median seconds and its saved bytes, alternating variant by variant."""
    times = {k: [] for k in runs}
    saved = {}
    for _ in range(repeats):
        for name, run in runs.items():
            seconds, saved[name] = _timed(run, exclude)
            times[name].append(seconds)
    return {k: (statistics.median(v), min(v), max(v), saved[k]) for k, v in times.items()}


def layer_rows(tokens, repeats: int) -> list[dict]:
    rows = []
    for T in tokens:
        batch = 4 if T <= 4096 else 1
        gen = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(batch, 4, T, 32, generator=gen) for _ in range(3))
        grad = torch.randn(batch, 4, T, 32, generator=gen)

        def run_for(mode):
            def run(meter):
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                with meter.hooks():
                    out = attention(qq, kk, vv, Pattern(mode, causal=True))
                return out, grad
            return run
        got = _alternate({m: run_for(m) for m in MODES}, repeats if T <= 2048 else 1)
        rows.append({"tokens": T, "batch": batch, **{m: got[m] for m in MODES}})
    return rows


def stage_rows(tokens, repeats: int) -> list[dict]:
    base = OmegaConf.to_container(compose("train", ["model=gpt_small"]).model, resolve=True)
    rows = []
    for T in tokens:
        model = {**base, "seq_len": T, "n_positions": max(T, base["n_positions"])}
        stages = {m: gpt.build_stage({**model, "attention": m}, [2] * 6, 1, seed=0) for m in MODES}
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(1, T, model["n_embd"], generator=gen)
        grad = torch.randn(1, T, model["n_embd"], generator=gen)

        def run_for(mode):
            def run(meter):
                h = x.clone().requires_grad_(True)
                with meter.hooks():
                    out = stages[mode](h)
                return out, grad
            return run
        weights = {t.untyped_storage().data_ptr() for st in stages.values() for t in (*st.parameters(), *st.buffers())}
        got = _alternate({m: run_for(m) for m in MODES}, repeats if T <= 1024 else 1, weights)
        predicted = {}
        for m in MODES:
            spec = TransformerSpec.from_config({**model, "attention": m})
            predicted[m] = AnalyticCost(spec, 6, microbatch_size=1, dtype_bytes=4).activation_bytes(1, 0)
        rows.append({"tokens": T, **{m: got[m] for m in MODES}, "predicted": predicted})
    return rows


def _mean_step(tree: Path, steps: int, extra: list[str]) -> float:
    """The mean step time of make run's default trained ``steps`` steps by the code in
    ``tree`` (the first two steps warm up)."""
    with tempfile.TemporaryDirectory(prefix="pipeflow-bench-attention-") as tmp:
        cmd = [sys.executable, "-m", "pipeflow.train", *extra, f"trainer.steps={steps}", "logger=none",
               "trainer.val_every=0", "trainer.timeline_step=null", f"hydra.run.dir={tmp}"]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
        lines = [json.loads(x) for x in Path(tmp, "metrics.jsonl").read_text().splitlines()]
        return statistics.mean([r["step_time"] for r in lines if "step_time" in r][2:])


def train_step_ratio(repeats: int, steps: int = 60, before: str | None = None) -> dict:
    """make run's default for ``steps`` steps, sdpa against eager (and against revision
    ``before``), alternating: the median of each run's mean step time."""
    variants = {m: (ROOT, [f"model.attention={m}"]) for m in MODES}
    worktree = None
    if before:
        worktree = Path(tempfile.mkdtemp(prefix="pipeflow-before-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), before], cwd=ROOT, check=True,
                       capture_output=True)
        variants[f"before ({before})"] = (worktree, [])
    try:
        times = {k: [] for k in variants}
        for _ in range(repeats):
            for name, (tree, extra) in variants.items():
                times[name].append(_mean_step(tree, steps, extra))
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated sequence lengths")
    ap.add_argument("--stage-tokens", default=None, help="the gpt_small stage's lengths (default: --tokens)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per size (one beyond 2,048 tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-repeats", type=int, default=3, help="rounds of the make run comparison; 0: skip it")
    ap.add_argument("--before", default=None, help="a git revision whose make run default to time beside this tree's")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    stage_tokens = [int(t) for t in (args.stage_tokens or args.tokens).split(",")]

    print(f"1. one causal attention layer, 4 heads of 32, forward + backward, {args.threads} thread(s); "
          f"time median (min-max) over {args.repeats} alternating rounds (1 beyond 2,048 tokens)")
    print(f"{'tokens':>7} {'batch':>5} {'eager ms':>20} {'sdpa ms':>20} {'eager/sdpa':>10} "
          f"{'eager saved MiB':>15} {'sdpa saved MiB':>14} {'saved ratio':>11}")
    for r in layer_rows(tokens, args.repeats):
        e, f = r["eager"], r["sdpa"]
        print(f"{r['tokens']:>7} {r['batch']:>5} {e[0] * 1e3:>9.1f} ({e[1] * 1e3:.0f}-{e[2] * 1e3:.0f})"
              f" {f[0] * 1e3:>9.1f} ({f[1] * 1e3:.0f}-{f[2] * 1e3:.0f}) {e[0] / f[0]:>10.2f} "
              f"{_mib(e[3]):>15} {_mib(f[3]):>14} {e[3] / f[3]:>11.1f}")

    print("\n2. gpt_small, one stage of 6 (2 layers), one sequence, forward + backward; saved bytes measured "
          "(the runtime's meter) and predicted (the analytic cost, fp32)")
    print(f"{'tokens':>7} {'eager s':>8} {'sdpa s':>8} {'eager/sdpa':>10} {'eager MiB':>10} {'predicted':>10} "
          f"{'sdpa MiB':>9} {'predicted':>10}")
    for r in stage_rows(stage_tokens, args.repeats):
        e, f, p = r["eager"], r["sdpa"], r["predicted"]
        print(f"{r['tokens']:>7} {e[0]:>8.3f} {f[0]:>8.3f} {e[0] / f[0]:>10.2f} {_mib(e[3]):>10} "
              f"{_mib(p['eager']):>10} {_mib(f[3]):>9} {_mib(p['sdpa']):>10}")

    if args.train_repeats:
        got = train_step_ratio(args.train_repeats, before=args.before)
        f = got["sdpa"]
        print(f"\n3. make run's default (gpt_tiny, 128 tokens, 1F1B, 2 ranks), mean step time of 60 steps, "
              f"median (min-max) of {args.train_repeats} alternating runs:")
        for name, (med, lo, hi) in got.items():
            print(f"   {name:<24} {med * 1e3:7.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f})   sdpa / this: {f[0] / med:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
