"""benchmarks/bench_simulate_cli.py's helpers: the command lines it times, what counts as
a finished run, and its verdict from given times. No timing is asserted (the benchmark
reports times; tests do not judge them)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_simulate_cli as bench


def test_command_is_the_console_script_with_the_overrides_and_its_own_folder(tmp_path):
    cmd = bench.command(bench.LARGE, tmp_path / "run")
    assert cmd[0].endswith("pipeflow-simulate") or cmd[1:3] == ["-m", "pipeflow.simulate"]
    overrides = cmd[-(len(bench.COMMON) + len(bench.LARGE) + 1):]
    assert overrides == [*bench.COMMON, "pipeline.stages=64", "pipeline.microbatches=1024",
                         f"hydra.run.dir={tmp_path / 'run'}"]
    # the two commands differ only in the size
    small = bench.command(bench.SMALL, tmp_path / "run")
    assert [a for a in small if a not in bench.SMALL] == [a for a in cmd if a not in bench.LARGE]


def test_a_run_counts_only_with_its_summary_and_timeline(tmp_path):
    with pytest.raises(FileNotFoundError, match="no summary.json or timeline"):
        bench.outputs(tmp_path)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        bench.outputs(tmp_path)
    (tmp_path / "timeline.json.gz").write_bytes(b"")
    (tmp_path / "simulate.log").write_text("")
    assert bench.outputs(tmp_path) == ["summary.json", "timeline.json.gz"]


def test_verdict_is_on_the_difference_of_medians():
    got = bench.summarize([1.0, 1.2, 1.1], [2.0, 2.9, 2.5], limit=1.5)
    assert got["small_median"] == pytest.approx(1.1) and got["large_median"] == pytest.approx(2.5)
    assert got["difference"] == pytest.approx(1.4) and got["within"]
    assert got["paired_difference"] == pytest.approx(1.4)  # median of 1.0, 1.7, 1.4
    late = bench.summarize([1.0, 1.2, 1.1], [2.0, 3.0, 2.7], limit=1.5)
    assert late["difference"] == pytest.approx(1.6) and not late["within"]


@pytest.mark.slow  # starts the console script
def test_results_of_two_small_commands(tmp_path):
    res = bench.results(repeats=1, small=["pipeline.stages=2", "pipeline.microbatches=2"],
                        large=["pipeline.stages=4", "pipeline.microbatches=8"], common=["cost=unit"], out=tmp_path)
    assert len(res["runs"]["small"]) == len(res["runs"]["large"]) == 1
    assert res["files"]["large"] == ["summary.json", "timeline.json", "timeline.png"]
    summary = json.loads((tmp_path / "large_0" / "summary.json").read_text())
    assert (summary["stages"], summary["microbatches"]) == (4, 8)
    assert res["difference"] == pytest.approx(res["large_median"] - res["small_median"])
    assert res["command"]["large"] == "pipeflow-simulate cost=unit pipeline.stages=4 pipeline.microbatches=8"
