"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run where a GPU is visible and are skipped elsewhere, saying so."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none is visible here (tests/test_device_paths.py runs "
                                   "CUDA's code paths on CPU)")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """A W&B environment with no credentials, no WANDB_MODE and its files under tmp_path."""
    import wandb

    wandb.teardown()  # a service left by an earlier test would carry its own settings
    for key in list(os.environ):
        if key.startswith("WANDB_"):
            monkeypatch.delenv(key)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    yield home
    wandb.teardown()  # also drops WANDB_SERVICE, so later subprocesses start their own


@pytest.fixture(scope="session")
def schedule_sweep(tmp_path_factory):
    """``pipeflow-train -m`` over three schedules (one asynchronous), through the real
    app, once for the session: its multirun folder. W&B logs offline, as it does with no
    credentials (HOME and W&B's folders under the sweep's root): test_compare reads the
    runs, test_tracking the sweep's W&B group."""
    import subprocess
    import sys

    from pipeline_runs import SWEEP_ARGS, SWEEP_SCHEDULES

    root = tmp_path_factory.mktemp("schedule_sweep")
    home = root / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_")) and k != "NETRC"}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"),
               WANDB_DATA_DIR=str(home / "data"), WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, "-m", "pipeflow.train", "-m", f"schedule={','.join(SWEEP_SCHEDULES)}",
                           *SWEEP_ARGS, f"hydra.sweep.dir={root / 'multirun'}"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "multirun"

