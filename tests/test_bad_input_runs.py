"""Bad input on the newer surfaces (issue 33), continued: runs that train nothing and
how pipeflow-compare shows them, compare's labels, the search's progress and units, a
schedule file far larger than the run, what a resumed run records of its data, and the
refusals of plan and compare, each met as a user meets it (the app as a subprocess, on
real files)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from test_bad_input import _app, _refused, slow


# gpt_tiny cut small: what these runs show (a loss gone non-finite, every update skipped)
# holds at any size, and fp16 on CPU ranks is slow
SHAPE = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.seq_len=32", "pipeline.microbatches=2",
         "pipeline.microbatch_size=2", "trainer.timeline_step=null"]


def _train(tmp_path_factory, name: str, args: list[str]):
    run = tmp_path_factory.mktemp("runs") / name
    proc = _app("pipeflow.train", [*SHAPE, *args, "logger=none", f"hydra.run.dir={run}"], run.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """gpt_tiny at a learning rate that sends its loss to inf after the first update."""
    return _train(tmp_path_factory, "diverged", ["trainer.steps=3", "optim.lr=1e9"])


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    """fp16 with a loss scale every step overflows at: each step's update skipped."""
    return _train(tmp_path_factory, "skipped", ["trainer.steps=2", "precision=fp16", "runtime.loss_scale=1e300"])


@slow
def test_a_diverged_run_says_so_and_its_metrics_stay_strict_json(diverged):
    """A loss gone non-finite was written as NaN (not JSON: strict readers refuse the
    file) and the run ended "finished"."""
    run, said = diverged
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at"] == 2, summary
    assert "the loss is not finite from step 2: the run diverged" in said

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    rows = [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] is None for r in rows] == [False, True, True]
    json.loads((run / "summary.json").read_text(), parse_constant=refuse)


@slow
def test_a_run_whose_every_update_was_skipped_says_nothing_was_trained(skipped):
    """fp16 with a loss scale every step overflows at: each step skipped, and the run
    ended "finished"."""
    run, said = skipped
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["skipped_steps"]) == ("no_updates", 2), summary
    assert "every step's gradients overflowed and were skipped: nothing was trained" in said


@slow
def test_compare_shows_a_run_that_trained_nothing_as_such(diverged, skipped, tmp_path):
    """Both were listed "finished" beside runs that trained, and the diverged one set
    the target loss."""
    from test_compare import cfg, write_run

    good = write_run(tmp_path, "good", cfg("1f1b"), [2.0, 1.0])
    out = tmp_path / "report"
    proc = _app("pipeflow.compare.cli", [str(diverged[0]), str(skipped[0]), str(good), f"out={out}"], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if "trained nothing usable" in line]
    assert len(said) == 1 and said[0].startswith("2 of 3 runs ran to the end and trained nothing usable: "), said
    assert "diverged (diverged: the loss is not finite from step 2); " in said[0]
    assert said[0].endswith("skipped (no_updates: every step's update was skipped (2 steps): the fp16 gradients "
                            "overflowed at every loss scale, nothing was trained)"), said
    assert "did not finish" not in proc.stdout
    rows = {Path(r["run"]).name: r for r in csv.DictReader(open(out / "runs.csv"))}
    assert {k: r["status"] for k, r in rows.items()} == {"diverged": "diverged", "skipped": "no_updates",
                                                          "good": "finished"}
    assert rows["diverged"]["final_loss"] == ""  # not its last finite loss
    # the finished run's smoothed final loss (mean of 2.0 and 1.0), not an untrained one's (above 5)
    assert float(rows["good"]["target_loss"]) == 1.5
    page = (out / "report.html").read_text()
    assert "Ran to the end and trained nothing usable:" in page and '<tr class="diverged">' in page


@slow
def test_compare_labels_name_files_by_what_tells_them_apart(tmp_path):
    """Labels read config=/long/path/x.json, weights=/long/dir: the whole path of each."""
    from test_compare import cfg, write_run

    models = tmp_path / "models"
    for name, config, weights in (("a", "llama/config.json", "llama/step_100"),
                                  ("b", "qwen/config.json", "llama/step_200"),
                                  ("c", "qwen/config.json", "qwen/step_200")):
        write_run(tmp_path, f"runs/{name}", {**cfg("1f1b"), "model": {
            "name": "hf_causal", "config": str(models / config), "weights": str(models / weights)}}, [2.0, 1.0])
    proc = _app("pipeflow.compare.cli", [str(tmp_path / "runs"), f"out={tmp_path / 'report'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    labels = {r["run"]: r["label"] for r in csv.DictReader(open(tmp_path / "report" / "runs.csv"))}
    assert labels == {"a": "config=llama/config.json, weights=step_100",  # the one step_100: its name
                      "b": "config=qwen/config.json, weights=llama/step_200",
                      "c": "config=qwen/config.json, weights=qwen/step_200"}
    assert str(models) not in proc.stdout


@slow
def test_a_long_search_says_how_far_it_is_and_its_pick_in_one_unit(tmp_path):
    """search.global_batch=100000 ran over 90 s saying nothing; a step over 100 s was
    said "231.0s ms a step". search.progress=0 says a line at every chance (two workers:
    whenever the count moved), and each phase ends with its total."""
    run = tmp_path / "run"
    proc = _app("pipeflow.search", ["model=gpt_tiny", "topology=local_cpu", "search.devices=4", "precision=fp32",
                                    "search.global_batch=32768", "search.microbatch_sizes=[16,32]",
                                    "search.segments=[2]", "search.virtual_stages=[2]", "search.simulate=4",
                                    "search.workers=2", "search.progress=0", "draw=false", "logger=none",
                                    f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((run / "search.json").read_text())
    lines = proc.stdout.splitlines()
    for phase, total in (("closed form", doc["considered"]), ("simulated", doc["simulated"])):
        said = [line for line in lines if line.startswith(f"search: {phase} ")]
        counts = [int(line.split()[2 + phase.count(" ")].replace(",", "")) for line in said]
        assert said and counts == sorted(counts), said
        assert said[-1].startswith(f"search: {phase} {total:,} of {total:,} candidates (100%), "), said
        assert "; fastest that fits so far " in said[-1]
    logged = (run / "search.log").read_text()
    assert f"] search: closed form {doc['considered']:,} of {doc['considered']:,} candidates (100%)" in logged
    pick = next(line for line in lines if line.startswith("pick"))
    step = doc["pick"]["step_time"]
    assert step > 100 and f": {step:,.0f} s a step, " in pick and "ms" not in pick, pick


HUGE = {  # (the file's lines, the sentence): far more devices, or far more actions on a line, than the run needs
    "200,000 device lines": (["0F0,0F1,0B0,0B1", "1F0,1F1,1B0,1B1"] * 100_000,
                             "200,000 device lines, far more than the 2 of this run (pipeline.stages=2)"),
    "a line of 400,000 cells": ([",".join(f"{d}F{m}" for m in range(200_000)) + "," + ",".join(
        f"{d}B{m}" for m in range(200_000)) for d in (0, 1)],
        "line 1 holds 400,000 cells, far more than this run can need (12 actions in all: "),
}


@slow
@pytest.mark.parametrize("case", list(HUGE))
def test_a_schedule_file_far_larger_than_the_run_is_refused_before_it_is_read(case, tmp_path):
    """A 200,000-line (40 MB) file took 40 s to refuse, in a 1.46 MB line listing every
    device; its size is compared with what the run can need before any cell is read."""
    lines, sentence = HUGE[case]
    path = tmp_path / "huge.csv"
    path.write_text("\n".join(lines) + "\n")
    err = _refused("pipeflow.train", ["schedule=file", f"schedule.path={path}", "pipeline.microbatches=2",
                                      "trainer.steps=1"], tmp_path)
    assert err.startswith(f"schedule.path={path}: {sentence}"), err
    assert len(err) < 400


@slow
@pytest.mark.parametrize("args, sentence", [
    (["plan.memory_limit_gb=-1"], "plan.memory_limit_gb=-1.0: must be a number > 0"),
    (["plan.memory_limit_gb=0.001", "baselines=false"],  # refused after planning, as the planner found it
     "plan.memory_limit_gb=0.001: model 'gpt_1.5b' does not fit in 0.001 GB per device"),
], ids=["before planning", "after planning"])
def test_a_refused_plan_leaves_no_run_folder(args, sentence, tmp_path):
    assert _refused("pipeflow.plan", args, tmp_path).startswith(sentence)


@slow
@pytest.mark.parametrize("args, sentence", [
    (["{run}", "{tmp}/nowhere", "out={tmp}/new/report"], "pipeflow-compare: {tmp}/nowhere: no such directory"),
    (["{run}", "smooth=0"], "pipeflow-compare: smooth=0: must be 1 or more (1: no smoothing)"),
], ids=["a folder that is not there", "a bad setting"])
def test_a_refused_comparison_leaves_no_report_folder(args, sentence, tmp_path):
    """Its report folder (out=, or outputs/compare/<date>/<time> under the current
    folder) is made only once every run is read."""
    from test_compare import cfg, write_run

    run = write_run(tmp_path, "runs/a", cfg("1f1b"), [2.0, 1.0])
    proc = _app("pipeflow.compare.cli", [a.format(run=run, tmp=tmp_path) for a in args], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == sentence.format(tmp=tmp_path), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl", "summary.json"]
