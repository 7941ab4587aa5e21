"""A schedule from the user's own folder, added the documented way (docs/adding-a-schedule.md):
a generator module and a YAML naming it by path, outside the repository, with no file of
pipeflow edited. The real command-line apps simulate it, export it for torch, and train
it on 2 CPU ranks to the single-device gradients."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation, schedule_options

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

GENERATOR = '''
"""1F1B with twice the warm-up: more microbatches in flight, the same bubble."""
from pipeflow.schedules.common import check_basic, finish_sync, warmup_alternate_drain
from pipeflow.schedules.ir import Action, Kind, Placement, StageGraph


def double_warmup(stages: int, microbatches: int, factor: int = 2):
    """1F1B whose stage r warms up with factor * (p - r - 1) forwards."""
    check_basic("double_warmup", stages, microbatches)
    p, m = stages, microbatches
    orders = [warmup_alternate_drain(m, factor * (p - r - 1), lambda k, r=r: Action(Kind.F, r, k),
                                     lambda k, r=r: Action(Kind.B, r, k)) for r in range(p)]
    return finish_sync("double_warmup", StageGraph.chain(p), Placement.single(range(p)), orders, m)


def _assemble(cfg):
    """ZB-H1, sized from the whole run's configuration (as the planner's schedule is)."""
    from pipeflow.schedules.registry import build_schedule

    import dataclasses

    sched = build_schedule("zb_h1", cfg.pipeline.stages, cfg.pipeline.microbatches, check=False)
    return dataclasses.replace(sched, name="assembled_zb")  # (a schedule is frozen: a renamed copy)


from pipeflow.schedules.spec import ScheduleSpec  # noqa: E402

ASSEMBLED = ScheduleSpec("assembled_zb", None, "ZB-H1 assembled from the run's configuration", assemble=_assemble)
'''


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    """<tmp>/my_schedules.py and <tmp>/conf/schedule/double_warmup.yaml."""
    root = tmp_path_factory.mktemp("user")
    (root / "my_schedules.py").write_text(GENERATOR)
    (root / "conf" / "schedule").mkdir(parents=True)
    (root / "conf" / "schedule" / "double_warmup.yaml").write_text(textwrap.dedent(f"""\
        # my own schedule: 1F1B with a deeper warm-up
        name: double_warmup
        generator: {root / 'my_schedules.py'}:double_warmup
        factor: 2
        """))
    return root


def _app(module: str, user_folder: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, "--config-dir", str(user_folder / "conf"), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=user_folder)


def test_simulate_and_export_a_users_schedule(user_folder, tmp_path):
    out = tmp_path / "sim"
    proc = _app("pipeflow.simulate", user_folder, "schedule=double_warmup", "pipeline.stages=4",
                "pipeline.microbatches=8", "cost=unit", "draw=false", "export=torch_csv", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schedule"] == "double_warmup"
    # unit costs: the same bubble as 1F1B, (p - 1) / (m + p - 1)
    assert summary["bubble_ratio"] == pytest.approx(3 / 11)
    rows = list(csv.reader((out / "schedule.csv").open()))
    # device 0 warms up with 2 * (4 - 1) = 6 forwards, then runs one more before its first backward
    first_backward = next(i for i, cell in enumerate(rows[0]) if "B" in cell)
    assert first_backward == 7 and rows[0][first_backward] == "0B0", rows[0][:9]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The single-device run both training tests compare with (2 steps, gradients dumped)."""
    return pipeline_runs.train(tmp_path_factory.mktemp("ref"), [*pipeline_runs.GPT_SMALL, "pipeline.stages=1",
                                                                "trainer.steps=2", "runtime.dump_grads=true"],
                               tied=pipeline_runs.GPT_TIED)


def test_train_a_users_schedule_to_the_single_device_gradients(user_folder, tmp_path, reference):
    small = [o for o in pipeline_runs.GPT_SMALL]
    ref = reference
    out = tmp_path / "train"
    proc = _app("pipeflow.train", user_folder, "schedule=double_warmup", "pipeline.stages=2", "trainer.steps=2",
                "runtime.dump_grads=true", *small, f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got: dict[str, list[torch.Tensor]] = {}
    for f in sorted((out / "grads").glob("rank*.pt")):
        for key, g in torch.load(f).items():
            name = key.split(":", 1)[1]
            got.setdefault(pipeline_runs.GPT_TIED.get(name, name), []).append(g)
    pipeline_runs.assert_same_grads(got, ref["grads"])
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(ref["losses"], rel=1e-4)
    assert json.loads((out / "summary.json").read_text())["schedule"] == "double_warmup"


def test_a_users_schedule_options_are_checked(user_folder):
    gen = f"{user_folder / 'my_schedules.py'}:double_warmup"
    assert schedule_options({"name": "double_warmup", "generator": gen, "factor": 3}) == {"factor": 3}
    with pytest.raises(ConfigError, match=r"^schedule\.warmup=1: schedule 'double_warmup' has no option 'warmup'; "
                                          r"its options: factor$"):
        schedule_options({"name": "double_warmup", "generator": gen, "warmup": 1})
    with pytest.raises(ConfigError, match=r"^schedule\.factor=two: .* takes an int"):
        schedule_options({"name": "double_warmup", "generator": gen, "factor": "two"})
    with pytest.raises(ConfigError, match=r"^schedule\.generator=.*nothere\.py:f: no such file"):
        schedule_options({"name": "mine", "generator": str(user_folder / "nothere.py") + ":f"})
    with pytest.raises(ConfigError, match=r"^schedule\.name=1f1b: a built-in schedule"):
        schedule_options({"name": "1f1b", "generator": gen})


def test_a_users_yaml_found_through_the_search_path(user_folder):
    cfg = compose("simulate", ["schedule=double_warmup", f"hydra.searchpath=[file://{user_folder / 'conf'}]",
                               "pipeline.stages=2", "pipeline.microbatches=4", "cost=unit"])
    inputs = prepare_simulation(cfg)
    assert inputs.schedule.name == "double_warmup"
    assert [str(a) for a in inputs.schedule.orders[0][:3]] == ["0F0", "0F1", "0F2"]


def test_a_users_assembled_schedule_trains_and_each_rank_runs_what_was_validated(user_folder, tmp_path, reference):
    """A user's spec with ``assemble`` (offered by pipeflow/schedules/spec.py) trains on 2
    ranks to the single-device gradients: the ranks run the run plan's schedule and never
    generate one themselves (they used to, and failed on every rank with a TypeError). The
    measured timeline shows each rank running exactly the actions the up-front check
    validated, in its order."""
    from pipeflow.schedules.ir import Kind
    from pipeflow.formats.timeline import Timeline

    small = [*pipeline_runs.GPT_SMALL, "trainer.steps=2", "runtime.dump_grads=true"]
    ref = reference
    run = pipeline_runs.train(tmp_path / "run", [*small, "schedule.name=assembled_zb", "pipeline.stages=2",
                                                 f"schedule.generator={user_folder / 'my_schedules.py'}:ASSEMBLED",
                                                 "trainer.timeline_step=1"], tied=pipeline_runs.GPT_TIED)
    pipeline_runs.assert_same_grads(run["grads"], ref["grads"])
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-4) and run["summary"]["schedule"] == "assembled_zb"
    validated = run["schedule"]
    assert any(a.kind == Kind.W for a in validated.orders[0])  # ZB-H1's split backward, as assembled
    timeline = Timeline.load(tmp_path / "run" / "timeline.json")
    for device, order in enumerate(validated.orders):
        ran = sorted((e for e in timeline.events if e.device == device and e.stream == "compute"),
                     key=lambda e: e.start)
        assert [e.name for e in ran] == [str(a) for a in order]  # the step (S) too
