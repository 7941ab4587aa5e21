"""pipeflow-compare's simulator fidelity: the deviation of a simulated step time from the
measured one of the same configuration (sim_error), the target it is held to (10% on up
to 2 ranks, 15% on more; sim_tolerance=FRACTION for another) and the flag beyond it, in
the tables, the CSV files, the console and report.html. Run folders are written here."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pipeflow.compare.cli import CompareConfig, CompareConfigError, compare, main, parse_args
from pipeflow.compare.runs import find_runs
from pipeflow.compare.table import (SIM_TOLERANCE_FEW_RANKS, SIM_TOLERANCE_MANY_RANKS, group_table, percent,
                                    run_table, sim_tolerance)

MODEL = "gpt_tiny"

pytestmark = pytest.mark.slow  # simulates and compares whole run folders


def measured(root: Path, name: str, *, schedule: str = "1f1b", stages: int = 2, step_time: float = 0.5,
             seed: int = 1, world_size: int | None = None, finished: bool = True) -> Path:
    """A training run: config.json, metrics.jsonl and (finished) summary.json with its
    mean step time and the ranks it ran on."""
    d = root / name
    d.mkdir(parents=True)
    config = {"schedule": {"name": schedule}, "seed": seed, "model": {"name": MODEL},
              "pipeline": {"stages": stages, "microbatches": 4, "microbatch_size": 2}, "trainer": {"steps": 4},
              "logger": {"name": "none"}}
    (d / "config.json").write_text(json.dumps(config))
    rows = [{"step": s, "loss": 4.0 - s / 2, "step_time": step_time, "train_time": s * step_time, "samples": 8 * s}
            for s in range(1, 5)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (d / "summary.json").write_text(json.dumps({
            "kind": "measured", "schedule": schedule, "stages": stages, "microbatches": 4, "microbatch_size": 2,
            "world_size": stages if world_size is None else world_size, "mean_step_time": step_time,
            "mean_tokens_per_s": 100.0, "peak_memory_bytes": [2**20] * stages}))
    return d


def simulated(root: Path, name: str, makespan: float, *, schedule: str = "1f1b", stages: int = 2,
              cost: str = "analytic") -> Path:
    """A simulated run of the same configuration: a summary.json as pipeflow-simulate writes it."""
    d = root / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({
        "kind": "simulated", "schedule": schedule, "stages": stages, "microbatches": 4, "virtual_stages": 1,
        "segments": 1, "microbatch_size": 2, "num_devices": stages, "makespan": makespan, "bubble_ratio": 0.2,
        "per_device": [{"peak_activation_bytes": 2**20}] * stages, "model": {"name": MODEL},
        "cost": {"name": cost}, "topology": {"name": "local_cpu"}}))
    return d


def rows_of(out: Path, name: str) -> list[dict]:
    with open(out / name, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_the_targets_are_10_percent_on_two_ranks_and_15_on_more():
    assert (SIM_TOLERANCE_FEW_RANKS, SIM_TOLERANCE_MANY_RANKS) == (0.10, 0.15)
    assert sim_tolerance(1) == sim_tolerance(2) == 0.10
    assert sim_tolerance(3) == sim_tolerance(4) == sim_tolerance(8) == 0.15
    assert sim_tolerance(4, 0.05) == 0.05
    assert percent(-0.23) == "-23%" and percent(0.104) == "+10.4%" and percent(0.1, sign=False) == "10%"


def test_a_pair_within_the_target_gets_its_deviation_and_no_flag(tmp_path, capsys):
    measured(tmp_path / "runs", "train", step_time=0.5)
    simulated(tmp_path / "runs", "sim", makespan=0.52)  # +4%
    out = tmp_path / "out"
    assert main([str(tmp_path / "runs"), f"out={out}"]) == 0
    said = capsys.readouterr().out

    runs, table, report = compare([str(tmp_path / "runs")], CompareConfig(out=str(tmp_path / "out2")))
    row = next(r for r in table if r["kind"] == "measured")
    assert row["sim_error"] == pytest.approx((0.52 - 0.5) / 0.5, abs=1e-12)
    assert row["sim_tolerance"] == 0.10 and row["sim_flag"] is None
    assert row["sim_over_measured"] == pytest.approx(1.04)
    sim_row = next(r for r in table if r["kind"] == "simulated")
    assert sim_row["sim_error"] is None  # the deviation belongs to the measured run
    group = next(g for g in group_table(runs, table) if g["kind"] == "measured")
    assert group["sim_error"] == pytest.approx(0.04, abs=1e-12) and group["sim_flag"] is None
    assert report.cautions == []

    csv_row = next(r for r in rows_of(out, "runs.csv") if r["kind"] == "measured")
    assert float(csv_row["sim_error"]) == pytest.approx(0.04, abs=1e-9) and csv_row["sim_flag"] == ""
    assert float(next(r for r in rows_of(out, "configurations.csv") if r["kind"] == "measured")["sim_error"]) \
        == pytest.approx(0.04, abs=1e-9)
    page = (out / "report.html").read_text()
    assert "<th>simulated vs measured</th>" in page and "<td>+4%</td>" in page
    assert '<td class="text">within target</td>' in page
    assert "Caution" not in page and 'class="flag"' not in page
    assert "sim error" in said and "+4%" in said and "caution:" not in said


def test_a_pair_beyond_the_target_is_flagged_in_the_tables_the_page_and_the_console(tmp_path, capsys):
    measured(tmp_path / "runs", "train", step_time=0.5)
    simulated(tmp_path / "runs", "sim", makespan=0.385)  # -23%
    out = tmp_path / "out"
    assert main([str(tmp_path / "runs"), f"out={out}"]) == 0
    said = capsys.readouterr().out

    caution = "1f1b (p=2): -23% (target ±10%)"
    assert "caution: simulated step time deviates from measured beyond the target for: " + caution in said
    console_row = next(line for line in said.splitlines() if line.startswith("1f1b") and "-23%" in line)
    assert "beyond ±10%" in console_row
    page = (out / "report.html").read_text()
    # what the simulator predicts against what was measured, and why they can differ
    assert "<li>1f1b (p=2): simulated 0.385 s per step, measured 0.500 s (-23%, target ±10%)</li>" in page
    assert "cost=analytic prices each action" in page and "topology=local_cpu" in page
    assert page.index("Caution") < page.index("<h2>")  # at the top, before the figures and tables
    # and again where the two stand side by side: before the step-time figure and its table
    section = page[page.index("<h2>Step time</h2>"):]
    assert section.index('<p class="caution"><b>Caution:</b>') < section.index('<img alt="step_time"')
    assert '<td class="text flag">beyond ±10%</td>' in page and '<td class="flag">-23%</td>' in page
    assert "predicts shorter steps than were measured (measured 1.3× the prediction)" in said
    run = next(r for r in rows_of(out, "runs.csv") if r["kind"] == "measured")
    assert float(run["sim_error"]) == pytest.approx(-0.23, abs=1e-9) and run["sim_flag"] == "beyond ±10%"
    group = next(r for r in rows_of(out, "configurations.csv") if r["kind"] == "measured")
    assert group["sim_flag"] == "beyond ±10%" and float(group["sim_tolerance"]) == pytest.approx(0.1)
    assert (out / "step_time.png").exists()

    # a looser target set on the command line: no flag, no caution
    assert main([str(tmp_path / "runs"), f"out={tmp_path / 'loose'}", "sim_tolerance=0.25"]) == 0
    said = capsys.readouterr().out
    assert "caution:" not in said and "beyond ±" not in said  # (the paths name the test)
    assert "Caution" not in (tmp_path / "loose" / "report.html").read_text()
    run = next(r for r in rows_of(tmp_path / "loose", "runs.csv") if r["kind"] == "measured")
    assert run["sim_flag"] == "" and float(run["sim_tolerance"]) == pytest.approx(0.25)


def test_on_four_ranks_12_percent_is_within_the_target_on_two_it_is_not(tmp_path):
    root = tmp_path / "runs"
    measured(root, "train4", stages=4, step_time=1.0)
    simulated(root, "sim4", makespan=1.12, stages=4)
    measured(root, "train2", stages=2, step_time=1.0)
    simulated(root, "sim2", makespan=1.12, stages=2)
    runs, table, report = compare([str(root)], CompareConfig(out=str(tmp_path / "out")))
    by = {r["run"]: r for r in table}
    four, two = by["train4"], by["train2"]
    assert four["sim_error"] == pytest.approx(0.12, abs=1e-12) and two["sim_error"] == pytest.approx(0.12, abs=1e-12)
    assert four["sim_tolerance"] == 0.15 and four["sim_flag"] is None
    assert two["sim_tolerance"] == 0.10 and two["sim_flag"] == "beyond ±10%"
    # the two configurations differ only by depth, which their labels say: no "(p=...)" added
    assert report.cautions == ["stages=2: +12% (target ±10%)"]
    page = report.html.read_text()
    assert "stages=2: simulated 1.12 s per step, measured 1.00 s (+12%, target ±10%)" in page
    assert "stages=4: simulated" not in page


def test_the_ranks_are_what_the_measured_run_ran_on(tmp_path):
    """A 4-stage pipeline on 2 ranks (two stages a rank) is held to the 2-rank target;
    a run that stopped before its summary takes the simulated schedule's devices."""
    root = tmp_path / "runs"
    measured(root, "train", stages=4, step_time=1.0, world_size=2)
    simulated(root, "sim", makespan=1.12, stages=4)
    table = run_table(find_runs([root]), None, 1)
    assert next(r for r in table if r["kind"] == "measured")["sim_tolerance"] == 0.10

    root = tmp_path / "cut"
    measured(root, "train", stages=4, step_time=1.0, finished=False)
    simulated(root, "sim", makespan=1.12, stages=4)
    row = next(r for r in run_table(find_runs([root]), None, 1) if r["kind"] == "measured")
    assert row["status"] == "incomplete" and row["sim_error"] == pytest.approx(0.12, abs=1e-12)
    assert row["sim_tolerance"] == 0.15 and row["sim_flag"] is None


def test_a_unit_cost_simulation_has_no_deviation(tmp_path, capsys):
    """cost=unit counts abstract unit times: 10 units against 0.5 s is no deviation."""
    measured(tmp_path / "runs", "train", step_time=0.5)
    simulated(tmp_path / "runs", "sim", makespan=10.0, cost="unit")
    out = tmp_path / "out"
    assert main([str(tmp_path / "runs"), f"out={out}"]) == 0
    said = capsys.readouterr().out
    runs, table, report = compare([str(tmp_path / "runs")], CompareConfig(out=str(tmp_path / "out2")))
    row = next(r for r in table if r["kind"] == "measured")
    assert row["sim_step_time"] == pytest.approx(10.0)  # still paired
    assert row["sim_error"] is None and row["sim_tolerance"] is None and row["sim_flag"] is None
    assert next(g for g in group_table(runs, table) if g["kind"] == "measured")["sim_error"] is None
    assert report.cautions == []
    page = (out / "report.html").read_text()
    assert "<th>simulated step time (unit times)</th>" in page and "Caution" not in page
    assert "<th>simulated vs measured</th>" not in page
    assert "sim error" not in said and "caution:" not in said
    assert next(r for r in rows_of(out, "runs.csv") if r["kind"] == "measured")["sim_error"] == ""


def test_a_configuration_deviates_by_the_mean_over_its_seeds(tmp_path):
    root = tmp_path / "runs"
    measured(root, "s1", seed=1, step_time=0.5)  # simulated 0.45: -10%
    measured(root, "s2", seed=2, step_time=0.4)  # +12.5%: beyond on its own
    simulated(root, "sim", makespan=0.45)
    runs = find_runs([root])
    table = run_table(runs, None, 1)
    by = {r["run"]: r for r in table}
    assert by["s1"]["sim_error"] == pytest.approx(-0.1, abs=1e-12) and by["s1"]["sim_flag"] is None
    assert by["s2"]["sim_error"] == pytest.approx(0.125, abs=1e-12) and by["s2"]["sim_flag"] == "beyond ±10%"
    group = next(g for g in group_table(runs, table) if g["kind"] == "measured")
    assert group["runs"] == 2 and group["sim_error"] == pytest.approx(0.0125, abs=1e-12)
    assert group["sim_tolerance"] == 0.10 and group["sim_flag"] is None


def test_a_measured_run_without_a_simulation_gets_no_fidelity_columns(tmp_path):
    root = tmp_path / "runs"
    measured(root, "train", schedule="gpipe", step_time=0.5)
    simulated(root, "sim", makespan=0.1, schedule="1f1b")  # another configuration
    runs, table, report = compare([str(root)], CompareConfig(out=str(tmp_path / "out")))
    row = next(r for r in table if r["kind"] == "measured")
    assert row["sim_step_time"] is None and row["sim_error"] is None and row["sim_flag"] is None
    assert report.cautions == [] and "<th>simulated vs measured</th>" not in report.html.read_text()


def test_sim_tolerance_setting_is_checked(tmp_path):
    measured(tmp_path, "a", step_time=0.5)
    assert parse_args([str(tmp_path), "sim_tolerance=0.2"])[1].sim_tolerance == pytest.approx(0.2)
    assert parse_args([str(tmp_path)])[1].sim_tolerance is None
    with pytest.raises(CompareConfigError, match="sim_tolerance=0.0: must be a fraction above 0"):
        parse_args([str(tmp_path), "sim_tolerance=0"])
    with pytest.raises(CompareConfigError, match="sim_tolerance"):
        parse_args([str(tmp_path), "sim_tolerance=abc"])
