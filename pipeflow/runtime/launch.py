"""Start one OS process per device and watch them: a crashed, silent or stuck rank ends the whole job
(:class:`JobFailed`), a stop signal stops every rank (:class:`JobStopped`), and a rank whose launcher is
gone stops by itself. Under ``torchrun`` (RANK, WORLD_SIZE, ... set) this process runs its own rank.
docs/training.md ("Stopping a run") tells how each ends."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..faults import Fault, said
from ..formats.runplan import RunPlan

import torch.multiprocessing  # noqa: F401 - registers the pickling of tensors sent to the ranks

from .cluster import alive
from .device import HOSTED_STORE
from . import watch
from .rank_server import rank_context
from .supervise import (  # noqa: F401 - JobFailed, write_json and the constants are the launcher's API too
    _CONSEQUENCE,
    BEAT,
    PEER_FAILED,
    PEER_FAILED_REASON,
    STOPPED,
    JobFailed,
    _failure,
    _gone,
    _Hearing,
    _hung,
    _record_failure,
    _signal,
    _stop,
    _wait,
    write_json,
)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class TrainJob:
    """Everything a rank needs, picklable: the run plan and where to write."""

    plan: RunPlan
    run_dir: str
    # what each rank runs: "module:function", called as function(rank, job)
    entry: str = "pipeflow.runtime.worker:run_worker"

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def target(self):
        import importlib

        module, name = self.entry.split(":")
        return getattr(importlib.import_module(module), name)


class JobStopped(RuntimeError):
    """The job stopped on a stop signal (``signum``); ``summary``: rank 0's (``status: interrupted``)."""

    def __init__(self, signum: int, summary: dict):
        self.signum = signum
        # a signal to one rank (kill <pid>) stops the job too: rank 0's summary names it
        self.signal = summary.get("stopped_by") or signal.Signals(signum).name
        self.summary = summary
        super().__init__(f"stopped by {self.signal} after step {summary.get('last_step', 0)}")


class Stopped(BaseException):
    """A stop in a rank: a BaseException, so ``except Exception`` lets it through."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adopted_rank() -> int | None:
    """This process's rank where a launcher (torchrun, srun) set up the job, else None."""
    from .cluster import adopt_launcher_env

    return int(os.environ["RANK"]) if adopt_launcher_env() else None


# ---------------------------------------------------------------------- in a rank

_stop_reason: list[str] = []  # in a rank: why it was asked to stop (set once)
_pending: list[str] = []  # the watchdog's reason, read by the handler it signals


def stop_reason() -> str | None:
    """In a rank: why it was asked to stop (a signal's name, or a lost launcher), else None."""
    return _stop_reason[0] if _stop_reason else None


_deferring: list[bool] = []  # inside deferred_stop(): a stop is recorded, raised when the block ends


def _on_stop_signal(signum, _frame) -> None:
    watch.heard_stop()
    if _stop_reason:
        return  # one stop: the launcher forwarding a Ctrl-C the rank also got changes nothing
    _stop_reason.append(PEER_FAILED_REASON if signum == PEER_FAILED else
                        _pending[0] if _pending else signal.Signals(signum).name)
    if _deferring:
        return  # deferred_stop raises it once its block is whole
    if sys.exc_info()[1] is not None:
        # The rank is handling an error already (a peer that stopped first closed its
        # connections): raised here, the stop would cut that handling short, and rank 0
        # would end without its summary or the end of its W&B run. The handler reads it
        # (stop_behind); where the error was harmless, check_stop() raises it.
        return
    raise Stopped(_stop_reason[0])


@contextlib.contextmanager
def deferred_stop():
    """A block a stop must not cut in two: a stop signal inside it is raised at its end."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    if _stop_reason and not _deferring:
        raise Stopped(_stop_reason[0])


def _watch(rank: int, launcher: int) -> None:
    """A rank's watchdog thread: beat on the board, look at the main thread (:mod:`pipeflow.runtime.watch`),
    and SIGTERM this rank when the launcher is gone."""
    parent = os.getppid()
    sampler = watch.Sampler()
    every = max(1, round(BEAT / watch.SAMPLE))  # the main thread is looked at more often than beats
    for n in itertools.count():
        watch.look(rank, sampler, beat=n % every == 0)
        if n % every == 0 and not _stop_reason and (os.getppid() != parent or not alive(launcher)):
            _pending.append("the launcher ended")
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(watch.SAMPLE)


def stop_behind(err: BaseException) -> str | None:
    """Why this rank is stopping given the error that ended it (a stop asked for, or a peer gone: waits a
    second for this rank's own signal); None for a real failure."""
    if not _stop_reason and _CONSEQUENCE.search((str(err).strip().splitlines() or [""])[-1]):
        deadline = time.monotonic() + 1.0
        while not _stop_reason and time.monotonic() < deadline:
            try:
                time.sleep(0.02)
            except Stopped:
                pass
    return stop_reason()


def check_stop() -> None:
    """Raise Stopped if this rank was asked to stop (a signal's Stopped swallowed in a destructor)."""
    if _stop_reason:
        raise Stopped(_stop_reason[0])


def _quiet_stops(unraisable) -> None:
    if not isinstance(unraisable.exc_value, Stopped):
        sys.__unraisablehook__(unraisable)


def _rank_entry(rank: int, job: TrainJob, port: int, errors, env: dict, launcher: int = 0, board=None) -> None:
    """A spawned rank: the launcher's environment, signals and watchdog, then the job's entry; an error
    reaches the launcher through ``errors``, a stop ends quietly."""
    try:
        watch.install(board, rank)
        for sig in (*STOP_SIGNALS, PEER_FAILED):
            signal.signal(sig, _on_stop_signal)
        sys.unraisablehook = _quiet_stops  # a stop that lands in a destructor: check_stop() raises it again
        # a log line that cannot be written (a full disk) is dropped, not printed with a
        # traceback: the write that matters (metrics, a checkpoint) fails in one sentence
        logging.raiseExceptions = False
        # a forked rank inherits the server's environment, not the launcher's: restore the latter
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(job.world_size))
        threading.Thread(target=_watch, args=(rank, launcher or os.getppid()), daemon=True).start()
        job.target()(rank, job)
    except Stopped:  # the stop landed while the rank was reporting an error: the stop wins
        raise SystemExit(STOPPED) from None
    except BaseException as err:  # noqa: BLE001 - every failure must reach the parent
        _report(rank, err, errors)


def _report(rank: int, err: BaseException, errors) -> None:
    """A rank's failure to its launcher (a stop asked for, or a peer's, exits quietly)."""
    try:
        if stop_behind(err):
            # asked to stop: this error is the stop itself, or a peer that stopped first.
            # SystemExit, not os._exit: multiprocessing's finalizers release the rank's
            # semaphores, which the resource tracker would otherwise report as leaked
            raise SystemExit(STOPPED) from None
        # a Fault is its sentence, which the launcher prints; a bug keeps its traceback,
        # printed here as it happened (the launcher prints its last line)
        fault = isinstance(err, Fault)
        text = said(err) + "\n" if fault else "".join(traceback.format_exception(type(err), err, err.__traceback__))
        try:
            errors.put((rank, text))
        finally:
            if not fault:
                sys.stderr.write(f"[rank {rank}] {text}")
                sys.stderr.flush()
        raise SystemExit(1) from None
    except Stopped:  # the stop landed while the rank was reporting an error: the stop wins
        raise SystemExit(STOPPED) from None


# ---------------------------------------------------------------------- in the launcher


def _record_adopted_failure(job: TrainJob, rank: int, err: BaseException) -> None:
    """Under torchrun, failure.json from the failing rank (a lost peer's only where none is)."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__)).strip()
    last = said(err) if isinstance(err, Fault) else (text.splitlines()[-1] if text else type(err).__name__)
    path = Path(job.run_dir) / "failure.json"
    if not isinstance(err, Stopped) and not _CONSEQUENCE.search(last):
        # the cause: over any other record (a Fault's sentence is its whole record)
        _record_failure(job.run_dir, JobFailed(rank, last if isinstance(err, Fault) else last + "\n" + text))
        return
    # a lost peer: recorded at once (torchrun may end this rank any moment now), but only
    # where no record is, so the rank that caused it, writing after, replaces this one
    last = ("lost its connection to another rank, which ended without a Python error (killed by a signal, or "
            f"its node failed; that node's torchrun log says which): {last}")
    message = str(JobFailed(rank, last))
    record = {"rank": rank, "error": message, "detail": message + "\n" + text}
    try:
        with open(path, "x") as f:
            f.write(json.dumps(record, indent=2) + "\n")
    except FileExistsError:
        pass
    except OSError as err:
        sys.stderr.write(f"could not write {path}: {err.strerror or err}\n")


def _last_step(run_dir: str) -> int:
    from ..tracking.sink import read_metrics

    rows = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").exists() else []
    return int(rows[-1]["step"]) if rows else 0


def _stopped_summary(job: TrainJob, signum: int) -> dict:
    """Rank 0's interrupted summary, or the launcher's own where it wrote none."""
    path = Path(job.run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
        if summary.get("status") == "interrupted":
            return summary
    except (OSError, ValueError):
        pass
    from ..tracking.record import write_summary

    summary = {"kind": "measured", "status": "interrupted", "stopped_by": signal.Signals(signum).name,
               "steps": job.plan.trainer.steps, "last_step": _last_step(job.run_dir),
               "run_key": job.plan.run_key}
    try:
        write_summary(job.run_dir, summary)
    except OSError as err:
        sys.stderr.write(f"could not write {path}: {err.strerror or err}\n")
    return summary


def _unheard_killed(procs, board, grace: float = 3.0) -> None:
    """SIGKILL the ranks that have not acknowledged a stop within ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if all(_gone(p) or board.acks[r] for r, p in enumerate(procs)):
            return
        time.sleep(0.05)
    for r, p in enumerate(procs):
        if not _gone(p) and not board.acks[r]:
            _signal(p, signal.SIGKILL)


def _stuck(procs, board, after: float | None) -> JobFailed | None:
    """Every live rank sitting in one call for ``after`` seconds: named (watch.stuck_job)."""
    if not after:
        return None
    found = watch.stuck_job(board, [r for r, p in enumerate(procs) if not _gone(p)], after)
    return JobFailed(*found) if found else None


def _watch_ranks(job: TrainJob, procs, errors, board, stop: list, on_stop, hang_after: float | None) -> None:
    """Return once every rank has ended well; raise JobStopped on a stop, JobFailed (recorded) on a failed,
    silent or stuck rank."""
    hearing = _Hearing(board.beats, job.world_size)
    while True:
        if stop:
            _unheard_killed(procs, board)
            _wait(procs, 30.0)  # W&B's final flush takes a few seconds
            raise JobStopped(stop[0], _stopped_summary(job, stop[0]))
        if any(p.exitcode == STOPPED for p in procs):
            # a rank was sent a stop signal itself (kill <pid>): the whole job stops
            on_stop(signal.SIGTERM, None)
            continue
        if any(p.exitcode not in (None, 0) for p in procs):
            raise _record_failure(job.run_dir, _failure(procs, errors, hearing))
        if all(p.exitcode == 0 for p in procs):
            return
        hung = _hung(procs, hearing, hang_after) or _stuck(procs, board, hang_after)
        if hung is not None:
            _stop(procs)
            raise _record_failure(job.run_dir, hung)
        time.sleep(0.1)


def _run_adopted(job: TrainJob, rank: int) -> dict:
    """Run rank ``rank`` of torchrun's job here; rank 0's summary (or {}). JobFailed where the world size
    differs; a failure is recorded, then raised."""
    world = int(os.environ["WORLD_SIZE"])
    if world != job.world_size:
        raise JobFailed(
            rank,
            f"the launcher started {world} processes but the schedule needs {job.world_size} "
            f"(one per device); start torchrun with --nproc-per-node/--nnodes to match",
        )

    def ended_by_launcher(signum, _frame):
        # torchrun ends every rank with SIGTERM when one fails or a node leaves
        raise Stopped(f"ended by {signal.Signals(signum).name} from its launcher (torchrun ends every rank "
                      f"when one fails or a node leaves)")

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, ended_by_launcher) if main_thread else None
    try:
        return job.target()(rank, job) or {}
    except BaseException as err:  # noqa: BLE001 - recorded, then raised on
        _record_adopted_failure(job, rank, err)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def launch(job: TrainJob, on_start=None) -> dict:
    """Run the job on all ranks; rank 0's summary. JobFailed, or JobStopped after a stop signal;
    ``on_start(rank, pid)`` hears of each rank started."""
    rank = _adopted_rank()
    if rank is not None:
        return _run_adopted(job, rank)

    runtime = job.plan.runtime
    port, store = runtime.master_port, None
    env = dict(os.environ)
    if not port:
        # the rendezvous store lives here, on a port the system gives it and this process
        # holds to the end: two jobs starting at once on one host cannot both take it
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, job.world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=runtime.timeout_s * 4))
        port = store.port
        env[HOSTED_STORE] = "1"
    else:
        env.pop(HOSTED_STORE, None)
    hang_after = float(runtime.hang_timeout_s or 0) or None
    stale = os.path.join(job.run_dir, "failure.json")
    if os.path.exists(stale):  # from an earlier attempt in the same directory
        os.remove(stale)
    ctx = rank_context()
    errors = ctx.SimpleQueue()
    board = watch.Board.make(ctx, job.world_size)
    procs = [ctx.Process(target=_rank_entry, args=(r, job, port, errors, env, os.getpid(), board), daemon=False)
             for r in range(job.world_size)]
    stop: list[int] = []

    def on_stop(signum, _frame):
        stop.append(signum)
        # the first, passed on as it came: rank 0 writes the summary (naming it) and
        # finishes W&B, the others just end; a second (Ctrl-C pressed again): end them now
        for p in procs:
            if not _gone(p):
                _signal(p, signum if len(stop) == 1 else signal.SIGKILL)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_stop) for sig in STOP_SIGNALS} if main_thread else {}
    try:
        for r, p in enumerate(procs):
            if stop:
                break
            p.start()
            if on_start is not None:
                on_start(r, p.pid)
        _watch_ranks(job, procs, errors, board, stop, on_stop, hang_after)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(procs)
        del store  # the rendezvous is over: its port goes back
    summary_path = os.path.join(job.run_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    return {}
