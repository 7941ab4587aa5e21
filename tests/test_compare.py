"""pipeflow-compare: a real CPU sweep across three schedules (one of them asynchronous),
a crashed run and simulated runs, compared into one report; and the pieces it is made
of (run discovery, labels, time-to-target, seeds, settings) on run folders written here."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline_runs
from pipeflow.compare.cli import CompareConfig, CompareConfigError, compare, main, parse_args
from pipeflow.compare.runs import CompareInputError, find_runs
from pipeflow.compare.table import group_table, run_table, series, smoothed, target_loss
from pipeflow.config import compose
from pipeflow.runtime.launch import JobFailed
from pipeflow.simulate import run_simulation

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.seq_len=32", "pipeline.microbatches=4",
        "pipeline.microbatch_size=2", "trainer.steps=6", "trainer.val_every=3", "trainer.val_batches=1",
        "trainer.timeline_step=2", "data.max_bytes=200000", "logger=none"]
SCHEDULES = pipeline_runs.SWEEP_SCHEDULES  # the sweep the session trains (conftest.py)


def last_losses(run_dir: Path) -> list[float]:
    """The run's own record, read without pipeflow.compare."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sweep(schedule_sweep) -> Path:
    """pipeflow-train -m over three schedules, through the real app (conftest.py)."""
    return schedule_sweep


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """A run whose rank 1 fails at step 4: three steps logged, no summary."""
    run_dir = tmp_path_factory.mktemp("crashed")
    with pytest.raises(JobFailed):
        pipeline_runs.train(run_dir, [*TINY, "schedule=chimera", "runtime.fail_at_step=4", "runtime.fail_rank=1"])
    return run_dir


def test_a_multirun_is_one_wandb_group_with_a_run_per_job(schedule_sweep):
    """pipeflow-train -m ...: three short jobs on two CPU ranks each (the session's sweep,
    conftest.py); every job's run folder has its files, and its offline W&B run carries
    the sweep's group, the job's overrides as tags and the job folder as name. (Here,
    beside the compare tests of the same sweep: a file's tests share one worker, which
    runs the sweep once.)"""
    from test_tracking import of_type, offline_run_file, wandb_records

    from pipeflow.formats.timeline import Timeline
    from pipeflow.tracking import read_metrics
    from pipeline_runs import SWEEP_SCHEDULES

    jobs = sorted((p for p in schedule_sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("_")[0]))
    assert [j.name.split("_", 1)[0] for j in jobs] == ["0", "1", "2"]
    for job, schedule in zip(jobs, SWEEP_SCHEDULES):
        assert [r["step"] for r in read_metrics(job)] == [1, 2, 3, 4, 5, 6]
        assert json.loads((job / "summary.json").read_text())["schedule"] == schedule
        assert Timeline.load(job / "timeline.json").source == "measured"
        assert (job / "timeline.png").read_bytes()[:8] == PNG

        run = of_type(wandb_records(offline_run_file(job)), "run")[0]
        assert run.run_group == f"train-{schedule_sweep.name}" and run.display_name == job.name
        assert f"schedule={schedule}" in run.tags and "trainer.steps=6" in run.tags
        assert not any(t.startswith("hydra.") for t in run.tags)


def test_sweep_then_compare_writes_the_report_with_a_row_per_run(sweep, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "pipeflow.compare.cli", str(sweep), f"out={out}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("convergence.png", "throughput.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == PNG
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3  # self-contained: the figures are inside
    rows = list(csv.DictReader(open(out / "runs.csv")))
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("_")[0]))
    assert len(rows) == len(jobs) == 3
    for row, job, schedule in zip(rows, jobs, SCHEDULES):
        losses = last_losses(job)
        assert row["run"] == job.name and row["status"] == "finished"
        assert row["label"] == schedule and row["schedule"] == schedule  # only the schedule differs
        assert float(row["final_loss"]) == pytest.approx(losses[-1], rel=1e-5)
        assert float(row["best_loss"]) == pytest.approx(min(losses), rel=1e-5)
        summary = json.loads((job / "summary.json").read_text())
        assert float(row["tokens_per_s"]) == pytest.approx(summary["mean_tokens_per_s"], rel=1e-5)
        assert f'<td class="text label">{schedule}<span class="folder">' in page  # its folder under it
    # gpipe and 1f1b compute the same gradients: the same losses, hence the same row numbers
    assert rows[0]["final_loss"] == rows[1]["final_loss"]


def test_async_runs_are_placed_by_their_own_samples_and_updates(sweep):
    """PipeDream applies one update per microbatch: per step, 4 updates and 8 samples
    (microbatches 4 x 2 sequences). Samples and updates come from each run's log, and
    training time is the running sum of step times (validation left out)."""
    runs = {r.schedule: r for r in find_runs([sweep])}
    for name, per_step_updates in (("1f1b", 1), ("pipedream", 4)):
        run = runs[name]
        steps, _ = series(run, "step")
        assert series(run, "samples")[0] == [s * 8 for s in steps]
        assert series(run, "updates")[0] == [s * per_step_updates for s in steps]
        clock, expected = 0.0, []
        for row in run.rows:
            clock += row["step_time"]
            expected.append(clock)
        assert series(run, "time")[0] == pytest.approx(expected, rel=1e-9)
    table = {r["schedule"]: r for r in run_table(list(runs.values()), None, 1)}
    assert table["pipedream"]["updates"] == 6 * 4 and table["pipedream"]["samples"] == 6 * 8
    assert table["pipedream"]["max_staleness"] >= 1 and table["1f1b"]["max_staleness"] == 0
    # per step, as configured, though the asynchronous schedule's IR spans several steps
    assert runs["pipedream"].summary["microbatches"] == 4


def test_a_crashed_run_is_reported_with_what_it_logged(sweep, crashed, tmp_path):
    cut = tmp_path / "cut"  # killed from outside while writing: no summary, half a line
    cut.mkdir()
    lines = (next(sweep.glob("0_*")) / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    (cut / "config.json").write_text((next(sweep.glob("0_*")) / "config.json").read_text())
    never = tmp_path / "never"  # a job stopped before its first step
    (never / ".hydra").mkdir(parents=True)
    (never / ".hydra" / "config.yaml").write_text("schedule:\n  name: gpipe\nseed: 1\n")

    runs, table, report = compare([str(sweep), str(crashed), str(cut), str(never)],
                                  CompareConfig(out=str(tmp_path / "out")))
    rows = {r["run"].split("/")[-1]: r for r in table}
    assert len(table) == 6
    bad = rows[crashed.name]
    assert bad["status"] == "crashed" and "injected failure on rank 1 at step 4" in bad["note"]
    assert bad["steps"] == 3 and bad["steps_planned"] == 6
    assert bad["final_loss"] == pytest.approx(last_losses(crashed)[-1], rel=1e-6)
    assert rows["cut"]["status"] == "incomplete" and rows["cut"]["steps"] == 2
    assert rows["never"]["status"] == "empty" and rows["never"]["final_loss"] is None
    page = report.html.read_text()
    assert "crashed" in page and "injected failure" in page and "class=\"empty\"" in page
    assert report.figures["convergence"].read_bytes()[:8] == PNG


def test_simulated_runs_fill_the_simulated_columns(sweep, tmp_path):
    """A simulated run of the same configuration pairs with the measured one; an
    asynchronous simulation's makespan covers schedule.windows steps."""
    sims = {}
    for schedule in ("1f1b", "pipedream"):
        cfg = compose("simulate", [f"schedule={schedule}", "pipeline.stages=2", "pipeline.microbatches=4",
                                   "pipeline.microbatch_size=2", "model.n_layer=4", "model.n_embd=32", "model.n_head=2",
                                   "model.seq_len=32", "draw=false"])
        sims[schedule] = run_simulation(cfg, tmp_path / "sim" / schedule)
    runs, table, report = compare([str(sweep), str(tmp_path / "sim")], CompareConfig(out=str(tmp_path / "out")))
    by = {(r["kind"], r["schedule"]): r for r in table}
    one = sims["1f1b"]
    assert by[("simulated", "1f1b")]["sim_step_time"] == pytest.approx(one["makespan"])
    assert by[("simulated", "1f1b")]["sim_bubble"] == pytest.approx(one["bubble_ratio"])
    assert by[("measured", "1f1b")]["sim_step_time"] == pytest.approx(one["makespan"])
    measured = by[("measured", "1f1b")]
    assert measured["sim_over_measured"] == pytest.approx(one["makespan"] / measured["step_time_s"])
    # the simulator's deviation (cost=analytic: seconds), held to the 2-rank target
    assert measured["sim_error"] == pytest.approx((one["makespan"] - measured["step_time_s"]) / measured["step_time_s"])
    assert measured["sim_tolerance"] == 0.10
    assert (measured["sim_flag"] == "beyond ±10%") == (abs(measured["sim_error"]) > 0.10)
    assert (measured["sim_flag"] is not None) == any("1f1b" in c for c in report.cautions)
    pd = sims["pipedream"]
    assert pd["windows"] > 1
    assert by[("simulated", "pipedream")]["sim_step_time"] == pytest.approx(pd["makespan"] / pd["windows"])
    assert by[("measured", "gpipe")]["sim_step_time"] is None  # no simulation of it among the inputs
    assert "step_time" in report.figures
    groups = [(g["kind"], g["label"], g["runs"]) for g in group_table(runs, table)]
    # a measured and a simulated 1f1b share a label but are separate configurations
    assert ("measured", "1f1b", 1) in groups and ("simulated", "1f1b", 1) in groups



def test_a_simulation_of_another_precision_attention_or_topology_is_never_paired(sweep, tmp_path, capsys):
    """The measured 1f1b run trained in fp32 (precision=auto on local_cpu's CPUs), with
    the fused attention, on local_cpu: a simulation differing in one of these is no
    prediction of it, and the report says which field kept them apart; beside a
    simulation of the same configuration, that one is the partner."""
    sizes = ["schedule=1f1b", "pipeline.stages=2", "pipeline.microbatches=4", "pipeline.microbatch_size=2",
             "model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.seq_len=32", "draw=false"]
    cases = {"precision": (["precision=bf16"], "precision bf16, not fp32"),
             "attention": (["model.attention=eager"], "attention eager, not sdpa"),
             # auto would be bf16 on its GPUs: fp32 keeps the topology the one difference
             "topology": (["topology=dgx_a100_8", "precision=fp32"], "topology dgx_a100_8, not local_cpu")}
    measured = next(r for r in find_runs([sweep]) if r.schedule == "1f1b")
    for name, (differs, why) in cases.items():
        other = run_simulation(compose("simulate", [*sizes, *differs]), tmp_path / name / "sim")
        assert other["run_key"][name] == why.split()[1].rstrip(",")
        row = next(r for r in run_table([measured, *find_runs([tmp_path / name])], None, 1) if r["kind"] == "measured")
        assert row["sim_step_time"] is None and row["sim_run"] is None
        assert row["sim_unpaired"] == f"the nearest simulation differs in {why}"
    assert main([str(sweep), str(tmp_path / "precision"), f"out={tmp_path / 'out'}"]) == 0
    assert f"{measured.name}: the nearest simulation differs in precision bf16, not fp32" in capsys.readouterr().out
    same = run_simulation(compose("simulate", sizes), tmp_path / "same" / "sim")
    assert same["run_key"] == measured.summary["run_key"]
    table = run_table([measured, *find_runs([tmp_path])], None, 1)
    row = next(r for r in table if r["kind"] == "measured")
    assert row["sim_step_time"] == pytest.approx(same["makespan"]) and row["sim_unpaired"] is None


def write_run(root: Path, name: str, config: dict, losses: list[float], *, finished: bool = True,
              step_time: float = 0.5, samples_per_step: int = 8) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    rows = [{"step": s, "loss": loss, "step_time": step_time, "train_time": s * step_time,
             "samples": s * samples_per_step, "tokens_per_s": 100.0, "bubble": 0.2}
            for s, loss in enumerate(losses, 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (d / "summary.json").write_text(json.dumps({"kind": "measured", "mean_tokens_per_s": 100.0,
                                                    "peak_memory_bytes": [2**20, 2**21]}))
    return d


def cfg(schedule: str, seed: int = 1, **schedule_keys) -> dict:
    return {"schedule": {"name": schedule, **schedule_keys}, "seed": seed,
            "pipeline": {"stages": 2, "microbatches": 4, "microbatch_size": 2}, "trainer": {"steps": 4},
            "logger": {"name": "none", "group": f"g{seed}"}}


def test_labels_name_what_differs_and_seeds_repeat_a_configuration(tmp_path):
    write_run(tmp_path, "a", cfg("pipedream", 1, stash=True), [4.0, 3.0, 2.0, 1.0])
    write_run(tmp_path, "b", cfg("pipedream", 2, stash=True), [4.0, 3.0, 2.0, 2.0])
    write_run(tmp_path, "c", cfg("pipedream", 1, stash=False), [4.0, 3.5, 3.0, 2.5])
    write_run(tmp_path, "d", cfg("gpipe", 1, split=None), [4.0, 3.0, 2.5, 2.0])
    runs = find_runs([tmp_path])
    labels = {r.name: r.label for r in runs}
    # the seed and the logger never label; schedule.stash only between pipedream runs
    assert labels == {"a": "pipedream, stash=True", "b": "pipedream, stash=True", "c": "pipedream, stash=False",
                      "d": "gpipe"}
    table = run_table(runs, None, 1)
    groups = {g["label"]: g for g in group_table(runs, table)}
    seeds = groups["pipedream, stash=True"]
    assert seeds["runs"] == 2 and seeds["final_loss_mean"] == pytest.approx(1.5)
    assert seeds["final_loss_std"] == pytest.approx(0.7071068, rel=1e-6)
    assert groups["gpipe"]["final_loss_std"] is None and groups["gpipe"]["peak_memory_mib_max"] == pytest.approx(2.0)


def test_time_to_target_is_the_first_smoothed_loss_at_the_target(tmp_path):
    write_run(tmp_path, "fast", cfg("1f1b"), [5.0, 3.0, 2.0, 1.0, 1.0], step_time=1.0)
    write_run(tmp_path, "slow", cfg("gpipe"), [5.0, 4.0, 3.0, 3.0, 3.0], step_time=2.0)
    write_run(tmp_path, "dead", cfg("chimera"), [5.0, 4.8], finished=False)
    runs = find_runs([tmp_path])
    # smoothed over 2 steps: fast ends at 1.0, slow at 3.0; the target is the highest
    # final loss of a finished run, so both reach it; the unfinished run does not count
    assert smoothed([5.0, 3.0, 2.0], 2) == [5.0, 4.0, 2.5]
    assert target_loss(runs, 2) == pytest.approx(3.0)
    rows = {r["run"]: r for r in run_table(runs, 3.0, 2)}
    assert rows["fast"]["steps_to_target"] == 3 and rows["fast"]["time_to_target_s"] == pytest.approx(3.0)
    assert rows["fast"]["samples_to_target"] == 24
    assert rows["slow"]["steps_to_target"] == 4 and rows["slow"]["time_to_target_s"] == pytest.approx(8.0)
    assert rows["dead"]["status"] == "incomplete" and rows["dead"]["time_to_target_s"] is None


def test_seeds_are_drawn_as_a_mean_with_a_band(tmp_path):
    from pipeflow.compare.report import _aggregate

    write_run(tmp_path, "s1", cfg("1f1b", 1), [4.0, 2.0, 1.0])
    write_run(tmp_path, "s2", cfg("1f1b", 2), [6.0, 4.0])  # logged one step less
    runs = find_runs([tmp_path])
    xs, mean, lo, hi = _aggregate(runs, "step", 1)
    assert xs == [1.0, 2.0, 3.0] and mean == [5.0, 3.0, 1.0] and lo == [4.0, 2.0, 1.0] and hi == [6.0, 4.0, 1.0]


def test_bad_settings_and_paths_are_refused_by_name(tmp_path, capsys):
    write_run(tmp_path, "a", cfg("1f1b"), [1.0])
    with pytest.raises(CompareConfigError, match="unknown setting 'colour'; allowed: out, overwrite, report"):
        parse_args([str(tmp_path), "colour=red"])
    with pytest.raises(CompareConfigError, match="report=html: allowed values are local, wandb"):
        parse_args([str(tmp_path), "report=html"])
    with pytest.raises(CompareConfigError, match="smooth"):
        parse_args([str(tmp_path), "smooth=abc"])
    with pytest.raises(CompareInputError, match="nowhere: no such directory"):
        find_runs([str(tmp_path / "nowhere")])
    (tmp_path / "hollow" / "sub").mkdir(parents=True)
    with pytest.raises(CompareInputError, match="no run found"):
        find_runs([tmp_path / "hollow"])
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_report_wandb_offline_says_so_and_keeps_the_local_report(wandb_home, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    write_run(tmp_path, "runs/a", cfg("1f1b"), [2.0, 1.0])
    out = tmp_path / "out"
    assert main([str(tmp_path / "runs"), f"out={out}", "report=wandb"]) == 0
    said = capsys.readouterr().out
    assert "W&B is offline (WANDB_MODE=offline)" in said and "no W&B report" in said
    assert (out / "report.html").exists() and (out / "runs.csv").exists()
    monkeypatch.delenv("WANDB_MODE")  # and with no credentials at all (over the report just written)
    assert main([str(tmp_path / "runs"), f"out={out}", "report=wandb", "overwrite=true"]) == 0
    assert "W&B is offline (no W&B API key is configured)" in capsys.readouterr().out


def test_report_wandb_online_reports_the_runs_groups(tmp_path, capsys, monkeypatch):
    """Online (credentials found; the upload and the save stood in for): the offline runs
    are synced first, and the report shows the W&B groups the runs were logged in."""
    from pipeflow.compare import cli
    from pipeflow.compare import wandb_report as wr

    monkeypatch.setattr("pipeflow.tracking.sink.resolve_wandb_mode", lambda mode: "online")
    calls = {}
    monkeypatch.setattr(wr, "sync_offline_runs", lambda dirs, **kw: calls.setdefault("sync", (dirs, kw)) and [])
    monkeypatch.setattr(wr, "publish", lambda report: calls.setdefault("report", report) and "https://wandb.test/r")
    for seed in (1, 2):
        c = cfg("1f1b", seed)
        c["logger"] = {"name": "wandb", "group": f"sweep-{seed}", "project": "pp", "entity": "team"}
        write_run(tmp_path, f"runs/s{seed}", c, [2.0, 1.0])
    assert cli.main([str(tmp_path / "runs"), f"out={tmp_path / 'out'}", "report=wandb"]) == 0
    assert "W&B report: https://wandb.test/r" in capsys.readouterr().out
    dirs, kw = calls["sync"]
    assert sorted(d.name for d in dirs) == ["s1", "s2"] and kw == {"entity": "team", "project": "pp"}
    report = calls["report"]
    assert report.entity == "team" and report.project == "pp"
    runset = next(b for b in report.blocks if hasattr(b, "runsets")).runsets[0]
    assert "sweep-1" in runset.filters and "sweep-2" in runset.filters


def test_a_plan_sweep_feeds_the_report_by_method_and_topology(tmp_path):
    """pipeflow-plan -m over planning methods x topologies: every plan is a simulated
    row labelled by what differs, with the plan's predicted iteration time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeflow.plan", "-m", "plan.method=planner,uniform", "topology=pcie_8,dgx_a100_8",
         "model=gpt_tiny", "pipeline.microbatches=4", "baselines=false", "draw=false", "logger=none",
         f"hydra.sweep.dir={tmp_path / 'plans'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs, table, _ = compare([str(tmp_path / "plans")], CompareConfig(out=str(tmp_path / "out")))
    assert sorted(r["label"] for r in table) == [
        f"method={m}, topology={t}" for m in ("planner", "uniform") for t in ("dgx_a100_8", "pcie_8")]
    for run, row in zip(runs, table):
        assert row["kind"] == "simulated"
        assert row["sim_step_time"] == pytest.approx(run.summary["makespan"])


def test_an_output_folder_that_cannot_be_written_is_refused_in_one_line(tmp_path, capsys):
    """Issue 16, item 5: out=/proc/x names the key, the path and the reason; no traceback."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert main([str(tmp_path / "run"), "out=/proc/pipeflow-x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pipeflow-compare: out=/proc/pipeflow-x: cannot write there (No such file or directory); " \
                  "give a folder you can write"


def test_stages_and_data_parallel_are_reported_apart(tmp_path):
    """Issue 18: two runs that differ only in pipeline.data_parallel are two
    configurations, labelled by it, with stages and data_parallel in separate columns."""
    for dp in (1, 2):
        run = tmp_path / f"dp{dp}"
        run.mkdir()
        config = {"schedule": {"name": "1f1b"}, "seed": 1,
                  "pipeline": {"stages": 2, "microbatches": 4, "data_parallel": dp}}
        (run / "config.json").write_text(json.dumps(config))
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    runs = find_runs([str(tmp_path)])
    rows = {r["run"].split("/")[-1]: r for r in run_table(runs, None, 1)}
    assert rows["dp2"]["data_parallel"] == 2 and rows["dp1"]["data_parallel"] == 1
    assert rows["dp2"]["stages"] == rows["dp1"]["stages"] == 2
    assert "data_parallel=2" in rows["dp2"]["label"] and rows["dp1"]["label"] != rows["dp2"]["label"]
