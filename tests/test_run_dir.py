"""A run folder is one run's (issue 16, items 3 and 7): a second pipeflow-train aimed at a
folder another one is writing into, or one that holds a finished run's metrics, is
refused in one line before any rank starts; a refused config leaves no run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeflow.config import ConfigError
from pipeflow.train import CLAIM, claim_run_dir

pytestmark = pytest.mark.slow  # subprocesses of the real app

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.seq_len=32", "pipeline.microbatches=2",
         "pipeline.microbatch_size=2", "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null",
         "logger=none"]


def _app(args: list[str], cwd: Path, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    return subprocess.Popen([sys.executable, "-m", "pipeflow.train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_two_runs_into_one_folder_one_is_refused(tmp_path):
    """Two runs started at once into the same folder (as two started in the same second
    share Hydra's default one): exactly one trains, the other stops in one line."""
    run_dir = tmp_path / "same"
    args = [*SMALL, "trainer.steps=30", f"hydra.run.dir={run_dir}"]
    first, second = _app(args, tmp_path), _app(args, tmp_path)
    outs = [p.communicate(timeout=300) for p in (first, second)]
    codes = sorted(p.returncode for p in (first, second))
    assert codes == [0, 1], outs
    refused = next(err for (out, err), p in zip(outs, (first, second)) if p.returncode == 1).strip()
    assert refused.startswith(f"hydra.run.dir={run_dir}: ") and len(refused.splitlines()) == 1, refused
    assert "another pipeflow-train (pid" in refused or "holds another run's metrics.jsonl" in refused
    steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 30  # one run's steps, not two interleaved
    assert not (run_dir / CLAIM).exists()  # the claim goes with its run


def test_a_folder_with_a_finished_run_is_refused(tmp_path):
    run_dir = tmp_path / "done"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    proc = _app([*SMALL, "trainer.steps=2", f"hydra.run.dir={run_dir}"], tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().startswith(f"hydra.run.dir={run_dir}: holds another run's metrics.jsonl")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched


def test_a_claim_left_by_a_dead_run_is_taken_over(tmp_path):
    """A run killed before it could remove its claim does not lock the folder for ever."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / CLAIM).write_text(f"{dead.pid}\n")
    claim = claim_run_dir(str(tmp_path))
    assert claim.read_text().strip() == str(os.getpid())
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        claim.write_text(f"{live.pid}\n")
        with pytest.raises(ConfigError, match=rf"another pipeflow-train \(pid {live.pid}\)"):
            claim_run_dir(str(tmp_path))
    finally:
        live.kill()
        live.wait()


def test_a_refused_config_leaves_no_run_folder(tmp_path):
    run_dir = tmp_path / "refused"
    proc = _app(["schedule=chimera", "pipeline.stages=3", "logger=none", f"hydra.run.dir={run_dir}"], tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "pipeline.stages=3" in err
    assert not run_dir.exists()


# --------------------------------------------------- command lines refused in one line


@pytest.mark.parametrize("override,start", [
    ("trainer.stepz=5", "trainer.stepz=5: unknown key; trainer has steps, "),
    ("+trainer.precision=bf16", "trainer.precision=bf16: unknown key; trainer has steps, "),
    ("++pipeline.expert_parallel=2", "pipeline.expert_parallel=2: unknown key; pipeline has stages, "),
    ("trainer.steps=abc", "trainer.steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
])
def test_an_unknown_key_is_refused_however_it_is_written(override, start, tmp_path):
    """Issue 16, item 1: a misspelt key does nothing silently, and the refusal does not
    tell the user to force it in with '+'."""
    proc = _app([override, "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().startswith(start) and len(err.strip().splitlines()) == 1, err
    assert "+" not in err.split(":", 1)[1]
    assert not (tmp_path / "run").exists()


def test_a_run_folder_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    proc = _app(["logger=none", "hydra.run.dir=/proc/pipeflow-x"], tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip() == "hydra.run.dir=/proc/pipeflow-x: cannot write there (No such file or directory); " \
                          "give a folder you can write", err
    (tmp_path / "file").write_text("")
    proc = _app(["logger=none", f"hydra.run.dir={tmp_path / 'file' / 'run'}"], tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err.strip().endswith(f"{tmp_path / 'file'} is a file, not a folder"), err


def test_a_full_disk_names_the_file_and_leaves_a_whole_failure_record(tmp_path):
    """Issue 16, item 5: the checkpoint goes to a file on a full device (/dev/full
    answers every write with ENOSPC): the job fails naming the file and the reason, and
    failure.json is whole. Issue 76: that sentence is the whole report, printed once (no
    rank's traceback, no second copy from the app's log)."""
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints" / "step_0000002"
    folder.mkdir(parents=True)
    (folder / "rank0.pt.tmp").symlink_to("/dev/full")
    proc = _app([*SMALL, "trainer.steps=2", f"hydra.run.dir={run_dir}"], tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    sentence = f"rank 0 failed: could not write the checkpoint file {folder / 'rank0.pt'}: No space left on device"
    said = [line for line in (out + err).splitlines() if line.startswith("rank 0 failed")]
    assert said == [sentence], out + err
    assert "Traceback" not in out + err, out + err
    assert (run_dir / "train.log").read_text().count(sentence) == 1
    record = json.loads((run_dir / "failure.json").read_text())
    assert record["rank"] == 0 and "No space left on device" in record["error"]
    assert not (run_dir / "summary.json").exists()


@pytest.mark.parametrize("module,override,start", [
    ("pipeflow.simulate", "pipeline.stagez=3", "pipeline.stagez=3: unknown key; pipeline has stages, "),
    ("pipeflow.plan", "trainer.steps=3", "trainer.steps=3: unknown key; the config has pipeline, plan, "),
])
def test_every_app_refuses_an_unknown_key_in_one_line(module, override, start, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    proc = subprocess.run([sys.executable, "-m", module, override, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(start) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("module", ["pipeflow.train", "pipeflow.simulate", "pipeflow.plan"])
def test_two_misspelt_keys_at_once_are_both_named_in_one_line(module, tmp_path):
    """Issue 60: with two unknown keys Hydra's own 8-line error came through, advising
    a `+` that is then refused too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    proc = subprocess.run([sys.executable, "-m", module, "pipeline.microbatchez=3", "model.n_layr=2",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("pipeline.microbatchez=3: unknown key; pipeline has "), err
    assert "(did you mean pipeline.microbatches?); model.n_layr=2: unknown key; model has " in err, err
    assert err.endswith("(did you mean model.n_layer?)") and "+" not in err, err


def test_a_claim_appears_with_its_pid_in_it(tmp_path):
    """A racing run reads a claim only once it names its run: one made empty and written
    after (as before) read as a dead run's, and two runs took one folder (seen once in CI)."""
    path = claim_run_dir(str(tmp_path))
    assert path.read_text() == f"{os.getpid()}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [CLAIM]  # nothing left aside
    with pytest.raises(ConfigError, match="holds another run's metrics.jsonl"):
        (tmp_path / "metrics.jsonl").write_text("")
        claim_run_dir(str(tmp_path))
