"""One rank of a training job: build what this device holds, then run the schedule.

Each rank builds only its own stages (the placement says which), loads the data (every
rank can compute any step's batch from the seed, so nothing is broadcast), and runs
``trainer.steps`` iterations of the schedule. Rank 0 records the metrics.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..planning.partition import partition_layers
from ..planning.transformer import TransformerSpec
from ..schedules.ir import Schedule
from ..schedules.registry import build_schedule
from ..sim.timeline import Timeline
from . import checkpoint
from .adapters import CBMAdapter, make_adapter
from .executor import Executor, Groups, StageState
from .launch import TrainJob


def lr_at(step: int, optim: dict, steps: int) -> float:
    """Linear warm-up to optim.lr over warmup_steps, then cosine decay to lr*min_lr_ratio at the last step."""
    lr, warmup = float(optim["lr"]), int(optim["warmup_steps"])
    if warmup and step <= warmup:
        return lr * step / warmup
    low = lr * float(optim["min_lr_ratio"])
    progress = (step - warmup) / max(1, steps - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (lr - low)


def make_optimizer(module: torch.nn.Module, optim: dict) -> torch.optim.Optimizer:
    # weight decay on matrices only (GPT-2 / nanoGPT practice): not on biases or norms
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(optim["weight_decay"])}, {"params": rest, "weight_decay": 0.0}],
        lr=float(optim["lr"]),
        betas=(float(optim["beta1"]), float(optim["beta2"])),
        eps=float(optim["eps"]),
    )


def _device_and_backend(runtime: dict, rank: int) -> tuple[torch.device, str]:
    backend = runtime.get("backend", "auto")
    cuda = torch.cuda.is_available() and runtime.get("device", "auto") in ("auto", "cuda")
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
        return torch.device("cuda", local), backend
    return torch.device("cpu"), backend


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def run_worker(rank: int, job: TrainJob) -> dict | None:
    cfg = job.cfg
    runtime = cfg["runtime"]
    torch.set_num_threads(int(runtime.get("threads_per_rank") or 1))
    device, backend = _device_and_backend(runtime, rank)
    dist.init_process_group(
        backend, rank=rank, world_size=job.world_size, timeout=timedelta(seconds=float(runtime.get("timeout_s", 60)))
    )
    # Under torchrun every process composed its own config, and a run dir named after the
    # clock may differ by a second between them: everyone writes where rank 0 writes.
    where = [job.run_dir]
    dist.broadcast_object_list(where, src=0)
    job = TrainJob(job.cfg, where[0], job.world_size)
    # No teardown on failure: closing this rank's connections first would make its peers
    # fail and report before it does. The launcher stops every rank anyway.
    result = _train(rank, job, device)
    dist.destroy_process_group()
    return result


@dataclass
class RankSetup:
    """What one rank holds: its stages (modules and optimizers) and the executor that runs them."""

    schedule: Schedule
    layers_per_stage: list[int]
    adapter: object  # GPTAdapter, BertAdapter or CBMAdapter: see pipeflow.runtime.adapters
    stages: dict[tuple[int, int], StageState]
    executor: Executor


def build_rank(cfg: dict, rank: int, device: torch.device, on_grads=None) -> RankSetup:
    """Build this rank's share of the job. Needs the process group (it creates groups)."""
    pipe_cfg, optim = cfg["pipeline"], cfg["optim"]
    mbs, seed = int(pipe_cfg["microbatch_size"]), int(cfg["seed"])
    sizes = (cfg["schedule"]["name"], pipe_cfg["stages"], pipe_cfg["microbatches"], pipe_cfg["virtual_stages"],
             pipe_cfg["segments"])
    if cfg["model"].get("family") == "cbm":
        # a branched model: its stage DAG, grouped onto the schedule's chain of devices
        adapter = CBMAdapter(cfg["model"], mbs, seed, device, num_devices=pipe_cfg["stages"])
        schedule = build_schedule(*sizes, graph=adapter.graph)
        layers = [spec.hi - spec.lo for spec in adapter.specs]
    else:
        schedule = build_schedule(*sizes)
        spec = TransformerSpec.from_config(cfg["model"])
        layers = partition_layers(cfg["partition"]["name"], spec, schedule.num_stages, cfg["partition"])
        adapter = make_adapter(cfg["model"], layers, mbs, spec.seq_len, seed, device)
    stages: dict[tuple[int, int], StageState] = {}
    for pipe, stage in schedule.placement.stages_on(rank):
        module = adapter.build_stage(stage)
        graph = schedule.graph  # sources read the batch, sinks compute the loss
        st = StageState(pipe, stage, module, first=not graph.preds[stage], last=not graph.succs[stage])
        st.params = [p for p in module.parameters() if p.requires_grad]
        st.tied = module.tied_parameters() if hasattr(module, "tied_parameters") else []
        st.optimizer = make_optimizer(module, optim)
        stages[(pipe, stage)] = st
    groups = Groups(schedule, adapter.tied_stages)
    executor = Executor(schedule, rank, stages, adapter, groups, grad_clip=optim.get("grad_clip"), on_grads=on_grads)
    return RankSetup(schedule, layers, adapter, stages, executor)


def _train(rank: int, job: TrainJob, device: torch.device) -> dict | None:
    cfg = job.cfg
    pipe_cfg, trainer, optim, runtime = cfg["pipeline"], cfg["trainer"], cfg["optim"], cfg["runtime"]
    seed = int(cfg["seed"])
    dump_dir = Path(job.run_dir) / "grads"
    dumped = []

    def dump_grads(states) -> None:
        if dumped:
            return
        dumped.append(True)
        dump_dir.mkdir(parents=True, exist_ok=True)
        grads = {
            f"{pipe}:{name}": p.grad.detach().clone()
            for (pipe, _stage), st in states.items()
            for name, p in st.module.named_parameters()
            if p.grad is not None
        }
        torch.save(grads, dump_dir / f"rank{rank}.pt")

    setup = build_rank(cfg, rank, device, on_grads=dump_grads if runtime.get("dump_grads") else None)
    schedule, layers, stages, executor = setup.schedule, setup.layers_per_stage, setup.stages, setup.executor
    seq_len = setup.adapter.seq_len
    mbs = setup.adapter.mbs
    m = schedule.num_microbatches

    # the data set is built (and cached) by rank 0 first so ranks do not race on the cache
    if rank != 0:
        dist.barrier()
    data = setup.adapter.build_data(cfg["data"])
    if rank == 0:
        dist.barrier()

    meta = {
        "schedule": schedule.name,
        "stages": pipe_cfg["stages"],
        "world_size": job.world_size,
        "layers_per_stage": layers,
        "placement": schedule.placement.as_lists(),
    }
    start_step = 0
    if cfg.get("resume"):
        start_step = checkpoint.load(cfg["resume"], rank, stages, meta)

    sink = progress = None
    if rank == 0:
        from ..tracking.progress import Progress
        from ..tracking.sink import MetricsSink

        sink = MetricsSink(job.run_dir, cfg, cfg["logger"], resume_step=start_step)
        progress = Progress(int(trainer["steps"]), initial=start_step)

    hosts = [None] * job.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    one_host = len(set(hosts)) == 1
    steps = int(trainer["steps"])
    batch_size = m * mbs
    tokens = batch_size * seq_len
    history: list[dict] = []
    val_losses: list[float] = []
    t_start = time.perf_counter()
    for step in range(start_step + 1, steps + 1):
        if runtime.get("fail_at_step") == step and (runtime.get("fail_rank") or 0) == rank:
            if runtime.get("fail_mode", "raise") == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {rank} at step {step} (runtime.fail_at_step)")
        torch.manual_seed(seed * 1_000_003 + step)  # dropout (if any) is a function of the step
        batch = data.train_batch(step, batch_size)
        normalizer = setup.adapter.normalizer(batch)  # microbatch losses add up to the batch mean
        lr = lr_at(step, optim, steps)
        record = step == trainer.get("timeline_step")
        dist.barrier()
        t0 = time.perf_counter()
        if record and one_host:
            # ranks on one host read the same monotonic clock: share rank 0's origin so
            # events compare across ranks exactly (a barrier alone leaves tens of us of skew)
            origin = torch.tensor([t0], dtype=torch.float64)
            dist.broadcast(origin, src=0)
            t0 = origin.item()
        stats = executor.train_step(batch, normalizer, lr, record=record, t0=t0)
        step_time = time.perf_counter() - t0
        busy = torch.tensor([stats.busy], dtype=torch.float64)
        dist.all_reduce(busy)
        metrics = {
            "loss": stats.loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "step_time": step_time,
            "tokens_per_s": tokens / step_time,
            "samples": step * batch_size,
            "bubble": max(0.0, 1.0 - busy.item() / (job.world_size * step_time)),
        }
        val_every = int(trainer.get("val_every") or 0)
        if (val_every and step % val_every == 0) or step == steps:
            vl = [executor.eval_loss(b, setup.adapter.normalizer(b))
                  for b in data.val_batches(batch_size, int(trainer["val_batches"]))]
            if vl:
                metrics["val_loss"] = sum(vl) / len(vl)
                val_losses.append(metrics["val_loss"])
        if record:
            gathered = [None] * job.world_size if rank == 0 else None
            dist.gather_object(stats.events, gathered, dst=0)
            if rank == 0:
                events = [e for evs in gathered for e in evs]
                timeline = Timeline(
                    events, job.world_size, time_unit="s", source="measured",
                    meta={"schedule": schedule.name, "step": step, "num_stages": schedule.num_stages,
                          "num_microbatches": m},
                )
                sink.log_timeline(timeline, step)
        save_every = int(trainer.get("save_every") or 0)
        if (save_every and step % save_every == 0) or step == steps:  # always a final checkpoint
            checkpoint.save(job.run_dir, step, rank, stages, meta)
        if rank == 0:
            history.append(metrics)
            if step % int(trainer.get("log_every") or 1) == 0 or "val_loss" in metrics:
                sink.log(step, metrics)
            progress.update(step, stats.loss, metrics["tokens_per_s"])

    peaks = [None] * job.world_size if rank == 0 else None
    dist.gather_object(_peak_memory(device), peaks, dst=0)
    if rank != 0:
        return None
    progress.close()
    steady = history[len(history) // 2 :] or history  # skip the warm-up half for rates
    summary = {
        "schedule": schedule.name,
        "stages": pipe_cfg["stages"],
        "microbatches": m,
        "microbatch_size": mbs,
        "world_size": job.world_size,
        "layers_per_stage": layers,
        "steps": steps,
        "resumed_from": start_step or None,
        "final_loss": history[-1]["loss"] if history else None,
        "best_loss": min(h["loss"] for h in history) if history else None,
        "final_val_loss": val_losses[-1] if val_losses else None,
        "best_val_loss": min(val_losses) if val_losses else None,
        "mean_tokens_per_s": sum(h["tokens_per_s"] for h in steady) / len(steady) if steady else None,
        "mean_step_time": sum(h["step_time"] for h in steady) / len(steady) if steady else None,
        "measured_bubble_ratio": sum(h["bubble"] for h in steady) / len(steady) if steady else None,
        "peak_memory_bytes": peaks,
        "wall_time": time.perf_counter() - t_start,
    }
    sink.finish(summary)
    return summary
