"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest


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
