"""benchmarks/bench_fidelity.py's verdicts, from hand-made figures: which schedule
pairs count as misordered, and the ZB-H1 split check. No run is timed here."""

from __future__ import annotations

import pytest

from benchmarks import bench_fidelity as bench


def _rows(**figures):
    return {name: {"measured": m, "simulated": s} for name, (m, s) in figures.items()}


def test_pairs_apart_by_more_than_the_gap_must_be_ordered_alike():
    rows = _rows(**{"1f1b": (1.00, 0.90), "gpipe": (1.10, 0.85), "zb_h1": (1.02, 0.80),
                    "bapp": (0.30, 0.20), "chimera_cbm": (0.40, 0.50)})
    # gpipe is measured 10% slower than 1f1b but simulated faster: misordered;
    # zb_h1 is within 5% of 1f1b, so its order does not count either way;
    # the branched pair is ordered alike and never compared with the GPT schedules
    assert bench.misordered(rows) == [("1f1b", "gpipe")]
    rows["gpipe"]["simulated"] = 0.95
    assert bench.misordered(rows) == []


def test_split_check_sums_i_and_w_against_b_per_stage():
    rows = {
        "1f1b": {"measured": 0.30, "actions": {"0B": [0.020, 0.022], "1B": [0.018]}},
        "zb_h1": {"measured": 0.27, "actions": {"0I": [0.0001], "0W": [0.021], "1I": [0.012], "1W": [0.008]}},
    }
    cal = {"1f1b": [{"times": {"B|0|0": 0.02, "B|1|0": 0.02}}],
           "zb_h1": [{"times": {"I|0|0": 0.0, "W|0|0": 0.02, "I|1|0": 0.013, "W|1|0": 0.008}}]}
    got = bench.split_check(rows, cal)
    assert got["step_ratio"] == pytest.approx(0.9)
    assert got["stages"][0]["I+W / B"] == pytest.approx(0.0211 / 0.021)
    assert got["stages"][1]["I+W / B"] == pytest.approx(0.020 / 0.018)
    assert got["stages"][1]["replay"] == pytest.approx(0.021 / 0.02)
    assert bench.split_check({"1f1b": rows["1f1b"]}) is None


def test_spread_is_each_schedules_slowest_over_fastest_run():
    rows = {"1f1b": {"runs": [0.30, 0.33, 0.36]}, "gpipe": {"runs": [0.40, 0.40]}, "amdp": {"runs": [0.2]}}
    got = bench.spread(rows)
    assert got["schedules"] == pytest.approx({"1f1b": 0.2, "gpipe": 0.0})
    assert got["median"] == pytest.approx(0.1)
    assert bench.spread({"1f1b": {"runs": [0.3]}}) is None


def test_every_benchmark_imports():
    """`make bench` runs each module under benchmarks/: an import that a refactor broke
    (bench_split named a helper the run plan had replaced) fails here, not in a bench run."""
    import importlib
    from pathlib import Path

    names = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
                   if p.stem != "__init__")
    assert "bench_split" in names and len(names) > 10
    for name in names:
        importlib.import_module(f"benchmarks.{name}")
