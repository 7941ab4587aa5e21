"""The launcher's watch over its rank processes: signalling and waiting for them, hearing
their heartbeats, and naming the one that failed in failure.json."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

from ..tracking.record import write_whole as write_json
from .cluster import alive

STOPPED = 3  # a rank's exit status when it stopped because it was asked to, not from an error
# what the launcher sends the ranks left when one failed: stop, but this is no
# interruption (rank 0 writes no summary; the launcher writes failure.json)
PEER_FAILED = signal.SIGUSR1
PEER_FAILED_REASON = "another rank failed"
BEAT = 0.5  # seconds between a rank's heartbeats


class JobFailed(RuntimeError):
    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.message = message


def _signal(p, sig) -> None:
    """Send ``sig`` to rank process ``p`` by pid: its exit status may be unknown (a dead
    fork server reports 255 for ranks that still run)."""
    if p.pid is not None:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


def _gone(p) -> bool:
    return p.pid is None or (p.exitcode is not None and not alive(p.pid))


def _stop(procs, grace: float = 3.0) -> None:
    """End every rank still running: PEER_FAILED first (a rank closes its W&B run and
    ends), SIGKILL after ``grace`` seconds."""
    procs = [p for p in procs if p.pid is not None]  # a rank that never started has nothing to stop
    for p in procs:
        if not _gone(p):
            _signal(p, PEER_FAILED)
    _wait(procs, grace)
    for p in procs:
        if not _gone(p):
            _signal(p, signal.SIGKILL)
    _wait(procs, 5.0)


def _wait(procs, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    while any(not _gone(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


# what a rank says when a *peer* died: a consequence, not a cause
_CONSEQUENCE = re.compile(r"Connection (closed|reset)|Broken pipe|timed out|Timeout|NCCL communicator was aborted", re.I)


def _state(pid: int) -> str:
    """The kernel's word for a process's state (Linux), or '' where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return {"T": "stopped by a signal", "t": "stopped by a debugger", "D": "waiting on a device",
            "Z": "a zombie"}.get(fields[0], "")


class _Hearing:
    """The launcher's view of the ranks' heartbeats: when each last changed, as the
    launcher saw it. A launcher that was itself suspended (Ctrl-Z) starts over rather
    than blaming ranks that were suspended with it."""

    def __init__(self, beats, world: int):
        self.beats = beats
        self.seen = [None] * world
        self.changed = [time.monotonic()] * world
        self.tick = time.monotonic()

    def silent(self) -> list[tuple[int, float]]:
        now = time.monotonic()
        if now - self.tick > 2.0:  # this process did not run for a while: no evidence
            self.changed = [now] * len(self.changed)
        self.tick = now
        if self.beats is None:
            return []
        out = []
        for r in range(len(self.seen)):
            beat = self.beats[r]
            if beat != self.seen[r]:
                self.seen[r], self.changed[r] = beat, now
            elif beat:  # a rank that has not beaten yet is still starting
                out.append((r, now - self.changed[r]))
        return out


def _hung(procs, hearing: _Hearing, after: float | None) -> JobFailed | None:
    for r, quiet in hearing.silent():  # read every time, so that _failure has it current
        if after and quiet > after and not _gone(procs[r]):
            state = _state(procs[r].pid)
            how = f" (process {procs[r].pid} is {state})" if state else f" (process {procs[r].pid})"
            return JobFailed(r, f"stopped answering: no heartbeat for {quiet:.0f} s{how}; "
                                f"the other ranks were waiting for it (runtime.hang_timeout_s={after:g})")
    return None


def _failure(procs, errors, hearing: _Hearing | None = None) -> JobFailed:
    """Blame the right rank: read the evidence before stopping anyone (a dead rank's peers
    fail too and may report first), waiting briefly for a killed rank or a report other than
    a lost connection. A peer that timed out on a silent rank blames the silent one."""
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
    silent = [(r, q) for r, q in (hearing.silent() if hearing else []) if q > 3 * BEAT + 1.0 and not _gone(procs[r])]
    if not killed and not causes and silent:
        r, quiet = max(silent, key=lambda rq: rq[1])
        state = _state(procs[r].pid) if procs[r].pid else ""
        _stop(procs)
        waited = "".join(f"\n(rank {o} timed out waiting: {t.strip().splitlines()[-1]})" for o, t in reported)
        return JobFailed(r, f"stopped answering: no heartbeat for {quiet:.0f} s"
                            + (f" (process {procs[r].pid} is {state})" if state else "") + waited)
    _stop(procs)
    if killed:
        r, code = killed[0]
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        others = "".join(f"\n(rank {o} then failed: {t.strip().splitlines()[-1]})" for o, t in reported)
        return JobFailed(r, f"the process was killed by signal {name}{others}")
    if reported:
        r, text = (causes or reported)[0]
        lines = text.strip().splitlines()  # a Fault's one sentence, or a traceback ending in its error
        return JobFailed(r, lines[-1] + ("\n" + text if len(lines) > 1 else ""))
    r, code = next(((r, c) for r, c in codes if c not in (None, 0)), (0, None))
    if code == 255 and all(p.exitcode == 255 for p in procs):
        return JobFailed(r, "the process that started the ranks (multiprocessing's fork server) ended; "
                            "the ranks were stopped")
    return JobFailed(r, f"the process ended with exit status {code} and no Python error")


def _record_failure(run_dir: str, failed: JobFailed) -> JobFailed:
    """Write run_dir/failure.json (which rank failed and why). Returns the failure to raise:
    ``failed``, or where the record could not be written, the same failure saying so."""
    message = str(failed)
    record = {"rank": failed.rank, "error": message.splitlines()[0], "detail": message}
    try:
        os.makedirs(run_dir, exist_ok=True)
        write_json(Path(run_dir) / "failure.json", record)
    except OSError as err:  # the failure itself is what the caller must hear about
        first, _, rest = failed.message.partition("\n")
        note = f" (and failure.json could not be written: {err.strerror or err})"
        return JobFailed(failed.rank, first + note + ("\n" + rest if rest else ""))
    return failed
