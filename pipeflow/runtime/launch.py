"""Start one OS process per device and watch them: a crashed rank ends the whole job.

Locally the trainer spawns ``world_size`` ranks itself. Under ``torchrun`` (RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT already set) it adopts the environment and runs
the one rank this process is, so multi-node jobs use the same code path.

Failure handling is the point of this module: a rank that raises reports its
traceback through a queue and exits non-zero; the parent notices within a fraction of
a second, terminates every other rank (which may be blocked in a receive that will
never complete), and raises :class:`JobFailed` carrying that rank's error. A rank killed
by a signal is reported by its exit status. Nothing is left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch.multiprocessing as mp


@dataclass
class TrainJob:
    """Everything a rank needs, picklable: the resolved config and where to write."""

    cfg: dict
    run_dir: str
    world_size: int
    # what each rank runs: "module:function", called as function(rank, job)
    entry: str = "pipeflow.runtime.worker:run_worker"

    def target(self):
        import importlib

        module, name = self.entry.split(":")
        return getattr(importlib.import_module(module), name)


class JobFailed(RuntimeError):
    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.message = message


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adopted_rank() -> int | None:
    """This process's rank when a launcher such as torchrun already set up the job."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"])
    return None


def rank_context():
    """Ranks are forked from a server that has imported the runtime (torch, transformers)
    once, so a launch does not pay seconds of imports per rank, and a sweep or a test
    session reuses the server. The server never touches CUDA, so forking is safe."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["pipeflow.runtime.worker"])
        return ctx
    return mp.get_context("spawn")


def _rank_entry(rank: int, job: TrainJob, port: int, errors, env: dict) -> None:
    # a forked rank inherits the server's environment, not the launcher's: restore the latter
    os.environ.clear()
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(job.world_size)
    try:
        job.target()(rank, job)
    except BaseException as err:  # noqa: BLE001 - every failure must reach the parent
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        try:
            errors.put((rank, text))
        finally:
            sys.stderr.write(f"[rank {rank}] {text}")
            sys.stderr.flush()
            os._exit(1)


def _stop(procs, grace: float = 3.0) -> None:
    procs = [p for p in procs if p.pid is not None]  # a rank that never started has nothing to stop
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


# what a rank says when a *peer* died: a consequence, not a cause
_CONSEQUENCE = re.compile(r"Connection (closed|reset)|Broken pipe|timed out|Timeout|NCCL communicator was aborted", re.I)


def _failure(procs, errors) -> JobFailed:
    """Blame the right rank. Read the evidence before stopping anyone: once one rank
    dies its peers fail too (their receives lose the connection) and may report first;
    ranks are children of the fork server, so a killed rank's exit status can arrive
    after its peers' reports. Wait (briefly) for a killed rank or a report that is not
    a lost connection; once we stop the others they all die by signal."""
    reported: list[tuple[int, str]] = []
    deadline = time.monotonic() + 2.0
    while True:
        while not errors.empty():
            reported.append(errors.get())
        codes = [(r, p.exitcode) for r, p in enumerate(procs)]
        killed = [(r, c) for r, c in codes if c is not None and c < 0]
        causes = [(r, t) for r, t in reported if not _CONSEQUENCE.search(t.strip().splitlines()[-1])]
        if killed or causes or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    _stop(procs)
    if killed:
        r, code = killed[0]
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        others = "".join(f"\n(rank {o} then failed: {t.strip().splitlines()[-1]})" for o, t in reported)
        return JobFailed(r, f"the process was killed by signal {name}{others}")
    if reported:
        r, text = (causes or reported)[0]
        return JobFailed(r, text.strip().splitlines()[-1] + "\n" + text)
    r, code = next(((r, c) for r, c in codes if c not in (None, 0)), (0, None))
    return JobFailed(r, f"the process ended with exit status {code} and no Python error")


def _record_failure(run_dir: str, failed: JobFailed) -> None:
    """run_dir/failure.json: which rank failed and why, so a report over many runs can
    show this one as crashed (with its partial metrics) rather than guess."""
    message = str(failed)
    record = {"rank": failed.rank, "error": message.splitlines()[0], "detail": message}
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "failure.json"), "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    except OSError:
        pass  # the failure itself is what the caller must hear about


def launch(job: TrainJob) -> dict:
    """Run the job on all ranks; return rank 0's summary. Raises JobFailed."""
    rank = _adopted_rank()
    if rank is not None:
        world = int(os.environ["WORLD_SIZE"])
        if world != job.world_size:
            raise JobFailed(
                rank,
                f"the launcher started {world} processes but the schedule needs {job.world_size} "
                f"(one per device); start torchrun with --nproc-per-node/--nnodes to match",
            )
        return job.target()(rank, job) or {}

    port = job.cfg.get("runtime", {}).get("master_port") or free_port()
    stale = os.path.join(job.run_dir, "failure.json")
    if os.path.exists(stale):  # from an earlier attempt in the same directory
        os.remove(stale)
    ctx = rank_context()
    errors = ctx.SimpleQueue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank_entry, args=(r, job, port, errors, env), daemon=False) for r in range(job.world_size)]
    # a SIGTERM to the parent (a scheduler cancelling the job) must not leave ranks behind
    def on_term(*_):
        _stop(procs)
        sys.exit(143)

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_term)
    try:
        for p in procs:
            p.start()
        while True:
            if any(p.exitcode not in (None, 0) for p in procs):
                failed = _failure(procs, errors)
                _record_failure(job.run_dir, failed)
                raise failed
            if all(p.exitcode == 0 for p in procs):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(procs)
    summary_path = os.path.join(job.run_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    return {}
