"""Calibrate the simulator to this machine (``python -m pipeflow.calibrate``): each device
times its actions alone and replays its iteration solo and with every rank at once
(``contention``, ``message_host``); a ping-pong fits the link; the step's synchronisation
and the replicas' all-reduce are timed. Read by :class:`pipeflow.planning.machine_cost.CalibratedCost`;
docs/benchmarks.md, "Simulating this machine", says how and why."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..faults import WriteFailed
from ..formats.files import write_aside
from ..schedules.ir import Action, Kind
from .calibrate_fit import _contention, _device_times, _fit_link, _host_cores, _tensor_cores
from .executor import Executor
from .stage import Messages

FORMAT, VERSION = "pipeflow-calibration", 1
WARMUP, REPEATS, ROUNDS = 2, 5, 7
LINK_FLOATS = 1 << 18  # the ping-pong's middle size, at least (1 MiB of fp32)


def _drop(store: dict, stage: int, grad: bool) -> None:
    """Forget what the stage just emitted (nobody receives it here)."""
    for key in [k for k in store if k[0] == grad and (k[1] if not grad else k[2]) == stage]:
        del store[key]


class _Bench:
    """Times one rank's actions through its executor, feeding random messages."""

    def __init__(self, ex: Executor, batch, normalizer: float):
        self.ex, self.batch, self.normalizer = ex, batch, normalizer
        self.graph = ex.graph
        self.nseg = max(1, ex.schedule.num_segments)
        self.split = not ex.segmented

    def _feed(self, st, seg: int, grad: bool, local: dict) -> None:
        ad = self.ex.adapter
        if grad:
            for t in self.graph.succs[st.stage]:
                shape, dtype = ad.message_spec(st.stage, t, seg)
                local[(True, st.stage, t, 0, st.pipe, seg)] = torch.randn(shape).to(dtype)
        else:
            for p in self.graph.preds[st.stage]:
                shape, dtype = ad.message_spec(p, st.stage, seg)
                local[(False, p, st.stage, 0, st.pipe, seg)] = torch.randn(shape).to(dtype)

    def _timed(self, fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def forwards(self, st, record: dict | None) -> None:
        ex, local, out = self.ex, {}, {}
        for seg in range(self.nseg):
            self._feed(st, seg, False, local)
            a = Action(Kind.F, st.stage, 0, st.pipe, seg)
            before = ex.meter.current
            t = self._timed(lambda: ex._forward(a, Messages(outbox=out, local=local), self.batch, self.normalizer))
            if record is not None:
                record.setdefault(("F", st.stage, seg), []).append(t)
                record.setdefault(("act", st.stage, seg), []).append(ex.meter.current - before)
            _drop(local, st.stage, False)
            _drop(out, st.stage, False)

    def backwards(self, st, record: dict | None, kind: str = "B") -> None:
        ex, local, out = self.ex, {}, {}
        for seg in reversed(range(self.nseg)):
            self._feed(st, seg, True, local)
            if kind == "B":
                a = Action(Kind.B, st.stage, 0, st.pipe, seg)
                times = {"B": self._timed(lambda: ex._backward(a, {}, local, out, full=True))}
            else:
                a = Action(Kind.I, st.stage, 0, st.pipe, seg)
                times = {"I": self._timed(lambda: ex._backward(a, {}, local, out, full=False))}
                times["W"] = self._timed(lambda: ex._weight(Action(Kind.W, st.stage, 0, st.pipe, seg)))
            for k, t in times.items():
                if record is not None:
                    record.setdefault((k, st.stage, seg), []).append(t)
            local.clear()
            out.clear()

    def step(self, st, record: dict | None) -> None:
        def run():
            if st.optimizer is not None:
                st.optimizer.step()
                st.optimizer.zero_grad(set_to_none=True)
        t = self._timed(run)
        if record is not None:
            record.setdefault(("S", st.stage, 0), []).append(t)

    def replay(self, record: dict | None, together: bool = False) -> tuple[float, float, int]:
        """Run this rank's actions of one iteration in order, messages from other ranks replaced by
        local tensors; ``together``: also post the plan's messages and run the replicas'
        all-reduces for real. Returns (seconds less the all-reduces' wait, seconds posting,
        messages posted)."""
        ex = self.ex
        local: dict = {}
        outbox: dict = {}
        inbox: dict = {}
        sends: list = []
        reduces = []
        posting, posted, collective = 0.0, 0, 0.0
        t0 = time.perf_counter()
        for posts, a in ex.steps:
            if together and posts:
                tp = time.perf_counter()
                ex._flush(posts, outbox, inbox, sends)
                posting += time.perf_counter() - tp
                posted += len(posts)
            st = ex.stages.get((a.pipe, a.stage))
            if a.kind == Kind.F:
                for p in self.graph.preds[a.stage]:
                    key = (False, p, a.stage, a.microbatch, a.pipe, a.segment)
                    if key not in local:
                        local[key] = self._message(p, a.stage, a.segment)
                run = lambda: ex._forward(a, Messages(outbox=outbox, local=local), self.batch, self.normalizer)  # noqa: E731
            elif a.kind in (Kind.B, Kind.I):
                if not st.last:
                    for t in self.graph.succs[a.stage]:
                        key = (True, a.stage, t, a.microbatch, a.pipe, a.segment)
                        if key not in local:
                            local[key] = self._message(a.stage, t, a.segment)
                full = a.kind == Kind.B
                run = lambda: ex._backward(a, {}, local, outbox, full=full)  # noqa: E731
            elif a.kind == Kind.W:
                run = lambda: ex._weight(a)  # noqa: E731
            elif a.kind == Kind.STEP:
                if reduces:
                    tw = time.perf_counter()
                    ex._synchronise(reduces, torch.zeros((), dtype=torch.float64))
                    collective += time.perf_counter() - tw
                    reduces = []

                def run():
                    if st.optimizer is not None:
                        st.optimizer.step()
                        st.optimizer.zero_grad(set_to_none=True)
            elif a.kind == Kind.REDUCE:
                if together:
                    reduces.append(ex._reduce(a))
                continue
            else:
                continue
            t = self._timed(run)
            if record is not None:
                record.setdefault((a.kind, a.stage, a.segment), []).append(t)
        if together:
            tp = time.perf_counter()
            ex._flush(ex.tail, outbox, inbox, sends)
            posting += time.perf_counter() - tp
            posted += len(ex.tail)
        # the replicas' all-reduces are priced by the simulator's REDUCE (over the
        # fitted link), not as compute slowed by sharing: their wait is left out
        elapsed = time.perf_counter() - t0 - collective
        for _buf, work in inbox.values():
            if work is not None:
                work.wait()
        for work, *_ in sends:
            work.wait()
        local.clear()
        outbox.clear()
        return elapsed, posting, posted

    def _message(self, src: int, dst: int, seg: int) -> torch.Tensor:
        ad = self.ex.adapter
        shape, dtype = ad.message_spec(src, dst, seg)
        return torch.randn(shape).to(dtype)

    def round(self, st, record: dict | None) -> None:
        self.forwards(st, record)
        self.backwards(st, record, "B")
        if self.split:
            self.forwards(st, None)
            self.backwards(st, record, "IW")
        self.step(st, record)


def _ping_pong(rank: int, numel: int, reps: int = 20, peer: int | None = None) -> float:
    """One-way time of a float32 message of ``numel`` elements between ranks 0 and
    ``peer`` (1 unless given: with tensor parallelism, device 1's tensor rank 0)."""
    buf = torch.zeros(numel)
    times = []
    other = 1 if peer is None else peer
    for r in range(reps + 3):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, other)
            dist.recv(buf, other)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if r >= 3:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def run_rank(rank: int, job) -> dict | None:
    """One rank of the calibration (the launcher's entry for ``TrainJob(entry=...)``)."""
    plan = job.plan
    world = job.world_size
    setup, ex, T = _join_and_build(rank, job)
    me, devices = rank // T, world // T
    bench = _make_bench(rank, plan, setup, ex)
    stages = list(setup.stages.values())
    record = _time_actions_alone(bench, stages, me, devices)
    replayed, slowdown, cpu, message_host = _replay_rounds(bench, me, devices)
    alone = {k: statistics.median(v) for k, v in record.items()}
    alone.update({k: statistics.median(v) for k, v in replayed.items()})
    link = _measure_link(rank, setup, ex, devices, T)
    collective = _measure_collective(world, T)
    sync = _measure_sync(bench, ex, stages)
    mine = {
        "alone": {f"{k}|{s}|{g}": v for (k, s, g), v in alone.items()},
        "slowdown": slowdown,
        "cpu": cpu,
        "message_host": message_host,
        "link": link,
        "collective": collective,
        "sync": sync,
        "params": {st.stage: sum(p.numel() * p.element_size() for p in st.params) for st in stages},
        "messages": {f"{p}|{s}|{g}": b for (p, s, g), b in _message_bytes(setup, ex).items()},
    }
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    dist.destroy_process_group()
    if rank != 0:
        return None
    result = _combine(plan, setup, gathered, world, tensor=T, sequence_parallel=plan.sequence_parallel)
    write_aside(Path(job.run_dir, "calibration.json"), json.dumps(result, indent=1) + "\n")
    return result


def _join_and_build(rank: int, job) -> tuple:
    """Set this rank up as the worker does (allocator, threads, process group) and build its
    stages and executor. Returns (setup, executor, T: the ranks per device)."""
    from .device import device_and_backend, join_group, keep_freed_memory
    from .rank import build_rank

    runtime = job.plan.runtime
    keep_freed_memory()  # as the worker does: the same allocator as a real step
    torch.set_num_threads(int(runtime.threads_per_rank or 1))
    device, backend = device_and_backend(runtime, rank)
    join_group(backend, rank, job.world_size, runtime.timeout_s * 4)
    setup = build_rank(job.plan, rank, device)
    # tensor parallelism: this rank is tensor rank ``t`` of schedule device ``me``; the
    # device's T ranks run every action together (their collectives need each other), so
    # they take their turns together, as one device (runtime.mesh: rank = device x T + t)
    T = job.plan.tensor_parallel
    me = rank // T
    mesh = None
    if T > 1:
        from .mesh import RankMesh

        mesh = RankMesh(T, me, rank % T)
    ex = Executor(job.plan.lowered, me, setup.stages, setup.adapter, setup.executor.groups, grad_clip=None,
                  mesh=mesh)
    return setup, ex, T


def _make_bench(rank: int, plan, setup, ex: Executor) -> _Bench:
    """Build the data (rank 0 first: one barrier per rank) and a bench fed one batch holding
    every microbatch the plan names."""
    m, mbs = setup.schedule.num_microbatches, setup.adapter.mbs
    if rank != 0:
        dist.barrier()
    data = setup.adapter.build_data(plan.data)
    if rank == 0:
        dist.barrier()
    # every microbatch the plan names (an asynchronous plan spans several steps' worth)
    need = max(m, 1 + max((a.microbatch for _, a in ex.steps), default=0))
    batch = data.train_batch(1, need * mbs)
    return _Bench(ex, batch, setup.adapter.normalizer(batch))


def _time_actions_alone(bench: _Bench, stages: list, me: int, devices: int) -> dict:
    """Time each of this device's stages in tight loops, device by device, then warm up
    the solo and joint replays. Returns the loops' times per (kind, stage, segment)."""
    # 1. each stage's F, B, I, W and S alone in a tight loop, device by device (the
    # fallback for kinds the schedule does not run)
    record: dict = {}
    for turn in range(devices):
        if turn == me:
            for st in stages:
                for _ in range(WARMUP):
                    bench.round(st, None)
                for _ in range(REPEATS):
                    bench.round(st, record)
            for _ in range(WARMUP):
                bench.replay(None)
        dist.barrier()
    for _ in range(WARMUP):
        dist.barrier()
        bench.replay(None, together=True)
    return record


def _replay_rounds(bench: _Bench, me: int, devices: int) -> tuple[dict, float, float, float]:
    """Alternate solo replays, device by device, with joint ones, ROUNDS times. Returns (solo
    mean per (kind, stage, segment), median joint/solo slowdown, median share of its core a
    solo replay keeps busy, median seconds posting one message)."""
    # 2. rounds of: the device's own actions in the schedule's order (replay) alone,
    # device by device (a device's T ranks together), which is what a step runs; then
    # every rank's replay at once (with the
    # replicated stages' all-reduces), whose slowdown over this round's solo replay is
    # the host's contention. A ratio of neighbouring replays, not of two separate
    # blocks of them: on a shared host the speed drifts by tens of percent within a
    # calibration, and only a ratio of adjacent times cancels that drift.
    replayed: dict = {}
    ratios, per_message, used = [], [], []
    for _ in range(ROUNDS):
        solo = 0.0
        for turn in range(devices):
            if turn == me:
                one: dict = {}
                c0 = time.process_time()  # how busy the replay keeps the rank's core
                solo = bench.replay(one)[0]
                if solo > 0:
                    used.append((time.process_time() - c0) / solo)
                for k, v in one.items():
                    replayed.setdefault(k, []).append(sum(v) / len(v))  # the replay's mean per kind
            dist.barrier()
        elapsed, posting, posted = bench.replay(None, together=True)
        # the messages' own cost is priced per message; the rest is compute slowed by sharing
        if solo > 0:
            ratios.append((elapsed - posting) / solo)
        if posted:
            per_message.append(posting / posted)
        dist.barrier()
    slowdown = statistics.median(ratios) if ratios else 1.0
    cpu = statistics.median(used) if used else 1.0
    message_host = statistics.median(per_message) if per_message else 0.0
    return replayed, slowdown, cpu, message_host


def _measure_link(rank: int, setup, ex: Executor, devices: int, T: int) -> list:
    """Ping-pong three message sizes between devices 0 and 1 (every rank passes the same
    barriers). Returns [(bytes, one-way seconds)] on ranks 0 and T, else []."""
    # 3. messages between ranks 0 and 1, or with tensor parallelism between devices 0
    # and 1's tensor ranks 0 (ranks 0 and T), as a step's messages go (the others wait)
    sizes = sorted({int(torch.Size(shape).numel()) for shape in _message_shapes(setup, ex)} or {4096})
    # at least a MiB: the fit also prices the replicas' gradient all-reduces (REDUCE),
    # megabytes where a pipeline message may be kilobytes (data parallelism has none)
    big = max(max(sizes), LINK_FLOATS)
    link = []
    if devices >= 2:
        for numel in (256, big, 4 * big):
            dist.barrier()
            if rank in (0, T):
                link.append((numel * 4.0, _ping_pong(rank, numel, peer=T if T > 1 else None)))
    dist.barrier()
    return link


COLLECTIVE_FLOATS = (1 << 18, 1 << 21)  # the all-reduce's two sizes: 1 and 8 MiB of fp32


def _measure_collective(world: int, T: int, reps: int = 5) -> list:
    """A gloo all-reduce over every rank at two sizes: [(bytes, seconds)], each the median of
    ``reps``; [] with tensor parallelism (the times hold its collectives) or one rank."""
    if world < 2 or T > 1:
        return []
    points = []
    for numel in COLLECTIVE_FLOATS:
        buf = torch.ones(numel)
        times = []
        for r in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if r:
                times.append(time.perf_counter() - t0)
        points.append((numel * 4.0, statistics.median(times)))
    return points


def _collective_bandwidth(points: list, world: int) -> dict:
    """``collective_bandwidth`` (bytes/s of the topology's ring all-reduce) from the two sizes'
    difference, the fixed cost aside; {} without points."""
    if len(points) < 2 or world < 2:
        return {}
    (b1, t1), (b2, t2) = points[0], points[-1]
    if not t2 > t1:
        return {}
    return {"collective_bandwidth": (world - 1) / world * (b2 - b1) / (t2 - t1), "collective_points": points}


def _measure_sync(bench: _Bench, ex: Executor, stages: list) -> float:
    """Run a forward and backward of every stage, then time the step's synchronisation
    five times. Returns the median."""
    # 4. the synchronisation before the first STEP (after a backward, so gradients exist)
    for st in stages:
        bench.forwards(st, None)
        bench.backwards(st, None, "B")
    sync_times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        ex._synchronise([], torch.zeros((), dtype=torch.float64))
        sync_times.append(time.perf_counter() - t0)
    return statistics.median(sync_times)


def _message_shapes(setup, ex) -> list:
    return [shape for shape in _message_specs(setup, ex).values()]


def _message_specs(setup, ex) -> dict:
    ad, graph = setup.adapter, setup.schedule.graph
    out = {}
    for s in range(setup.schedule.num_stages):
        for t in graph.succs[s]:
            for g in range(max(1, setup.schedule.num_segments)):
                shape, _ = ad.message_spec(s, t, g)
                out[(s, t, g)] = tuple(shape)
    return out


def _message_bytes(setup, ex) -> dict:
    return {k: float(torch.Size(v).numel() * 4) for k, v in _message_specs(setup, ex).items()}


def _combine(plan, setup, per_rank: list[dict], world: int, tensor: int = 1,
             sequence_parallel: bool = False) -> dict:
    """Rank 0: one calibration from every rank's measurements (a device's tensor ranks,
    then its replicas: their median, :func:`_device_times`)."""
    alone = _device_times(per_rank, tensor)
    cores = _host_cores()
    slowdown = statistics.median(r["slowdown"] for r in per_rank)
    # slowdown = 1 / compute_rate(devices): solve the topology's rate model for contention
    # (with T > 1 on the TensorTopology the simulator sees: _tensor_cores)
    topo_cores = cores
    if tensor > 1:
        used = statistics.median(r.get("cpu", 1.0) for r in per_rank)
        topo_cores = tensor * _tensor_cores(slowdown, world // tensor, cores, tensor, used)
    contention = _contention(slowdown, world // tensor, topo_cores // tensor)
    link = per_rank[0]["link"]
    latency, bandwidth = _fit_link(link) if len(link) >= 2 else (30e-6, 5e9)
    out = {
        "format": FORMAT,
        "version": VERSION,
        "config": {
            "model": plan.record["model"].get("name"),
            "schedule": setup.schedule.name,
            "num_stages": setup.schedule.num_stages,
            "segments": max(1, setup.schedule.num_segments),
            "microbatch_size": setup.adapter.mbs,
            "layers_per_stage": list(setup.layers_per_stage),
            "world_size": world,
            "threads_per_rank": int(plan.runtime.threads_per_rank or 1),
            # each device's ranks (their times include the tensor groups' collectives)
            "tensor_parallel": tensor,
            "sequence_parallel": bool(sequence_parallel),
            # what the times' blocks ran as (compile=true: compiled; Schedule.compile_mode)
            "compile": setup.schedule.compile_mode(bool(plan.compile)),
        },
        "times": {k: v for k, v in alone.items() if not k.startswith("act|")},
        "activation_bytes": {k.split("|", 1)[1]: v for k, v in alone.items() if k.startswith("act|")},
        "param_bytes": {str(s): b for r in per_rank for s, b in r["params"].items()},
        "message_bytes": per_rank[0]["messages"],
        "sync_s": statistics.median(r["sync"] for r in per_rank),
        "host": {"cores": topo_cores, "contention": contention, "latency": latency, "bandwidth": bandwidth,
                 "message_host": statistics.median(r["message_host"] for r in per_rank),
                 "slowdown_all_ranks": slowdown, "link_points": link,
                 **_collective_bandwidth(per_rank[0].get("collective", []), world),
                 **({"host_cores": cores, "cpu_per_rank": [r["cpu"] for r in per_rank]} if tensor > 1 else {})},
        "torch": torch.__version__,
    }
    return out


def calibrate(plan, out: str | Path | None = None) -> dict:
    """Calibrate a checked train config's run plan on its ranks; write ``out``.
    (:func:`pipeflow.calibrate.calibrate` takes a composed config and checks it first.)"""
    from .launch import TrainJob, launch

    with tempfile.TemporaryDirectory(prefix="pipeflow-calibrate-") as tmp:
        launch(TrainJob(plan, tmp, entry="pipeflow.runtime.calibration_run:run_rank"))
        result = json.loads(Path(tmp, "calibration.json").read_text())
    if out is not None:
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WriteFailed(out, err) from None
        write_aside(out, json.dumps(result, indent=1) + "\n")
    return result
