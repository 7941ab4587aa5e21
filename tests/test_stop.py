"""How a training job ends when something outside it ends it (issue 16, items 2, 4, 5, 7):
Ctrl-C, SIGTERM and SIGHUP stop it cleanly with a summary, a launcher killed outright
takes its ranks with it, a rank that stops answering is the one named, and a run without
a terminal still prints its progress and fills train.log. Each test runs the real
``pipeflow-train`` as a subprocess and sends the real signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeflow.tracking import read_metrics

from test_tracking import of_type, offline_run_file, wandb_records

slow = pytest.mark.slow  # subprocesses of the real app: make test-fast leaves them out

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.seq_len=32", "pipeline.microbatches=2",
         "pipeline.microbatch_size=2", "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null",
         "trainer.steps=100000"]


def _start(run_dir: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    # a session of its own, as a terminal gives a job: the test can signal the whole group
    return subprocess.Popen([sys.executable, "-m", "pipeflow.train", *SMALL, *args, f"hydra.run.dir={run_dir}"],
                            cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(what, timeout: float = 120.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended early: {proc.communicate()}")
        time.sleep(0.2)
    raise AssertionError("timed out")


def _steps(run_dir: Path) -> int:
    return len(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0


def _rank_pids(run_dir: Path) -> list[int]:
    """The ranks' pids, from the launcher's lines in train.log ("rank 1: pid 1234")."""
    log = run_dir / "train.log"
    text = log.read_text() if log.exists() else ""
    return [int(line.rsplit("pid", 1)[1]) for line in text.splitlines() if "] rank " in line and ": pid " in line]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _running(run_dir: Path, proc: subprocess.Popen, steps: int = 3) -> list[int]:
    """Wait until the job has logged ``steps`` steps; its ranks' pids."""
    _wait_for(lambda: _steps(run_dir) >= steps, proc=proc)
    pids = _rank_pids(run_dir)
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    return pids


def _assert_clean_stop(run_dir: Path, proc: subprocess.Popen, sig: signal.Signals, pids: list[int]) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, (out, err)
    assert "Traceback" not in err and "leaked" not in err, err
    last = out.strip().splitlines()[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == sig.name
    assert summary["last_step"] == read_metrics(run_dir)[-1]["step"] >= 3
    assert last.startswith(f"stopped by {sig.name} after step {summary['last_step']} of 100000;"), out
    assert not (run_dir / "failure.json").exists()
    _wait_for(lambda: not any(_alive(p) for p in pids), timeout=10)
    return summary


@slow
def test_ctrl_c_stops_the_job_with_a_summary_and_a_w_and_b_run_that_syncs(tmp_path, wandb_home):
    """Ctrl-C at a terminal reaches every process of the job (the launcher and its
    ranks): one line, exit status 130, summary.json with status interrupted and the last
    step, and the offline W&B run holds every logged step and its end, so `wandb sync`
    uploads the whole run."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=wandb", "logger.mode=offline")
    pids = _running(run_dir, proc)
    os.killpg(proc.pid, signal.SIGINT)
    summary = _assert_clean_stop(run_dir, proc, signal.SIGINT, pids)
    records = wandb_records(offline_run_file(run_dir))
    steps = [h for h in of_type(records, "history")]
    assert len(steps) == summary["last_step"]  # every step metrics.jsonl holds
    assert of_type(records, "exit"), "the run was not finished"
    assert of_type(records, "summary")


@slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_launcher_alone_stops_every_rank(tmp_path, sig):
    """A scheduler's cancel (SIGTERM) or a closed terminal (SIGHUP) reaches only the
    launcher: it stops its ranks the same way. Without a terminal the run printed plain
    progress lines, and train.log holds them."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=none")
    pids = _running(run_dir, proc)
    os.kill(proc.pid, sig)
    _assert_clean_stop(run_dir, proc, sig, pids)
    log = (run_dir / "train.log").read_text()
    assert "step 1/100000  loss" in log and f"stopped by {sig.name}" in log


@slow
def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL to the launcher alone (the OOM killer, kill -9): its ranks notice within a
    second or two and stop, rank 0 writing the summary, rather than train on unwatched."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=none")
    pids = _running(run_dir, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    _wait_for(lambda: not any(_alive(p) for p in pids), timeout=15)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "the launcher ended"
    assert summary["last_step"] == read_metrics(run_dir)[-1]["step"]


@slow
def test_a_rank_that_stops_answering_is_the_one_named(tmp_path):
    """SIGSTOP to rank 1: rank 0 waits for it in a receive. The job fails within
    runtime.hang_timeout_s, naming rank 1 (not rank 0, which timed out waiting)."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=none", "runtime.hang_timeout_s=4")
    pids = _running(run_dir, proc)
    os.kill(pids[1], signal.SIGSTOP)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 1
    failed = [line for line in err.splitlines() if line.startswith("rank ")]
    assert failed and failed[0].startswith("rank 1 failed: stopped answering"), err
    assert "stopped by a signal" in failed[0]
    assert json.loads((run_dir / "failure.json").read_text())["rank"] == 1
    _wait_for(lambda: not any(_alive(p) for p in pids), timeout=15)


@slow
def test_a_rank_stuck_in_a_collective_ends_the_job_named_within_the_hang_timeout(tmp_path):
    """Rank 1 enters a collective no other rank joins (runtime.fail_mode=collective):
    its watchdog goes on beating, rank 0 waits for its next message, and neither gloo's
    timeout (60 s) nor the heartbeat says anything. Every rank sitting in one call for
    runtime.hang_timeout_s ends the job, naming the rank that sat still first, and where
    each waits."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=none", "runtime.hang_timeout_s=3", "runtime.fail_at_step=3",
                  "runtime.fail_rank=1", "runtime.fail_mode=collective")
    pids = _running(run_dir, proc, steps=2)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 1, (out, err)
    failed = [line for line in err.splitlines() if line.startswith("rank ")]
    assert failed and "failed: the job stopped moving" in failed[0], err
    # rank 1 in its collective and rank 0 at the step's start, both since the same instant:
    # the watchdog names every rank that sat still first and where each one sits
    assert "rank 1 for" in failed[0] and "in all_reduce" in failed[0] and "worker.py" in failed[0], failed[0]
    # (which of the two the samples saw sit still first is a race: rank 1 entering its
    # collective, rank 0 its wait at the step's start; on a loaded host either comes first)
    record = json.loads((run_dir / "failure.json").read_text())
    assert record["rank"] in (0, 1) and (f"rank {record['rank']} sat still first" in failed[0]
                                         or "ranks 0, 1 sat" in failed[0]), failed[0]
    # (a bound, not a timing: gloo's own timeout would have taken 60 s)
    assert took < 40, took
    _wait_for(lambda: not any(_alive(p) for p in pids), timeout=15)


@slow
def test_sigterm_stops_a_job_whose_ranks_sit_in_a_collective_within_seconds(tmp_path):
    """A rank inside a blocking collective never runs its signal handler: the launcher
    kills the ranks that did not hear the stop rather than wait out W&B's 30-second grace;
    the summary still says interrupted."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=none", "runtime.hang_timeout_s=0", "runtime.fail_at_step=3",
                  "runtime.fail_rank=1", "runtime.fail_mode=collective")
    pids = _running(run_dir, proc, steps=2)
    time.sleep(2.0)  # rank 1 is in its collective, rank 0 waits for it
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["last_step"] == 2
    assert took < 20, took  # (30 s and more before: the grace for W&B, then the kill)
    _wait_for(lambda: not any(_alive(p) for p in pids), timeout=10)


@slow
def test_a_dead_fork_server_ends_the_job_and_its_ranks(tmp_path):
    """The process the ranks were forked from dies: the job fails promptly, no rank
    trains on, and the run folder does not claim a finished run."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=none")
    pids = _running(run_dir, proc)
    server = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert server != proc.pid
    os.kill(server, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, (out, err)
    failed = [line for line in err.splitlines() if line.startswith("rank ")]
    assert failed and "fork server" in failed[0], err
    _wait_for(lambda: not any(_alive(p) for p in pids), timeout=15)
    summary = run_dir / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["status"] == "interrupted"


def test_a_stopped_run_reads_as_interrupted_in_a_comparison(tmp_path):
    from pipeflow.compare.runs import read_run

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n')
    (tmp_path / "summary.json").write_text(json.dumps(
        {"kind": "measured", "status": "interrupted", "stopped_by": "SIGINT", "last_step": 2}))
    run = read_run(tmp_path)
    assert run.status == "interrupted" and run.error == "stopped by SIGINT after step 2"
    assert len(run.rows) == 2


@slow
def test_a_signal_to_one_rank_stops_the_whole_job(tmp_path):
    """`kill <pid of rank 0>` (SIGTERM to one rank): that rank stops as it would on
    Ctrl-C, and the launcher stops the others: an interruption, not a failure."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "logger=none")
    pids = _running(run_dir, proc)
    os.kill(pids[0], signal.SIGTERM)
    _assert_clean_stop(run_dir, proc, signal.SIGTERM, pids)


def test_a_stop_that_lands_while_a_rank_handles_a_peers_error_is_read_not_raised(monkeypatch):
    """The race behind a Ctrl-C run whose W&B file held no step: rank 1 stops first and
    closes its connections, rank 0's receive fails, and rank 0's own SIGINT lands while
    it handles that error. Raised there, the stop cut the handling short (no summary,
    W&B never finished); it is recorded instead, the handler reads it as the reason, and
    the next check_stop() raises it where the error was harmless."""
    from pipeflow.runtime import launch

    monkeypatch.setattr(launch, "_stop_reason", [])
    monkeypatch.setattr(launch, "_deferring", [])
    previous = signal.signal(signal.SIGHUP, launch._on_stop_signal)
    try:
        try:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:61637")
        except RuntimeError as err:
            os.kill(os.getpid(), signal.SIGHUP)  # delivered before kill() returns: mid-handling
            reason = launch.stop_behind(err)
        assert reason == "SIGHUP"
        with pytest.raises(launch.Stopped, match="SIGHUP"):
            launch.check_stop()
        launch._stop_reason.clear()
        with pytest.raises(launch.Stopped, match="SIGHUP"):  # outside any handling: raised at once
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1.0)
    finally:
        signal.signal(signal.SIGHUP, previous)
