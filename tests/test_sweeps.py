"""The ready-made sweeps in sweeps/: every job of every sweep composes and passes its
app's up-front check (no training, no simulation), each file names its own command, and
a simulation sweep with logger=wandb is one W&B group of offline runs that hold the
simulated numbers.

A sweep file is composed the way ``pipeflow-<app> -m --config-dir sweeps --config-name
<file>`` composes it: sweeps/ and conf/ both on the search path.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from pipeflow.config import CONF_DIR, compose as compose_conf, prepare_simulation, prepare_training
from pipeflow.plan import compose_plan, prepare_plan, register_plan_configs, run_plan
from pipeflow.tracking.labels import logger_labels
from test_tracking import of_type, offline_run_file, wandb_records

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

SWEEPS = CONF_DIR.parent / "sweeps"
SWEEP_FILES = sorted(SWEEPS.glob("*.yaml"))
# the keys pipeflow-compare reads from a simulated run's summary.json
SIMULATED_KEYS = ("kind", "schedule", "stages", "microbatches", "makespan", "bubble_ratio", "peak_activation_bytes",
                  "per_device", "model", "cost", "topology")


def app_of(path: Path) -> str:
    """The app a sweep file is for: the config its defaults start from (train, simulate, plan)."""
    return OmegaConf.load(path).defaults[0]


def sweep_jobs(path: Path) -> list[list[str]]:
    """The overrides of every job of the sweep, as Hydra's basic sweeper expands its
    ``hydra.sweeper.params`` (the cartesian product of the values)."""
    params = OmegaConf.load(path).hydra.sweeper.params
    parser = OverridesParser.create()
    axes = []
    for key, values in params.items():
        (override,) = parser.parse_overrides([f"{key}={values}"])
        choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [str(values)]
        axes.append([f"{key}={v}" for v in choices])
    return [list(job) for job in itertools.product(*axes)]


def compose_job(path: Path, overrides: list[str]):
    register_plan_configs()  # also the train and simulate schemas
    extra = f",file://{searched()}" if path.stem == "search_top" else ""
    with initialize_config_dir(config_dir=str(SWEEPS), version_base="1.3"):
        return compose(path.stem, overrides=[f"hydra.searchpath=[file://{CONF_DIR}{extra}]", *overrides])


_SEARCHED: list[Path] = []


def searched() -> Path:
    """A search's output folder (its candidate/c1..c8.yaml), for sweeps/search_top.yaml:
    gpt_tiny over 4 CPU ranks, written once per session."""
    if not _SEARCHED:
        import tempfile

        from pipeflow.search import compose_search, run_search

        out = Path(tempfile.mkdtemp(prefix="pipeflow-search-"))
        run_search(compose_search(["model=gpt_tiny", "topology=local_cpu", "search.devices=4", "precision=fp32",
                                   "search.global_batch=8", "search.workers=1", "search.simulate=8", "draw=false"]),
                   out)
        _SEARCHED.append(out)
    return _SEARCHED[0]


PREPARE = {"train": prepare_training, "simulate": prepare_simulation, "plan": prepare_plan}


def test_every_sweep_is_for_an_app():
    assert {p.stem for p in SWEEP_FILES} >= {"simulate_schedules", "train_async", "train_schedules", "train_depth",
                                            "train_amdp_accumulation", "train_seq1f1b_segments", "plan_topologies"}
    for path in SWEEP_FILES:
        assert app_of(path) in PREPARE, path.name


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_the_header_gives_the_one_command(path):
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    command = f"pipeflow-{app_of(path)} -m --config-dir sweeps --config-name {path.stem}"
    assert any(line.strip("# ").startswith(command) for line in header), f"{path.name}: no '{command}' line"


@pytest.mark.parametrize("path", SWEEP_FILES, ids=lambda p: p.stem)
def test_every_job_composes_and_passes_the_check(path):
    app = app_of(path)
    jobs = sweep_jobs(path)
    assert len(jobs) > 1
    for job in jobs:
        cfg = compose_job(path, job)
        PREPARE[app](cfg)  # raises ConfigError for a job the app would refuse
        if app != "train":  # the training sweeps log to W&B by train.yaml's default
            assert cfg.logger.name == "wandb", f"{path.name}: a simulation sweep is one W&B group"


def test_training_sweeps_are_short():
    """A few minutes on a 2-core laptop: tens of steps per run, not train.yaml's 300."""
    for path in SWEEP_FILES:
        if app_of(path) == "train" and path.stem != "train_async":
            cfg = compose_job(path, sweep_jobs(path)[0])
            assert cfg.trainer.steps <= 60 and cfg.trainer.val_every > 0 and cfg.trainer.timeline_step, path.name


def test_sweep_group_is_named_after_the_sweep_file():
    logger = compose_conf("simulate", ["logger=wandb"]).logger
    hydra_cfg = OmegaConf.create({
        "sweep": {"dir": "outputs/multirun/simulate/2026-11-21/12-00-00"},
        "job": {"name": "simulate", "config_name": "simulate_schedules"},
        "overrides": {"task": ["logger=wandb", "schedule=gpipe", "pipeline.microbatches=4", "hydra.verbose=true"]},
        "runtime": {"output_dir": "outputs/multirun/simulate/2026-11-21/12-00-00/0_pipeline.microbatches=4"},
    })
    hydra_cfg.mode = RunMode.MULTIRUN
    labels = logger_labels(logger, hydra_cfg)
    assert labels["group"] == "simulate_schedules-2026-11-21_12-00-00"
    assert labels["tags"] == ["schedule=gpipe", "pipeline.microbatches=4"]  # how it is logged is no tag


# --------------------------------------------------------------------- simulated runs


def test_simulate_summary_says_simulated(tmp_path):
    from pipeflow.simulate import run_simulation

    summary = run_simulation(compose_conf("simulate", ["cost=unit", "draw=false"]), tmp_path)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kind"] == on_disk["kind"] == "simulated"
    assert compose_conf("simulate").logger.name == "none"  # a single run logs nowhere unless asked


@pytest.mark.parametrize("method", ["planner", "uniform"])
def test_plan_writes_a_simulated_summary_for_its_method(tmp_path, method):
    cfg = compose_plan(["model=gpt_tiny", "topology=pcie_8", "pipeline.microbatches=4", f"plan.method={method}",
                        "baselines=false", "draw=false"])
    result = run_plan(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in SIMULATED_KEYS:
        assert key in summary, key
    assert summary["kind"] == "simulated" and summary["method"] == method
    assert summary["makespan"] == pytest.approx(result["plan"].predicted_iteration_time)
    assert len(summary["per_device"]) == summary["stages"] * summary["replicas"]  # the devices the plan uses
    assert 0 <= summary["bubble_ratio"] < 1 and summary["topology"]["name"] == "pcie_8"
    if method == "uniform":  # as many stages as layers and devices allow, stage i on device i
        assert summary["placement"] == [[0, 1, 2, 3]] and summary["layers_per_stage"] == [1, 1, 1, 1]


def _wandb_env(tmp_path: Path) -> dict:
    """The environment of a subprocess that logs to W&B offline, with no credentials and
    its W&B files under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    home = tmp_path / "home"
    home.mkdir()
    env.update(HOME=str(home), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home / "config"),
               WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))
    env.pop("NETRC", None)
    return env


def _records(run_dir: Path) -> tuple:
    """(run record, config, summary) of the offline W&B run in run_dir."""
    records = wandb_records(offline_run_file(run_dir))
    run = of_type(records, "run")[0]
    config = {i.key: json.loads(i.value_json) for c in of_type(records, "config") for i in c.update}
    config.update({i.key: json.loads(i.value_json) for i in run.config.update})
    summary = {}
    for s in of_type(records, "summary"):
        summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in s.update})
    return run, config, summary


def test_simulate_sweep_with_wandb_is_one_group_of_offline_runs(tmp_path):
    script = Path(sys.executable).with_name("pipeflow-simulate")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "pipeflow.simulate"]
    sweep = tmp_path / "multi"
    proc = subprocess.run(
        cli + ["-m", "schedule=gpipe,1f1b", "logger=wandb", "cost=unit", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=_wandb_env(tmp_path), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2
    groups = set()
    for job in jobs:
        on_disk = json.loads((job / "summary.json").read_text())
        assert on_disk["kind"] == "simulated"
        assert not (job / "metrics.jsonl").exists()  # a simulation logs no steps
        run, config, summary = _records(job)
        groups.add(run.run_group)
        assert run.display_name == job.name and f"schedule={on_disk['schedule']}" in run.tags
        assert config["schedule"]["name"] == on_disk["schedule"] and config["cost"]["name"] == "unit"
        assert config["logger"]["group"] == run.run_group
        assert summary["kind"] == "simulated"
        assert summary["makespan"] == pytest.approx(on_disk["makespan"])
        assert summary["bubble_ratio"] == pytest.approx(on_disk["bubble_ratio"])
        assert summary["timeline/_type"] == "image-file"
        assert list(job.glob("wandb/offline-run-*/files/media/images/timeline_*.png"))
    assert groups == {"simulate-multi"}
