"""The planner's plans train for real: schedule=planned (partition=planner) on local CPU
ranks, planned at start-up or read from a plan.json, with data-parallel replicas of
the pipeline, computes exactly the single-device gradient."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_training
from pipeflow.planning.planner import plan
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.topology.presets import get_topology

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "trainer.steps=3", "runtime.dump_grads=true"]
TIED = pipeline_runs.GPT_TIED


def train(run_dir: Path, *overrides: str) -> dict:
    return pipeline_runs.train(run_dir, [*SMALL, *overrides], tied=TIED)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "pipeline.stages=1")


def _same_gradients(run, reference):
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


def test_a_plan_made_at_start_up_trains_like_one_device(reference, tmp_path):
    run = train(tmp_path, "schedule=planned", "partition=planner", "pipeline.stages=2")
    assert run["schedule"].name == "planned" and "plan" in run["schedule"].meta and run["schedule"].layers_per_stage
    _same_gradients(run, reference)


def test_a_plan_file_with_replicas_trains_like_one_device(reference, tmp_path):
    cfg = compose("train", [*SMALL, "pipeline.stages=4"])
    spec = TransformerSpec.from_config(cfg.model)
    p = plan(spec, get_topology("local_cpu", 4), 4, 2, num_stages=2, replicas=2)
    assert p.replicas == 2 and p.num_stages == 2
    path = tmp_path / "plan.json"
    path.write_text(p.to_json())
    run = train(tmp_path / "run", "schedule=planned", f"schedule.plan={path}", "pipeline.stages=4")
    assert run["schedule"].placement.num_pipes == 2
    # the summary (and so pipeflow-compare) says the plan's stages and replicas apart
    assert (run["summary"]["stages"], run["summary"]["data_parallel"], run["summary"]["world_size"]) == (2, 2, 4)
    assert len(run["grads"]["h.0.attn.c_attn.weight"]) == 2  # both replicas report the reduced gradient
    _same_gradients(run, reference)


def test_planned_config_errors(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"^schedule\.plan=.*not a plan\.json"):
        prepare_training(compose("train", [*SMALL, "schedule=planned", f"schedule.plan={bad}"]))
    with pytest.raises(ConfigError, match=r"^partition\.name=planner: .* use it with schedule=planned"):
        prepare_training(compose("train", [*SMALL, "partition=planner"]))
    with pytest.raises(ConfigError, match=r"^schedule\.memory_limit_gb=1e-06: .* GB over"):
        prepare_training(compose("train", [*SMALL, "schedule=planned", "schedule.memory_limit_gb=0.000001"]))
