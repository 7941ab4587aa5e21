"""pipeflow's schedules against PyTorch's own (torch.distributed.pipelining): step time of the same training.

Every schedule both runtimes have, each pair running the same training:

============================  ==========================================================
pipeflow                      torch.distributed.pipelining
============================  ==========================================================
``1f1b``                      ``Schedule1F1B``, one ``PipelineStage`` per rank
``gpipe``                     ``ScheduleGPipe``, one ``PipelineStage`` per rank
``interleaved_1f1b``          ``ScheduleInterleaved1F1B``, two ``PipelineStage`` per
(``pipeline.virtual_stages``  rank: rank r holds stages r and r+2 of 4 (torch's default
= 2)                          loop placement, pipeflow's too: checked at start-up)
``zb_h1``                     ``ScheduleInterleavedZeroBubble`` with *one* stage per
                              rank: torch accepts it, and with one local stage its order
                              is ZB-H1's (F, I and W, the W deferred), action for action
                              the same as pipeflow's ``zb_h1`` (checked, see below)
============================  ==========================================================

The same GPT (gpt_tiny: 4 layers, n_embd 128, seq_len 128), split by pipeflow's
``partition_layers`` (uniform) into 2 stages of 2 layers, or into 4 chunks of 1 layer
for the interleaved pair; the same batches (m=8 microbatches of 4 sequences: torch's
interleaved schedules need m to be a multiple of their ``max(1, m // ranks)`` rounds,
which 8 over 2 ranks is); 2 CPU ranks over gloo with one intra-op thread each. Each
rank holds both trainers, each with its own copy of its stages and its own optimizers:

- pipeflow: its runtime's ``Executor`` running the schedule, set up as
  ``pipeflow.runtime.worker`` sets it up, timed as the worker times it (a barrier, then
  ``train_step``: the schedule, the tied-embedding and gradient-norm all-reduces,
  clipping and the AdamW step);
- torch: our GPTStage modules in ``torch.distributed.pipelining.PipelineStage`` driven
  by torch's schedule, followed by exactly the rest of pipeflow's iteration (the tied
  embedding's copies summed by ``runtime.stage.sync_tied``: over the ranks that
  hold the first and the last stage, which for every pair here are both ranks; the
  gradient norm and loss in one all-reduce, clipping, AdamW per stage with pipeflow's
  learning-rate schedule), timed the same way.

So both step times **include the optimizer step**. Each pair's compute order is
compared too: in their first step (a warm-up step, left out of the medians) torch's stages record
the F/B/I/W actions its schedule runs on them, rank by rank, and the table says whether
they are pipeflow's schedule's (they are, for all four pairs; torch's own declarative
``Schedule1F1B.pipeline_order`` is off by one microbatch on the last stage's forwards in
torch 2.13, which is why the executed actions are compared, not that table).

The trainers alternate step by step in the same processes (pipeflow first on odd steps,
torch first on even ones), so a pair of adjacent steps sees the same machine: on a
shared host the load drifts by tens of percent between runs, far more than the
difference being measured. Each run's first steps are warm-up (allocator, gloo
connections, torch's shape inference) and are dropped. Reported per schedule: the
median step time of each trainer over all steady steps of all runs and their ratio
pipeflow/torch (target <= 1.0), the median of the per-step ratios of adjacent steps,
and, as a check that both did the same work, the largest relative difference of their
losses, step by step (0 on this model for all four pairs: the same fp32 operations in the
same order, and torch's 1/m gradient scaling is exact for m=8).

Run from the repository root (about 12 s per run of 12 steps and schedule on a shared 2-core host; the
default, 3 runs of 15 steps for each of the four schedules, about 3 minutes):

    .venv/bin/python -m benchmarks.bench_runtime_vs_torch
    .venv/bin/python -m benchmarks.bench_runtime_vs_torch --repeats 5 --steps 20 --schedules 1f1b,zb_h1
    .venv/bin/python -m benchmarks.bench_runtime_vs_torch --json outputs/bench_runtime_vs_torch.json

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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose, prepare_training  # noqa: E402
from pipeflow.runtime.launch import free_port, rank_context  # noqa: E402
from pipeflow.runtime.optimizer import square_sum  # noqa: E402 - the clip norm, as pipeflow sums it
from pipeflow.runtime.stage import sync_tied  # noqa: E402 - the tied copies, as pipeflow sums them

TARGET = 1.0
WARMUP = 3  # steps of each run left out of the medians
TIMEOUT_S = 120
WORLD = 2
MICROBATCHES = 8
MICROBATCH_SIZE = 4


@dataclass(frozen=True)
class Pair:
    """One schedule in both runtimes: pipeflow's config name and torch's schedule class."""

    torch_schedule: str  # a class in torch.distributed.pipelining
    virtual_stages: int = 1  # model chunks per rank (torch: PipelineStages per rank)
    multi: bool = False  # torch's class takes a list of stages (PipelineScheduleMulti)


SCHEDULES: dict[str, Pair] = {
    "1f1b": Pair("Schedule1F1B"),
    "gpipe": Pair("ScheduleGPipe"),
    "interleaved_1f1b": Pair("ScheduleInterleaved1F1B", virtual_stages=2, multi=True),
    "zb_h1": Pair("ScheduleInterleavedZeroBubble", multi=True),
}


def overrides(steps: int, schedule: str = "1f1b") -> list[str]:
    return [
        "model=gpt_tiny",
        f"schedule={schedule}",
        "partition=uniform",
        f"pipeline.stages={WORLD}",
        f"pipeline.virtual_stages={SCHEDULES[schedule].virtual_stages}",
        f"pipeline.microbatches={MICROBATCHES}",
        f"pipeline.microbatch_size={MICROBATCH_SIZE}",
        f"trainer.steps={steps}",
        "trainer.timeline_step=null",
        "trainer.val_every=0",
        "trainer.val_batches=1",
        "runtime.threads_per_rank=1",
        "logger=none",
    ]


# --------------------------------------------------------------------- the two trainers
class TorchTrainer:
    """Our stages in torch's PipelineStage under torch's schedule, plus pipeflow's end of iteration."""

    def __init__(self, rank: int, world: int, cfg: dict, layers: list[int], schedule: str, placement: list[int]):
        import torch.distributed as dist
        from torch.distributed import pipelining

        from pipeflow.models.gpt import build_stage, lm_loss
        from pipeflow.runtime.optimizer import make_optimizer

        pair = SCHEDULES[schedule]
        num_stages = len(layers)
        self.rank, self.world = rank, world
        self.mine = [s for s in range(num_stages) if placement[s] == rank]  # pipeflow's placement
        self.first, self.last = 0 in self.mine, num_stages - 1 in self.mine
        self.m = int(cfg["pipeline"]["microbatches"])
        tokens_per_microbatch = int(cfg["pipeline"]["microbatch_size"]) * int(cfg["model"]["seq_len"])
        seed = int(cfg["seed"])
        modules = {s: build_stage(cfg["model"], layers, s, seed) for s in self.mine}
        stages = [pipelining.PipelineStage(modules[s], stage_index=s, num_stages=num_stages, device=torch.device("cpu"))
                  for s in self.mine]

        # per-microbatch mean loss; torch divides the summed gradients by m (scale_grads),
        # which is pipeflow's sum(CE) / global tokens (see tests/test_torch_pipelining.py)
        vocab = int(cfg["model"]["vocab_size"])  # (the words of a padded head: model.vocab_multiple)

        def loss_fn(logits, targets):
            return lm_loss(logits, targets, tokens_per_microbatch, vocab)

        cls = getattr(pipelining, pair.torch_schedule)
        self.stages = stages
        self.executed: list[str] | None = None  # this rank's compute actions in torch's first step
        self.schedule = cls(stages if pair.multi else stages[0], n_microbatches=self.m, loss_fn=loss_fn,
                            scale_grads=True)
        if pair.multi:  # torch's own stage -> rank map must be pipeflow's placement
            mapping = self.schedule.stage_index_to_group_rank
            if [mapping[s] for s in range(num_stages)] != list(placement):
                raise RuntimeError(f"{pair.torch_schedule} places stages {mapping}, pipeflow {placement}")
        # pipeflow: one optimizer per stage, stepped one after the other
        self.optimizers = [make_optimizer(modules[s], cfg["optim"]) for s in self.mine]
        self.params = [p for s in self.mine for p in modules[s].parameters() if p.requires_grad]
        # the tied embedding: wte on stage 0, lm_head on the last stage (runtime.stage.sync_tied
        # sums all copies over the ranks holding the first and the last stage)
        self.tied = [p for s in self.mine for p in modules[s].tied_parameters()]
        tied_ranks = sorted({placement[0], placement[num_stages - 1]})
        self.tied_reduce = len(tied_ranks) > 1 and rank in tied_ranks
        self.tied_group = None if tied_ranks == list(range(world)) else dist.new_group(tied_ranks)
        # the norm counts each parameter once: the tied embedding on the first stage only
        self.counted = [p for s in self.mine for p in modules[s].parameters()
                        if p.requires_grad and (s == 0 or all(p is not t for t in modules[s].tied_parameters()))]
        self.clip = cfg["optim"].grad_clip

    def _traced_step(self, *args, **kwargs) -> list[str]:
        """Run one ``schedule.step`` recording the compute actions this rank's stages run
        (F, B, I, W: stage, kind, microbatch), as torch's schedule calls them."""
        import inspect

        done: list[str] = []
        originals = [(st, name) for st in self.stages
                     for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")]

        def wrap(st, name):
            method = getattr(st, name)
            sig = inspect.signature(method)

            def traced(*a, **kw):
                bound = sig.bind(*a, **kw)
                bound.apply_defaults()
                if name == "forward_one_chunk":
                    kind, mb = "F", bound.arguments["fwd_chunk_id"]
                elif name == "backward_one_chunk":
                    kind, mb = "B" if bound.arguments["full_backward"] else "I", bound.arguments["bwd_chunk_id"]
                else:
                    kind, mb = "W", bound.arguments["bwd_chunk_id"]
                done.append(f"{st.stage_index}{kind}{mb}")
                return method(*a, **kw)

            return traced

        for st, name in originals:
            setattr(st, name, wrap(st, name))
        try:
            self.schedule.step(*args, **kwargs)
        finally:
            for st, name in originals:
                delattr(st, name)  # the class's method again
        return done

    def step(self, batch, lr: float) -> float:
        import torch.distributed as dist

        inputs, targets = batch
        mb_losses: list = []
        args = (inputs,) if self.first else ()
        kwargs = dict(target=targets, losses=mb_losses, return_outputs=False) if self.last else {}
        if self.executed is None:  # the first (warm-up) step: record what torch runs
            self.executed = self._traced_step(*args, **kwargs)
        else:
            self.schedule.step(*args, **kwargs)
        # the rest of pipeflow's iteration: every copy of the tied embedding gets the sum of
        # all copies' gradients ...
        if self.tied:
            sync_tied(self.tied, (self.tied_group or dist.group.WORLD) if self.tied_reduce else None)
        # ... one all-reduce for the global gradient norm and the loss, clip, update
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.counted:
            sq += square_sum(p.grad)
        loss = sum(float(x.detach()) for x in mb_losses) / self.m if self.last else 0.0
        vec = torch.stack([sq, torch.tensor(loss, dtype=torch.float64)])
        dist.all_reduce(vec)
        norm = vec[0].item() ** 0.5
        if self.clip:
            coef = self.clip / (norm + 1e-6)
            if coef < 1.0:
                for p in self.params:
                    p.grad.mul_(coef)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return vec[1].item()


class PipeflowTrainer:
    """pipeflow's Executor and schedule, built by the runtime's own rank set-up."""

    def __init__(self, rank: int, world: int, cfg: dict, layers: list[int], plan):
        from pipeflow.runtime.rank import build_rank

        setup = build_rank(plan, rank, torch.device("cpu"))
        assert setup.layers_per_stage == layers  # the split torch's stages use too
        self.rank = rank
        self.executor = setup.executor
        self.schedule = setup.schedule
        self.placement = list(setup.schedule.placement.as_lists()[0])  # stage -> rank
        # as the worker: microbatch losses are token sums over the global token count
        self.normalizer = float(setup.schedule.num_microbatches * setup.adapter.mbs * setup.adapter.seq_len)

    def compute_order(self) -> list[str]:
        """This rank's compute actions (F, B, I, W), in the order its executor runs them."""
        return [str(a) for a in self.schedule.compute_orders()[self.rank]]

    def step(self, batch, lr: float) -> float:
        return self.executor.train_step(batch, self.normalizer, lr).loss


def _rank(rank: int, world: int, port: int, cfg: dict, layers: list[int], schedule: str, batches: list,
          out: str, plan) -> None:
    import torch.distributed as dist

    from pipeflow.runtime.optimizer import lr_at

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(int(cfg["runtime"]["threads_per_rank"] or 1))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    ours = PipeflowTrainer(rank, world, cfg, layers, plan)
    theirs = TorchTrainer(rank, world, cfg, layers, schedule, ours.placement)
    trainers = {"pipeflow": ours, "torch": theirs}
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
    # each rank's compute order in both runtimes (torch's as run in its first step)
    orders = [None] * world if rank == 0 else None
    dist.gather_object({"pipeflow": ours.compute_order(), "torch": theirs.executed}, orders, dst=0)
    if rank == 0:
        order = {k: [o[k] for o in orders] for k in ("pipeflow", "torch")}
        Path(out).write_text(json.dumps({"step_time": times, "loss": losses, "placement": ours.placement,
                                         "order": order}))
    dist.barrier()
    dist.destroy_process_group()


def run_both(cfg: dict, layers: list[int], batches: list, out: Path, schedule: str, plan) -> dict:
    # forked from the launcher's server (torch and the model already imported)
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, WORLD, port, cfg, layers, schedule, batches, str(out), plan))
             for r in range(WORLD)]
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
    if [p.exitcode for p in procs] != [0] * WORLD:
        raise RuntimeError(f"the benchmark's ranks ({schedule}) ended with {[p.exitcode for p in procs]}; "
                           "see their tracebacks")
    return json.loads(out.read_text())


def _ratios(run: dict, warmup: int = WARMUP) -> list[float]:
    """pipeflow's step over torch's adjacent step, for each steady step of one run."""
    return [a / b for a, b in zip(run["step_time"]["pipeflow"][warmup:], run["step_time"]["torch"][warmup:])]


def _run_ratio(run: dict, warmup: int = WARMUP) -> float:
    """pipeflow / torch of one run's median steady step times."""
    steady = {k: run["step_time"][k][warmup:] for k in ("pipeflow", "torch")}
    return statistics.median(steady["pipeflow"]) / statistics.median(steady["torch"])


def measure(schedule: str, repeats: int = 3, steps: int = 15, warmup: int = WARMUP) -> dict:
    """One schedule: ``repeats`` fresh pairs of ranks, ``steps`` alternating steps each.

    Returns ``schedule``, ``torch_schedule``, ``runs`` (each run's per-trainer
    ``step_time`` and ``loss`` lists, the placement and both compute orders), ``median``
    (trainer -> median steady step time, s), ``ratio`` (pipeflow / torch of those
    medians), ``pair_ratio`` (median of the adjacent-step ratios), ``steady_steps`` (per
    trainer), ``loss_max_rel_diff`` (the largest relative loss difference, step by step),
    ``loss_steps``, ``placement`` (stage -> rank), ``layers_per_stage`` and
    ``same_order`` (torch's compute order per rank is pipeflow's).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    if steps <= warmup:
        raise ValueError(f"steps must exceed the {warmup} warm-up steps")
    dcfg = compose("train", overrides(steps, schedule))
    inputs = prepare_training(dcfg)
    cfg = OmegaConf.to_container(inputs.config, resolve=True)
    cfg["optim"] = inputs.plan.optim  # (the typed settings pipeflow's ranks read: lr_at, make_optimizer)
    from pipeflow.data.text import build_text_data
    from pipeflow.planning.partitioners import partition_layers

    num_stages = WORLD * SCHEDULES[schedule].virtual_stages
    layers = list(partition_layers(cfg["partition"]["name"], inputs.spec, num_stages))
    batch_size = cfg["pipeline"]["microbatches"] * cfg["pipeline"]["microbatch_size"]
    data = build_text_data(cfg["data"], inputs.spec.seq_len, int(cfg["seed"]))
    batches = [data.train_batch(step, batch_size) for step in range(1, steps + 1)]  # pipeflow's steps 1..N

    runs = []
    with tempfile.TemporaryDirectory(prefix="pipeflow-bench-") as tmp:
        for r in range(repeats):
            runs.append(run_both(cfg, layers, batches, Path(tmp) / f"run-{r}.json", schedule, inputs.plan))

    names = ("pipeflow", "torch")
    steady = {k: [t for run in runs for t in run["step_time"][k][warmup:]] for k in names}
    med = {k: statistics.median(v) for k, v in steady.items()}
    # the same training: the losses agree step by step (fp32 round-off apart)
    diffs = [abs(a - b) / abs(b) for run in runs for a, b in zip(run["loss"]["pipeflow"], run["loss"]["torch"])]
    return {"schedule": schedule, "torch_schedule": SCHEDULES[schedule].torch_schedule, "runs": runs,
            "median": med, "ratio": med["pipeflow"] / med["torch"],
            "pair_ratio": statistics.median(x for run in runs for x in _ratios(run, warmup)),
            "steady_steps": len(steady["pipeflow"]), "loss_max_rel_diff": max(diffs), "loss_steps": len(diffs),
            "placement": runs[0]["placement"], "layers_per_stage": layers,
            "same_order": all(run["order"]["pipeflow"] == run["order"]["torch"] for run in runs),
            "warmup": warmup}


def results(repeats: int = 3, steps: int = 15, schedules=None, warmup: int = WARMUP) -> dict:
    """Every schedule of ``schedules`` (default: all of SCHEDULES), measured by :func:`measure`.

    Returns ``schedules`` (name -> :func:`measure`'s result) and, when 1F1B is among
    them, 1F1B's own keys at the top level too (``runs``, ``median``, ``ratio``,
    ``pair_ratio``, ``steady_steps``, ``loss_max_rel_diff``, ``loss_steps``), as this
    function returned them when it measured 1F1B alone (benchmarks/reproduce.py reads them).
    """
    names = list(SCHEDULES) if schedules is None else list(schedules)
    per = {name: measure(name, repeats, steps, warmup) for name in names}
    out: dict = {"schedules": per}
    if "1f1b" in per:
        out.update({k: v for k, v in per["1f1b"].items() if k not in ("schedule", "torch_schedule")})
    return out


def _schedule_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {unknown}; choose from {', '.join(SCHEDULES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", type=_schedule_list, default=list(SCHEDULES),
                    help=f"comma-separated, from {','.join(SCHEDULES)} (default all)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per schedule, each a fresh pair of ranks (default 3)")
    ap.add_argument("--steps", type=int, default=15, help=f"steps per run; the first {WARMUP} are warm-up (default 15)")
    ap.add_argument("--json", type=Path, default=None, help="also write the structured results here")
    args = ap.parse_args(argv)
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps")

    res = results(args.repeats, args.steps, args.schedules)
    print(f"gpt_tiny (4 layers, n_embd 128, seq 128), m={MICROBATCHES}, mbs={MICROBATCH_SIZE}; 2 stages x 2 layers "
          f"(interleaved: 4 chunks x 1 layer, 2 per rank); {WORLD} CPU ranks (gloo, 1 thread each); "
          f"{args.repeats} runs x {args.steps} steps per schedule, the trainers alternating step by step, first "
          f"{WARMUP} steps of each run dropped; step time includes the optimizer step")
    head = (f"{'schedule':<17} {'torch schedule':<30} {'pipeflow med':>13} {'torch med':>10} {'ratio':>7} "
            f"{'adjacent ratio med':>19} {'loss max rel diff':>18} {'same order':>10}  per-run ratios")
    print(head)
    print("-" * len(head))
    for name, r in res["schedules"].items():
        med = r["median"]
        per_run = " ".join(f"{_run_ratio(run, r['warmup']):.3f}" for run in r["runs"])
        print(f"{name:<17} {r['torch_schedule']:<30} {med['pipeflow'] * 1e3:>11.1f}ms {med['torch'] * 1e3:>8.1f}ms "
              f"{r['ratio']:>7.3f} {r['pair_ratio']:>19.3f} {r['loss_max_rel_diff']:>18.2e} "
              f"{'yes' if r['same_order'] else 'NO':>10}  {per_run}")
    steady = {r["steady_steps"] for r in res["schedules"].values()}
    print(f"ratio = pipeflow/torch of the median step times ({'/'.join(map(str, sorted(steady)))} steady steps "
          f"each; target <= {TARGET}); adjacent ratio = median over steps of pipeflow's step / torch's adjacent step; "
          f"loss max rel diff over every step of every run; same order: torch's F/B/I/W order per rank is pipeflow's")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res["schedules"], indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
