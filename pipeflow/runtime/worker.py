"""One rank of a training job: build this device's share of the run plan (:mod:`.rank`), then run
``trainer.steps`` iterations of the schedule in chunks (resume and replay included); rank 0 records the
metrics and the summary."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .. import device_paths
from ..formats.checkpoint_folder import restart_step
from ..formats.files import write_aside
from ..formats.timeline import Timeline
from ..schedules.data_parallel import pipeline_shape
from ..schedules.versions import summarize, weight_versions
from . import checkpoint
from . import watch
from .device import device_and_backend, join_group, keep_freed_memory, new_group, peak_memory
from .launch import TrainJob, check_stop, deferred_stop, stop_behind
from .memory_profile import profile_step
from .op_trace import OpTrace, traced
from .optimizer import lr_at
from ..models.tensor_parallel import whole_gradient
from .sharded import whole_weights
from .async_executor import ChunkStats
from .rank import RankSetup, build_rank


@dataclass
class RunState:
    """Rank 0's account of the run so far (the other ranks keep it too, unread)."""

    step: int  # the last step done
    train_time: float  # seconds in training steps (validation and checkpoints left out)
    history: list = field(default_factory=list)  # the metrics of every step
    val_losses: list = field(default_factory=list)
    staleness: list = field(default_factory=list)  # asynchronous: every microbatch's weight versions
    replay_to: int = 0  # resumed inside a chunk: the steps up to here are run again, unlogged
    memory: dict | None = None  # runtime.memory=profile: the last chunk's allocations (StepMemory.as_dict)
    trace: OpTrace | None = None  # runtime.trace_steps: the last steps' operators, by class (runtime.op_trace)


def run_worker(rank: int, job: TrainJob) -> dict | None:
    """One rank: join the group, build its share of the plan, train to the last step; rank 0's summary."""
    plan = job.plan
    runtime = plan.runtime
    keep_freed_memory()
    device_paths.emulate(runtime.cuda_paths)  # CUDA's code paths on CPU, where a test asks
    torch.set_num_threads(int(runtime.threads_per_rank or 1))
    device, backend = device_and_backend(runtime, rank)
    join_group(backend, rank, job.world_size, runtime.timeout_s)
    # Under torchrun every process composed its own config, and a run dir named after the
    # clock may differ by a second between them: everyone writes where rank 0 writes.
    where = [job.run_dir]
    dist.broadcast_object_list(where, src=0)
    job.run_dir = where[0]  # the caller's job too: under torchrun a failure is recorded there
    # No teardown on failure: closing this rank's connections first would make its peers
    # fail and report before it does. The launcher stops every rank anyway.
    setup, data, meta, start_step = _set_up(rank, job, device)
    sink = progress = None
    if rank == 0:
        sink, progress = _rank0_records(job, start_step)
    # a resumed run goes on from the training time its metrics recorded at the checkpoint
    state = RunState(meta.pop("restart"), _train_time_at(job.run_dir, start_step) if rank == 0 and start_step else 0.0,
                     replay_to=start_step)
    try:
        hosts = [None] * job.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        t_start, one_host = time.perf_counter(), len(set(hosts)) == 1
        # runtime.fail_mode=collective: a group that the failing rank alone will use (made by all)
        hook = new_group(list(range(dist.get_world_size()))) if runtime.fail_mode == "collective" else None
        watch.arm()  # training begins: the watchdog looks at a rank that sits in one call
        _keep_chunk_start(rank, job, setup, state, meta)
        while state.step < plan.trainer.steps:
            _train_chunk(rank, job, setup, data, sink, progress, state, one_host, meta, hook)
        result = _finish(rank, job, device, setup, progress, sink, state, t_start)
    except BaseException as err:
        if sink is not None:
            _close_unfinished(sink, progress, job, setup, state, start_step, stop_behind(err))
        raise
    dist.destroy_process_group()
    return result


def _set_up(rank: int, job: TrainJob, device: torch.device) -> tuple:
    """(setup, data, meta with ``restart``, the checkpoint's step or 0) of this rank."""
    plan = job.plan
    dump_dir = Path(job.run_dir) / "grads"
    dumped = []

    def dump_grads(states) -> None:
        if dumped:
            return
        dumped.append(True)
        dump_dir.mkdir(parents=True, exist_ok=True)
        tensor = setup.adapter.tensor  # tensor parallelism: each gradient put back together, written once
        grads = {
            f"{pipe}:{name}": (p.grad.detach() if tensor is None else whole_gradient(p, p.grad.detach(), tensor)).clone()
            for (pipe, _stage), st in states.items()
            for name, p in st.module.named_parameters()
            if p.grad is not None
        }
        if tensor is None or tensor.rank == 0:
            torch.save(grads, dump_dir / f"rank{rank}.pt")

    setup = build_rank(plan, rank, device, on_grads=dump_grads if plan.runtime.dump_grads else None)
    schedule, stages = setup.schedule, setup.stages

    # the data set is built (and cached) by rank 0 first so ranks do not race on the cache
    if rank != 0:
        dist.barrier()
    data = setup.adapter.build_data(plan.data)
    if rank == 0:
        dist.barrier()

    meta = {
        "schedule": schedule.name,
        "stages": plan.stages,
        "world_size": job.world_size,
        "layers_per_stage": setup.layers_per_stage,
        "placement": schedule.placement.as_lists(),
        "shard": schedule.shard,
        "tensor_parallel": plan.tensor_parallel,  # (the layout: a checkpoint moves to another one)
        **plan.checkpoint_records,  # model: another is refused up front; training: what changed is said
    }
    start_step = restart = 0
    if plan.resume:
        _, record = checkpoint.verify(plan.resume, {})
        start_step, restart = int(record["step"]), restart_step(record, plan.trainer.steps)
        if restart < start_step:
            # it ended inside a chunk: restart that chunk (from the initial weights when it
            # was the first) and replay up to the checkpoint, as the longer run computed it
            if restart > 0:
                checkpoint.load(plan.resume, rank, stages, meta, step=restart, scaler=setup.executor.scaler)
        else:
            checkpoint.load(plan.resume, rank, stages, meta, scaler=setup.executor.scaler)
    return setup, data, {**meta, "restart": restart}, start_step


def _rank0_records(job: TrainJob, start_step: int) -> tuple:
    """Rank 0's (metrics sink, progress line); writes config.json beside the metrics."""
    from ..tracking.progress import Progress
    from ..tracking.sink import MetricsSink

    plan = job.plan
    sink = MetricsSink(job.run_dir, plan.record, dataclasses.asdict(plan.logger), resume_step=start_step)
    progress = Progress(plan.trainer.steps, initial=start_step, log=Path(job.run_dir) / "train.log")
    write_aside(Path(job.run_dir) / "config.json", json.dumps(plan.record, indent=2, default=str) + "\n")
    return sink, progress


def _close_unfinished(sink, progress, job: TrainJob, setup: RankSetup, state: RunState, start_step: int,
                      reason: str | None) -> None:
    """Rank 0, when training ends early: asked to stop, an interrupted summary.json and a finished W&B run;
    failed, the W&B run closed as failed."""
    from .launch import PEER_FAILED_REASON

    progress.close()
    if reason is None or reason == PEER_FAILED_REASON:
        sink.close(exit_code=1)
        return
    history, plan = state.history, job.plan
    sink.finish({
        "kind": "measured",
        "status": "interrupted",
        "stopped_by": reason,
        "schedule": setup.schedule.name,
        "stages": plan.stages,
        "microbatches": plan.microbatches,
        "steps": plan.trainer.steps,
        "last_step": state.step,
        "train_time": state.train_time,
        "resumed_from": start_step or None,
        "final_loss": history[-1]["loss"] if history else None,
        "final_val_loss": state.val_losses[-1] if state.val_losses else None,
        "run_key": plan.run_key,
    }, exit_code=1)


def _finish(rank, job, device, setup: RankSetup, progress, sink, state: RunState, t_start: float) -> dict | None:
    """Every rank's peaks gathered; rank 0's summary."""
    plan, stages, schedule = job.plan, setup.stages, setup.schedule
    steps, mbs = plan.trainer.steps, setup.adapter.mbs
    batch_size = setup.schedule.microbatches_per_step * mbs  # data_parallel x microbatches per replica
    start_step = state.replay_to
    peaks = [None] * job.world_size if rank == 0 else None
    dist.gather_object(peak_memory(device), peaks, dst=0)
    meters = [setup.executor.meter, *[e.meter for e in (setup.chunk_executors or {}).values()]]
    saved_peaks = [None] * job.world_size if rank == 0 else None
    dist.gather_object((max(mt.peak for mt in meters), max(mt.kv_peak for mt in meters),
                        max(mt.residual_peak for mt in meters)), saved_peaks, dst=0)
    profiled = [None] * job.world_size if rank == 0 else None
    dist.gather_object(state.memory, profiled, dst=0)
    traces = [None] * job.world_size if rank == 0 else None
    dist.gather_object(state.trace.as_dict() if state.trace is not None else None, traces, dst=0)
    if rank == 0 and any(traces):  # runtime.trace_steps: python -m pipeflow.fold_trace reads it
        write_aside(Path(job.run_dir) / "op_trace.json",
                    json.dumps({"format": "pipeflow.op_trace/1", "ranks": traces}, indent=1) + "\n")
    versions = [None] * job.world_size if rank == 0 else None
    dist.gather_object(max((getattr(st, "versions", None).peak_versions if getattr(st, "versions", None) else 1)
                           for st in stages.values()), versions, dst=0)
    if rank != 0:
        return None
    progress.close()
    history, val_losses = state.history, state.val_losses
    steady = history[len(history) // 2 :] or history  # skip the warm-up half for rates
    summary = {
        "kind": "measured",
        "status": "finished",
        "schedule": schedule.name,
        **pipeline_shape(schedule, plan.stages),  # stages; data_parallel replicas (a plan's own)
        "shard": schedule.shard,  # what the replicas of a stage shard (pipeline.shard)
        "gather": schedule.gather,  # full: when a stage's parameters are gathered (else null)
        "tensor_parallel": plan.tensor_parallel,  # ranks splitting each device's stages
        "sequence_parallel": plan.sequence_parallel,
        # per step, as configured (an asynchronous schedule's IR spans schedule.windows steps)
        "microbatches": plan.microbatches,
        "microbatch_size": mbs,
        "world_size": job.world_size,
        "layers_per_stage": setup.layers_per_stage,
        "segment_lengths": getattr(setup.adapter, "segment_lengths", None),
        "steps": steps,
        "last_step": steps,
        "samples": steps * batch_size,
        "train_time": state.train_time,
        "resumed_from": start_step or None,
        "final_loss": history[-1]["loss"] if history else None,
        "best_loss": min(h["loss"] for h in history) if history else None,
        "final_val_loss": val_losses[-1] if val_losses else None,
        "best_val_loss": min(val_losses) if val_losses else None,
        "mean_tokens_per_s": sum(h["tokens_per_s"] for h in steady) / len(steady) if steady else None,
        "mean_step_time": sum(h["step_time"] for h in steady) / len(steady) if steady else None,
        "measured_bubble_ratio": sum(h["bubble"] for h in steady) / len(steady) if steady else None,
        "precision": plan.precision,
        "attention": plan.attention,
        "recompute": plan.recompute,
        # bytes sent between ranks per step (activations and their gradients, all ranks)
        "p2p_bytes": sum(h["p2p_bytes"] for h in history) / len(history) if history else None,
        **({"skipped_steps": sum(h["skipped"] for h in history), "loss_scale": history[-1]["loss_scale"]}
           if history and "loss_scale" in history[-1] else {}),
        "peak_memory_bytes": peaks,
        # per rank: bytes kept for backward at the peak (Seq1F1B's K/V included), the K/V's own
        "peak_saved_bytes": [p[0] for p in saved_peaks],
        "peak_kv_bytes": [p[1] for p in saved_peaks],
        "peak_residual_bytes": [p[2] for p in saved_peaks],  # I-to-W residuals the zero-bubble split holds
        # runtime.memory=profile: per rank, every allocation of the last step by category
        **({"memory_profile": profiled} if any(profiled) else {}),
        "weight_policy": schedule.policy.value,
        "peak_weight_versions": versions,  # per rank: the most versions one replica held at once
        "updates": steps,  # synchronous: one per step; an asynchronous run's count replaces it
        **_staleness_summary(job.run_dir, state.staleness, setup),
        "wall_time": time.perf_counter() - t_start,
        "run_key": plan.run_key,
    }
    summary.update(_verdict(history, summary))
    sink.finish(summary)
    return summary


def _verdict(history: list[dict], summary: dict) -> dict:
    """The status of a finished run whose loss went non-finite (``diverged``, from which step) or whose
    every update was skipped (``no_updates``); else {}."""
    finite = [math.isfinite(float(h["loss"])) for h in history]
    if finite and not finite[-1]:  # non-finite to the end (an fp16 step that overflowed and recovered is not)
        bad = len(finite) - next(i for i, ok in enumerate(reversed(finite)) if ok) if any(finite) else 0
        return {"status": "diverged", "diverged_at": int(summary["last_step"]) - len(history) + 1 + bad}
    if history and summary.get("skipped_steps", 0) >= len(history):
        return {"status": "no_updates"}
    return {}


def _busy_and_saved(busy: float, ex, world_size: int) -> tuple[float, dict, float]:
    """(busy seconds summed, saved MiB by rank at this chunk's peak, bytes sent summed): a collective."""
    device = ex.adapter.device  # NCCL gathers CUDA tensors
    mine = torch.tensor([busy, float(ex.meter.step_peak), float(ex.sent_bytes)], dtype=torch.float64, device=device)
    every = [torch.zeros(3, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(every, mine)
    saved = {f"saved_mib/rank{r}": t[1].item() / 2**20 for r, t in enumerate(every)}
    return sum(t[0].item() for t in every), saved, sum(t[2].item() for t in every)


def _start_clock(shared: bool, device: torch.device) -> float:
    """Line the ranks up and start the step's clock; ``shared`` (one host): rank 0's origin is broadcast so
    recorded events compare exactly."""
    dist.barrier()
    t0 = time.perf_counter()
    if shared:
        origin = torch.tensor([t0], dtype=torch.float64, device=device)
        dist.broadcast(origin, src=0)
        t0 = origin.item()
    return t0


def _staleness_summary(run_dir: str, records: list[dict], setup: RankSetup) -> dict:
    """The run's staleness summary; asynchronous, staleness.json written too."""
    if not setup.is_async:
        # a synchronous iteration runs the same versions every step: the schedule's own
        # accounting of one iteration is the run's (all zero unless the schedule is wrong)
        out = summarize(weight_versions(setup.schedule))
        return {k: out[k] for k in ("max_staleness", "mean_staleness", "max_mismatch", "mean_mismatch")}
    write_aside(Path(run_dir) / "staleness.json", json.dumps(records) + "\n")
    out = summarize(records)
    out["updates"] = len({r["update"] for r in records})
    return out


def _train_time_at(run_dir: str, step: int) -> float:
    """The ``train_time`` a run's metrics.jsonl recorded at ``step`` (0.0 if none)."""
    from ..tracking.sink import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= step] if path.exists() else []
    return float(rows[-1].get("train_time", 0.0)) if rows else 0.0


def _chunk_end(first: int, steps: int, cap: int) -> int:
    """The last step of the chunk holding step ``first``: a fixed grid of ``cap`` steps cut only by the
    run's end (validation and checkpoints never move a flush)."""
    return min(steps, ((first - 1) // cap + 1) * cap)


def _keep_chunk_start(rank, job, setup: RankSetup, state: RunState, meta: dict) -> None:
    """A resumed asynchronous run ending inside its first chunk checkpoints the weights it starts that chunk
    from, so a run resumed from its end can restart there."""
    cap, steps, begin = setup.steps_per_chunk, job.plan.trainer.steps, state.step
    if begin > 0 and cap > 1 and _chunk_end(begin + 1, steps, cap) == steps and steps % cap:
        checkpoint.save(job.run_dir, begin, rank, setup.stages, meta, chunk_start=begin,
                        scaler=setup.executor.scaler, schedule=setup.schedule, device=setup.executor.device)


def _falls_in(every: int, first: int, end: int) -> bool:
    """Whether a multiple of ``every`` (0: never) lies in steps first..end."""
    return bool(every) and end // every > (first - 1) // every


def _checks_syncs(runtime, device, first: int) -> bool:
    """Whether runtime.sync_check applies: a CUDA rank, from the second step."""
    return bool(getattr(runtime, "sync_check", False)) and device.type == "cuda" and first > 1


def _inject_failure(rank: int, runtime, first: int, end: int, hook) -> None:
    """The test hook runtime.fail_at_step: rank fail_rank fails where that step falls in [first, end]."""
    fail = runtime.fail_at_step
    if fail is None or not first <= fail <= end or (runtime.fail_rank or 0) != rank:
        return
    if runtime.fail_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if hook is not None:  # a collective no other rank joins: the rank waits in it for good
        dist.all_reduce(torch.zeros(1), group=hook)
    raise RuntimeError(f"injected failure on rank {rank} at step {fail} (runtime.fail_at_step)")


def _gathered_timeline(rank: int, job, schedule, events: list, tl: int, first: int, end: int) -> Timeline | None:
    """Rank 0: the chunk's measured timeline, every rank's events gathered (None elsewhere)."""
    every = [None] * job.world_size if rank == 0 else None
    dist.gather_object(events, every, dst=0)
    if rank != 0:
        return None
    return Timeline(
        [e for evs in every for e in evs], job.world_size, time_unit="s", source="measured",
        meta={"schedule": schedule.name, "step": tl, **({"steps": [first, end]} if end > first else {}),
              "num_stages": schedule.num_stages,
              "num_microbatches": schedule.microbatches_per_step * (end - first + 1),
              **({"branch": list(schedule.graph.branch)} if schedule.graph.branch else {})},
    )


def _op_trace(runtime, state: RunState, setup: RankSetup, end: int, steps: int) -> OpTrace | None:
    """runtime.trace_steps=N: the run's trace where this chunk holds one of the last N steps, else None."""
    n = int(getattr(runtime, "trace_steps", 0) or 0)
    if n <= 0 or end <= steps - n:
        return None
    if state.trace is None:
        state.trace = OpTrace(setup.device.type)
    return state.trace


def _gathered_records(rank, job, setup: RankSetup, ex, stats: ChunkStats, first: int) -> list[dict]:
    """Asynchronous: every rank's weight-version records of the chunk on rank 0, sorted ([] elsewhere or
    when synchronous); dumps the first chunk's gradients with runtime.dump_grads."""
    if not setup.is_async:
        return []
    gathered = [None] * job.world_size if rank == 0 else None
    dist.gather_object(stats.records, gathered, dst=0)
    if job.plan.runtime.dump_grads and first == 1:
        dump_dir = Path(job.run_dir) / "grads"
        dump_dir.mkdir(parents=True, exist_ok=True)
        torch.save(ex.first_grads, dump_dir / f"rank{rank}.pt")
    if rank != 0:
        return []
    return sorted((r for rs in gathered for r in rs), key=lambda r: (r["microbatch"], r["pipe"], r["stage"]))


def _chunk_metrics(rank, job, setup: RankSetup, state: RunState, ex, stats: ChunkStats, span: range, lrs: list,
                   chunk_time: float, batch_size: int) -> list[dict]:
    """Rank 0: one metrics dict per step of ``span`` ([] elsewhere; every rank must call it); adds the steps
    past ``state.replay_to`` to ``state``."""
    plan, quiet = job.plan, state.replay_to
    m, tokens = plan.microbatches, batch_size * setup.adapter.seq_len
    busy, saved, sent = _busy_and_saved(stats.busy, ex, job.world_size)
    recs = _gathered_records(rank, job, setup, ex, stats, span.start)
    per_update = setup.executor.updates_per_step if setup.is_async else 1
    metrics_of = []
    if rank == 0:
        state.staleness.extend(r for r in recs if r["microbatch"] >= quiet * m)
        for w, s in enumerate(span):
            if s > quiet:
                state.train_time += chunk_time / len(span)
            metrics = {
                "loss": stats.losses[w],
                "lr": lrs[w],
                "grad_norm": stats.grad_norms[w],
                "step_time": chunk_time / len(span),  # steps of a chunk overlap: their mean
                "train_time": state.train_time,
                "tokens_per_s": tokens * len(span) / chunk_time,
                "samples": s * batch_size,
                "updates": s * per_update,
                "bubble": max(0.0, 1.0 - busy / (job.world_size * chunk_time)),
                "p2p_bytes": sent / len(span),  # between ranks, all ranks together: activations and gradients
                **saved,
            }
            if stats.loss_scale is not None:  # fp16
                metrics.update(loss_scale=stats.loss_scale, skipped=int(stats.skipped))
            if setup.is_async:
                st = summarize([r for r in recs if (s - 1) * m <= r["microbatch"] < s * m])
                metrics.update({k: st[k] for k in ("max_staleness", "mean_staleness", "max_mismatch")})
            metrics_of.append(metrics)
    return metrics_of


def _train_chunk(rank, job, setup: RankSetup, data, sink, progress, state: RunState, one_host: bool,
                 meta: dict, hook=None) -> None:
    """One chunk of steps without a flush (a synchronous step is a chunk of one): run, validated,
    checkpointed and logged."""
    plan = job.plan
    trainer, runtime = plan.trainer, plan.runtime
    seed, steps = plan.seed, trainer.steps
    # the global batch: every data-parallel replica's
    batch_size = setup.schedule.microbatches_per_step * setup.adapter.mbs
    val_every, save_every = trainer.val_every or 0, trainer.save_every or 0
    check_stop()  # a stop that arrived in a destructor was swallowed there
    first = state.step + 1
    cap = setup.steps_per_chunk
    end = _chunk_end(first, steps, cap)
    quiet = state.replay_to  # steps up to here were run before the checkpoint: replayed, not logged
    _inject_failure(rank, runtime, max(first, quiet + 1), end, hook)
    torch.manual_seed(seed * 1_000_003 + first)  # dropout (if any) is a function of the step
    span = range(first, end + 1)
    batches = [data.train_batch(s, batch_size) for s in span]
    normalizers = [setup.adapter.normalizer(b) for b in batches]  # microbatch losses add up to the batch mean
    lrs = [lr_at(s, plan.optim, steps) for s in span]
    tl = trainer.timeline_step
    record = tl is not None and max(first, quiet + 1) <= tl <= end
    t0 = _start_clock(record and one_host, setup.device)
    with profile_step(setup.device, runtime.memory == "profile" and end == steps) as allocated, \
            traced(_op_trace(runtime, state, setup, end, steps), len(batches)):
        ex = setup.fresh_executor(len(batches))
        ex.sync_check = _checks_syncs(runtime, setup.device, first)
        if setup.is_async:
            stats = ex.train_chunk(batches, normalizers, lrs, base_update=(first - 1) * ex.updates_per_step,
                                   base_mb=(first - 1) * setup.schedule.microbatches_per_step, record=record, t0=t0)
        else:
            stats = ChunkStats.of(ex.train_step(batches[0], normalizers[0], lrs[0], record=record, t0=t0))
    if allocated.at_peak:
        state.memory = allocated.as_dict()
    chunk_time = time.perf_counter() - t0
    metrics_of = _chunk_metrics(rank, job, setup, state, ex, stats, span, lrs, chunk_time, batch_size)
    if _falls_in(val_every, first, end) or end == steps:
        with whole_weights(setup.stages):  # (pipeline.shard=full: the whole weights, for the forwards alone)
            vl = [setup.evaluator.eval_loss(b, setup.adapter.normalizer(b))
                  for b in data.val_batches(batch_size, trainer.val_batches)]
        if vl and rank == 0:
            metrics_of[-1]["val_loss"] = sum(vl) / len(vl)
            state.val_losses.append(metrics_of[-1]["val_loss"])
    timeline = _gathered_timeline(rank, job, setup.schedule, stats.events, tl, first, end) if record else None
    # Checkpoints where a chunk ends: where a multiple of save_every falls in it, at the
    # end of the run, and before a last chunk the run's end cuts short (a run resumed
    # from that end restarts the chunk from here: see pipeflow.runtime.checkpoint)
    cut_next = end < steps < end + cap and cap > 1
    if _falls_in(save_every, first, end) or end == steps or cut_next:
        checkpoint.save(job.run_dir, end, rank, setup.stages, meta, chunk_start=end if end % cap == 0 else first - 1,
                        scaler=setup.executor.scaler, schedule=setup.schedule, device=setup.executor.device)
    with deferred_stop():  # the rows, W&B and the summary's last step agree however a stop lands
        if rank == 0:
            for s, metrics in zip(span, metrics_of):
                if s <= quiet:
                    continue
                state.history.append(metrics)
                if s % (trainer.log_every or 1) == 0 or "val_loss" in metrics:
                    sink.log(s, metrics)
                progress.update(s, metrics["loss"], metrics["tokens_per_s"])
        state.step = end
    if rank == 0 and timeline is not None:  # after the chunk's rows: W&B drops rows below a step it saw
        sink.log_timeline(timeline, tl)
