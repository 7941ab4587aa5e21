"""pipeflow's 1F1B against PyTorch's own Schedule1F1B: step time of the same training.

The same 2-stage GPT (gpt_tiny: 4 layers, n_embd 128, seq_len 128; uniform split, 2
layers per stage), the same batches (m=4 microbatches of 4 sequences), 2 CPU ranks over
gloo with one intra-op thread each. Each rank holds both trainers, each with its own
copy of its stage and its own optimizer:

- pipeflow: its runtime's ``Executor`` running pipeflow's 1F1B, set up as
  ``pipeflow.runtime.worker`` sets it up, timed as the worker times it (a barrier, then
  ``train_step``: the schedule, the tied-embedding and gradient-norm all-reduces,
  clipping and the AdamW step);
- torch: our GPTStage modules in ``torch.distributed.pipelining.PipelineStage`` driven
  by ``Schedule1F1B``, followed by exactly the rest of pipeflow's iteration (the tied
  embedding's all-reduce, the gradient norm and loss in one all-reduce, clipping,
  AdamW with pipeflow's learning-rate schedule), timed the same way.

So both step times **include the optimizer step**. The trainers alternate step by step
in the same processes (pipeflow first on odd steps, torch first on even ones), so a
pair of adjacent steps sees the same machine: on a shared host the load drifts by tens
of percent between runs, far more than the difference being measured. Each run's first
steps are warm-up (allocator, gloo connections, torch's shape inference) and are
dropped. Reported: the median step time of each trainer over all steady steps of all
runs and their ratio pipeflow/torch (target <= 1.0), and the median of the per-step
ratios of adjacent steps. As a check that both did the same work, their losses are
compared step by step.

Run from the repository root (about 10 s per run):

    .venv/bin/python -m benchmarks.bench_runtime_vs_torch
    .venv/bin/python -m benchmarks.bench_runtime_vs_torch --repeats 5 --steps 20

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
from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose, prepare_training  # noqa: E402
from pipeflow.runtime.launch import free_port, rank_context  # noqa: E402

TARGET = 1.0
WARMUP = 3  # steps of each run left out of the medians
TIMEOUT_S = 120


def overrides(steps: int) -> list[str]:
    return [
        "model=gpt_tiny",
        "schedule=1f1b",
        "partition=uniform",
        "pipeline.stages=2",
        "pipeline.microbatches=4",
        "pipeline.microbatch_size=4",
        f"trainer.steps={steps}",
        "trainer.timeline_step=null",
        "trainer.val_every=0",
        "trainer.val_batches=1",
        "runtime.threads_per_rank=1",
        "logger=none",
    ]


# --------------------------------------------------------------------- the two trainers
class TorchTrainer:
    """Our stage in torch's PipelineStage under Schedule1F1B, plus pipeflow's end of iteration."""

    def __init__(self, rank: int, world: int, cfg: dict, layers: list[int]):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from pipeflow.models.gpt import build_stage, lm_loss
        from pipeflow.runtime.worker import make_optimizer

        self.rank, self.world = rank, world
        self.first, self.last = rank == 0, rank == world - 1
        self.m = int(cfg["pipeline"]["microbatches"])
        tokens_per_microbatch = int(cfg["pipeline"]["microbatch_size"]) * int(cfg["model"]["seq_len"])
        module = build_stage(cfg["model"], layers, rank, int(cfg["seed"]))
        stage = PipelineStage(module, stage_index=rank, num_stages=world, device=torch.device("cpu"))

        # per-microbatch mean loss; torch divides the summed gradients by m (scale_grads),
        # which is pipeflow's sum(CE) / global tokens (see tests/test_torch_pipelining.py)
        def loss_fn(logits, targets):
            return lm_loss(logits, targets, tokens_per_microbatch)

        self.schedule = Schedule1F1B(stage, n_microbatches=self.m, loss_fn=loss_fn, scale_grads=True)
        self.optimizer = make_optimizer(module, cfg["optim"])
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.tied = module.tied_parameters()  # wte on stage 0, lm_head on the last stage
        self.counted = [p for p in self.params if self.first or all(p is not t for t in self.tied)]
        self.clip = cfg["optim"].get("grad_clip")

    def step(self, batch, lr: float) -> float:
        import torch.distributed as dist

        inputs, targets = batch
        mb_losses: list = []
        if self.first:
            self.schedule.step(inputs)
        else:
            self.schedule.step(target=targets, losses=mb_losses, return_outputs=False)
        # the rest of pipeflow's iteration: sum the tied copies' gradients (2 stages: the
        # world is exactly the two holders) ...
        for p in self.tied:
            dist.all_reduce(p.grad)
        # ... one all-reduce for the global gradient norm and the loss, clip, update
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.counted:
            sq += p.grad.detach().double().pow(2).sum()
        loss = sum(float(x.detach()) for x in mb_losses) / self.m if self.last else 0.0
        vec = torch.stack([sq, torch.tensor(loss, dtype=torch.float64)])
        dist.all_reduce(vec)
        norm = vec[0].item() ** 0.5
        if self.clip:
            coef = self.clip / (norm + 1e-6)
            if coef < 1.0:
                for p in self.params:
                    p.grad.mul_(coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return vec[1].item()


class PipeflowTrainer:
    """pipeflow's Executor and 1F1B, built by the runtime's own rank set-up."""

    def __init__(self, rank: int, world: int, cfg: dict, layers: list[int]):
        from pipeflow.runtime.worker import build_rank

        setup = build_rank(cfg, rank, torch.device("cpu"))
        assert setup.layers_per_stage == layers  # the split torch's stages use too
        self.executor = setup.executor
        # as the worker: microbatch losses are token sums over the global token count
        self.normalizer = float(setup.schedule.num_microbatches * setup.adapter.mbs * setup.adapter.seq_len)

    def step(self, batch, lr: float) -> float:
        return self.executor.train_step(batch, self.normalizer, lr).loss


def _rank(rank: int, world: int, port: int, cfg: dict, layers: list[int], batches: list, out: str) -> None:
    import torch.distributed as dist

    from pipeflow.runtime.worker import lr_at

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(int(cfg["runtime"]["threads_per_rank"] or 1))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    trainers = {"pipeflow": PipeflowTrainer(rank, world, cfg, layers), "torch": TorchTrainer(rank, world, cfg, layers)}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    losses: dict[str, list[float]] = {k: [] for k in trainers}
    steps = len(batches)
    for step, batch in enumerate(batches, start=1):
        lr = lr_at(step, cfg["optim"], steps)
        order = ["pipeflow", "torch"] if step % 2 else ["torch", "pipeflow"]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = trainers[name].step(batch, lr)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_time": times, "loss": losses}))
    dist.barrier()
    dist.destroy_process_group()


def run_both(cfg: dict, layers: list[int], batches: list, out: Path) -> dict:
    # forked from the launcher's server (torch and the model already imported)
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, cfg, layers, batches, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(TIMEOUT_S + 60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if [p.exitcode for p in procs] != [0, 0]:
        raise RuntimeError(f"the benchmark's ranks ended with {[p.exitcode for p in procs]}; see their tracebacks")
    return json.loads(out.read_text())


def _ratios(run: dict) -> list[float]:
    """pipeflow's step over torch's adjacent step, for each steady step of one run."""
    return [a / b for a, b in zip(run["step_time"]["pipeflow"][WARMUP:], run["step_time"]["torch"][WARMUP:])]


def results(repeats: int = 3, steps: int = 15) -> dict:
    """``repeats`` fresh pairs of ranks, ``steps`` alternating steps each.

    Returns ``runs`` (each run's per-trainer ``step_time`` and ``loss`` lists), ``median``
    (trainer -> median steady step time, s), ``ratio`` (pipeflow / torch of those
    medians), ``pair_ratio`` (median of the adjacent-step ratios), ``steady_steps`` (per
    trainer) and ``loss_max_rel_diff`` (the largest relative loss difference, step by step).
    """
    if steps <= WARMUP:
        raise ValueError(f"steps must exceed the {WARMUP} warm-up steps")
    dcfg = compose("train", overrides(steps))
    inputs = prepare_training(dcfg)
    cfg = OmegaConf.to_container(dcfg, resolve=True)
    from pipeflow.data.text import build_text_data
    from pipeflow.planning.partition import partition_layers

    layers = list(partition_layers(cfg["partition"]["name"], inputs.spec, 2))
    batch_size = cfg["pipeline"]["microbatches"] * cfg["pipeline"]["microbatch_size"]
    data = build_text_data(cfg["data"], inputs.spec.seq_len, int(cfg["seed"]))
    batches = [data.train_batch(step, batch_size) for step in range(1, steps + 1)]  # pipeflow's steps 1..N

    runs = []
    with tempfile.TemporaryDirectory(prefix="pipeflow-bench-") as tmp:
        for r in range(repeats):
            runs.append(run_both(cfg, layers, batches, Path(tmp) / f"run-{r}.json"))

    names = ("pipeflow", "torch")
    steady = {k: [t for run in runs for t in run["step_time"][k][WARMUP:]] for k in names}
    med = {k: statistics.median(v) for k, v in steady.items()}
    # the same training: the losses agree step by step (fp32 round-off apart)
    diffs = [abs(a - b) / abs(b) for run in runs for a, b in zip(run["loss"]["pipeflow"], run["loss"]["torch"])]
    return {"runs": runs, "median": med, "ratio": med["pipeflow"] / med["torch"],
            "pair_ratio": statistics.median(x for run in runs for x in _ratios(run)),
            "steady_steps": len(steady["pipeflow"]), "loss_max_rel_diff": max(diffs), "loss_steps": len(diffs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs, each a fresh pair of ranks (default 3)")
    ap.add_argument("--steps", type=int, default=15, help=f"steps per run; the first {WARMUP} are warm-up (default 15)")
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps")

    res = results(args.repeats, args.steps)
    med, ratio = res["median"], res["ratio"]
    print(f"gpt_tiny (4 layers, n_embd 128, seq 128), 2 stages x 2 layers, 1F1B, m=4, mbs=4; "
          f"2 CPU ranks (gloo, 1 thread each); {args.repeats} runs x {args.steps} steps, the trainers alternating "
          f"step by step, first {WARMUP} steps of each run dropped; step time includes the optimizer step")
    head = f"{'run':>4} {'pipeflow med':>13} {'torch med':>10} {'ratio':>7} {'per-step ratio med':>19}"
    print(head)
    print("-" * len(head))
    for r, run in enumerate(res["runs"]):
        a = statistics.median(run["step_time"]["pipeflow"][WARMUP:])
        b = statistics.median(run["step_time"]["torch"][WARMUP:])
        pr = statistics.median(_ratios(run))
        print(f"{r:>4} {a * 1e3:>11.1f}ms {b * 1e3:>8.1f}ms {a / b:>7.3f} {pr:>19.3f}")
    print(f"{'all':>4} {med['pipeflow'] * 1e3:>11.1f}ms {med['torch'] * 1e3:>8.1f}ms {ratio:>7.3f} "
          f"{res['pair_ratio']:>19.3f}")
    print(f"pipeflow/torch = {ratio:.3f} (medians of {res['steady_steps']} steady steps each; target <= {TARGET}); "
          f"median ratio of adjacent steps {res['pair_ratio']:.3f}")
    print(f"loss agreement pipeflow vs torch: max relative difference {res['loss_max_rel_diff']:.2e} "
          f"over {res['loss_steps']} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
