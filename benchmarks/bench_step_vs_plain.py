"""pipeflow on one stage against a plain PyTorch loop over the same model and batch,
eager and compiled: what pipeflow's runtime costs over the loop a user would write.

Four trainers in one process, over the same GPT (by default GPT-2 small's width: n_embd
768, 12 heads, its 50,257-token vocabulary, the embedding and head padded to 50,304 rows
as the preset's model.vocab_multiple=64 says, ``--vocab-multiple 1`` for none; 2 layers and
256 tokens, so that a CPU step takes about a second), the same batches and the same
starting weights:

- ``pipeflow``: ``pipeflow-train``'s own rank set-up (``pipeflow.runtime.rank.build_rank``)
  for ``pipeline.stages=1``, its executor's ``train_step`` (the schedule's forwards and
  backwards, the gradient norm, clipping, AdamW as pipeflow makes it);
- ``pipeflow compiled``: the same with ``compile=true`` (each block compiled on its own);
- ``plain``: ``transformers``' ``GPT2LMHeadModel`` built from the same config (its stock
  ``sdpa`` attention) with pipeflow's weights copied in, the microbatches' losses
  (pipeflow's: summed cross-entropy over the global token count, over the words' logits
  of a padded head, as nanoGPT's loop scores them) backpropagated one
  after another, ``clip_grad_norm_``, then ``torch.optim.AdamW(fused=True)`` with
  pipeflow's parameter groups and learning rate;
- ``plain compiled``: the same model under ``torch.compile`` (the whole model).

The trainers take turns step by step (the order rotating each step) so that each
step's four see the same machine; each run's first steps (the compiles) are warm-up and
dropped. Reported: each trainer's median step over the steady steps of every run, the
ratios pipeflow/plain eager and compiled (targets: compiled at most 1.05 on CPU at
gpt_small's width), each run's own ratios (the spread), and the largest relative
difference of the eager trainers' losses, step by step (the same work: fp32, the same
data and weights, a few 1e-6 apart).

    .venv/bin/python -m benchmarks.bench_step_vs_plain
    .venv/bin/python -m benchmarks.bench_step_vs_plain --repeats 3 --steps 8 --layers 2 --seq 256
    .venv/bin/python -m benchmarks.bench_step_vs_plain --model gpt_tiny --layers 4 --seq 128
    .venv/bin/python -m benchmarks.bench_step_vs_plain --vocab-multiple 1   # GPT-2's head unpadded

Prints a table; it reports, it does not fail.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose, prepare_training  # noqa: E402
from pipeflow.runtime.launch import free_port, rank_context  # noqa: E402

WARMUP = 3  # steps of each run left out of the medians (the compiles happen in the first)
TRAINERS = ("pipeflow", "plain", "pipeflow compiled", "plain compiled")
TARGET_COMPILED = 1.05


def overrides(model: str, layers: int, seq: int, microbatches: int, mbs: int, steps: int, threads: int,
              compiled: bool, vocab_multiple: int | None = None) -> list[str]:
    padding = [] if vocab_multiple is None else [f"model.vocab_multiple={vocab_multiple}"]
    return [f"model={model}", *padding, f"model.n_layer={layers}", f"model.seq_len={seq}", "model.dropout=0",
            "schedule=1f1b", "pipeline.stages=1", f"pipeline.microbatches={microbatches}",
            f"pipeline.microbatch_size={mbs}", f"trainer.steps={steps}", "trainer.timeline_step=null",
            "trainer.val_every=0", "trainer.val_batches=1", f"runtime.threads_per_rank={threads}", "logger=none",
            f"compile={'true' if compiled else 'false'}"]


class PlainTrainer:
    """transformers' GPT2LMHeadModel with pipeflow's weights, fused AdamW, a plain loop."""

    def __init__(self, model_cfg: dict, weights: dict, optim, normalizer: float, compiled: bool):
        import copy

        from transformers import GPT2LMHeadModel

        from pipeflow.models.gpt import gpt2_config

        config = copy.deepcopy(gpt2_config(model_cfg))
        config._attn_implementation = "sdpa"  # transformers' stock attention, not pipeflow's
        model = GPT2LMHeadModel(config)
        missing = model.load_state_dict({f"transformer.{k}": v for k, v in weights.items()}, strict=False)
        if [k for k in missing.missing_keys if k != "lm_head.weight"] or missing.unexpected_keys:
            raise RuntimeError(f"the plain model's weights do not map onto pipeflow's: {missing}")
        model.train()
        self.model = model
        self.run = torch.compile(model) if compiled else model
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": optim.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=True)
        self.clip, self.normalizer, self.vocab = optim.grad_clip, normalizer, int(model_cfg["vocab_size"])

    def step(self, batch, lr: float, microbatches: int) -> float:
        inputs, targets = batch
        total = 0.0
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
            logits = self.run(input_ids=x).logits
            words = logits[..., :self.vocab].float().reshape(-1, self.vocab)  # (a padded head's words)
            loss = F.cross_entropy(words, y.reshape(-1), reduction="sum") / self.normalizer
            loss.backward()
            total += float(loss.detach())
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def _run(port: int, plans: dict, model_cfg: dict, batches: list, microbatches: int, threads: int, out: str) -> None:
    """One process's run: the trainers (both pipeflow's and the plain loops, compiled
    where ``plans`` has a compiled plan) taking turns step by step."""
    import torch.distributed as dist

    from benchmarks.bench_runtime_vs_torch import PipeflowTrainer
    from pipeflow.runtime.optimizer import lr_at

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=600))
    eager = PipeflowTrainer(0, 1, {}, plans[False].layers_per_stage, plans[False])
    weights = {k: v.detach().clone() for k, v in eager.executor.stages[(0, 0)].module.state_dict().items()}
    trainers = {"pipeflow": eager, "plain": PlainTrainer(model_cfg, weights, plans[False].optim, eager.normalizer, False)}
    if True in plans:
        trainers["pipeflow compiled"] = PipeflowTrainer(0, 1, {}, plans[True].layers_per_stage, plans[True])
        trainers["plain compiled"] = PlainTrainer(model_cfg, weights, plans[False].optim, eager.normalizer, True)
    optim, steps = plans[False].optim, len(batches)
    times: dict = {k: [] for k in trainers}
    losses: dict = {k: [] for k in trainers}
    for step, batch in enumerate(batches, start=1):
        lr = lr_at(step, optim, steps)
        names = list(trainers)
        names = names[step % len(names):] + names[:step % len(names)]  # rotate who goes first
        for name in names:
            t0 = time.perf_counter()
            trainer = trainers[name]
            loss = trainer.step(batch, lr, microbatches) if isinstance(trainer, PlainTrainer) else trainer.step(batch, lr)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
    Path(out).write_text(json.dumps({"step_time": times, "loss": losses}))
    dist.destroy_process_group()


def measure(model: str = "gpt_small", layers: int = 2, seq: int = 256, microbatches: int = 2, mbs: int = 2,
            repeats: int = 2, steps: int = 8, threads: int | None = None, compiled: bool = True,
            warmup: int = WARMUP, vocab_multiple: int | None = None) -> dict:
    """``repeats`` fresh processes of ``steps`` rotating steps each (see the module's
    docstring); without ``compiled``, the two eager trainers alone."""
    from pipeflow.data.text import build_text_data

    threads = threads or os.cpu_count() or 1
    inputs = {c: prepare_training(compose("train", overrides(model, layers, seq, microbatches, mbs, steps, threads, c,
                                                             vocab_multiple)))
              for c in ((False, True) if compiled else (False,))}
    plans = {c: i.plan for c, i in inputs.items()}
    cfg = OmegaConf.to_container(inputs[False].config, resolve=True)
    data = build_text_data(cfg["data"], inputs[False].spec.seq_len, int(cfg["seed"]))
    batches = [data.train_batch(step, microbatches * mbs) for step in range(1, steps + 1)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="pipeflow-bench-") as tmp:
        for r in range(repeats):
            out = Path(tmp) / f"run-{r}.json"
            proc = rank_context().Process(target=_run, args=(free_port(), plans, cfg["model"], batches, microbatches,
                                                               threads, str(out)))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"the benchmark's process ended with {proc.exitcode}; see its traceback")
            runs.append(json.loads(out.read_text()))
    names = [k for k in TRAINERS if k in runs[0]["step_time"]]
    steady = {k: [t for run in runs for t in run["step_time"][k][warmup:]] for k in names}
    med = {k: statistics.median(v) for k, v in steady.items()}

    def ratio(run: dict, a: str, b: str) -> float:
        return statistics.median(run["step_time"][a][warmup:]) / statistics.median(run["step_time"][b][warmup:])

    diffs = [abs(a - b) / abs(b) for run in runs for a, b in zip(run["loss"]["pipeflow"], run["loss"]["plain"])]
    return {"model": model, "layers": layers, "seq": seq, "microbatches": microbatches, "mbs": mbs,
            "vocab": cfg["model"]["vocab_size"], "rows": inputs[False].spec.vocab_size,
            "threads": threads, "steps": steps, "repeats": repeats, "median": med, "runs": runs,
            "eager_ratio": med["pipeflow"] / med["plain"],
            "compiled_ratio": med["pipeflow compiled"] / med["plain compiled"] if compiled else None,
            "eager_run_ratios": [ratio(r, "pipeflow", "plain") for r in runs],
            "compiled_run_ratios": [ratio(r, "pipeflow compiled", "plain compiled") for r in runs] if compiled else [],
            "loss_max_rel_diff": max(diffs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_small", help="a GPT preset (its width, heads and vocabulary)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--mbs", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes (default 2)")
    ap.add_argument("--steps", type=int, default=8, help=f"steps per run; the first {WARMUP} are warm-up")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    ap.add_argument("--vocab-multiple", type=int, default=None,
                    help="model.vocab_multiple (default: the preset's; 1: the head unpadded)")
    ap.add_argument("--json", type=Path, default=None, help="also write the structured results here")
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps")
    r = measure(args.model, args.layers, args.seq, args.microbatches, args.mbs, args.repeats, args.steps, args.threads,
                vocab_multiple=args.vocab_multiple)
    print(f"{r['model']} width ({r['vocab']} words, {r['rows']} head rows), {r['layers']} layers, {r['seq']} tokens, "
          f"m={r['microbatches']} x {r['mbs']} sequences, "
          f"one stage, {r['threads']} thread(s); {r['repeats']} run(s) x {r['steps']} steps, the four trainers taking "
          f"turns step by step, the first {WARMUP} of each run dropped; fp32")
    for name in r["median"]:
        print(f"  {name:<18} {r['median'][name] * 1e3:9.1f} ms")
    print(f"pipeflow / plain, eager:    {r['eager_ratio']:.3f}  (runs: "
          f"{' '.join(f'{x:.3f}' for x in r['eager_run_ratios'])})")
    print(f"pipeflow / plain, compiled: {r['compiled_ratio']:.3f}  (runs: "
          f"{' '.join(f'{x:.3f}' for x in r['compiled_run_ratios'])}; target <= {TARGET_COMPILED})")
    print(f"eager losses, pipeflow against plain, largest relative difference: {r['loss_max_rel_diff']:.2e}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
