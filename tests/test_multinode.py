"""Two torchrun "nodes" on this machine (c10d rendezvous on localhost, one rank each),
as a multi-node job runs (issue 18): the same losses as the local launcher, and a rank
that fails on one node ends both, with failure.json in the run folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeflow.runtime.launch import free_port

pytestmark = pytest.mark.slow  # subprocesses of the real app

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.seq_len=32", "pipeline.microbatches=2",
         "pipeline.microbatch_size=2", "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null",
         "logger=none"]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}


def _two_nodes(tmp_path: Path, *args: str) -> list[subprocess.CompletedProcess]:
    port = free_port()
    cmd = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
           f"--rdzv-id=pipeflow-{port}", "-m", "pipeflow.train", *SMALL, *args]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    out = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(cmd, node.returncode, stdout, stderr))
    return out


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory) -> list[float]:
    """The same job through the local launcher: the losses both multi-node ways must give."""
    root = tmp_path_factory.mktemp("local")
    local = subprocess.run([sys.executable, "-m", "pipeflow.train", *SMALL, "trainer.steps=4",
                            f"hydra.run.dir={root / 'local'}"], cwd=root, env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-2000:]
    return _losses(root / "local")


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed beside this Python")
def test_two_torchrun_nodes_train_as_the_local_launcher_does(tmp_path, local_losses):
    nodes = _two_nodes(tmp_path, "trainer.steps=4", f"hydra.run.dir={tmp_path / 'nodes'}")
    assert [n.returncode for n in nodes] == [0, 0], [n.stderr[-2000:] for n in nodes]
    assert _losses(tmp_path / "nodes") == local_losses
    assert json.loads((tmp_path / "nodes" / "summary.json").read_text())["world_size"] == 2


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed beside this Python")
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_rank_failing_on_one_node_ends_both_with_failure_json(mode, tmp_path):
    """A Python error on node 1's rank is recorded by that rank; a rank killed outright
    (SIGKILL) writes nothing, so its peer on the other node records that it lost it."""
    run_dir = tmp_path / "run"
    nodes = _two_nodes(tmp_path, "trainer.steps=200", "runtime.fail_at_step=3", "runtime.fail_rank=1",
                       f"runtime.fail_mode={mode}", f"hydra.run.dir={run_dir}")
    assert [n.returncode for n in nodes] == [1, 1]
    record = json.loads((run_dir / "failure.json").read_text())
    if mode == "raise":
        assert record["rank"] == 1 and "injected failure on rank 1 at step 3" in record["error"]
    else:
        assert record["rank"] == 0 and "lost its connection to another rank" in record["error"]
    assert not (run_dir / "summary.json").exists()


def test_two_slurm_tasks_take_their_ranks_from_slurm_and_train_as_the_local_launcher_does(tmp_path, local_losses):
    """srun starts one task per rank and sets SLURM_PROCID, SLURM_STEP_NUM_TASKS, ... but
    none of torchrun's variables: each task adopts its rank from Slurm's (set here by the
    test, as srun would)."""
    port = free_port()
    tasks = []
    for r in range(2):
        env = dict(_env(), SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                   SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost", MASTER_PORT=str(port))
        tasks.append(subprocess.Popen([sys.executable, "-m", "pipeflow.train", *SMALL, "trainer.steps=4",
                                       f"hydra.run.dir={tmp_path / 'slurm'}"], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], [err[-2000:] for _, err in results]
    assert _losses(tmp_path / "slurm") == local_losses
