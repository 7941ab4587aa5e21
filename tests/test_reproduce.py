"""The reproduction suite's table: rows from claims, failures as rows, closed forms exact.

Only fake sources and the cheap closed-form simulations run here; the benchmarks'
own measurements (multi-rank training, planner sweeps) are not exercised.
"""

import importlib.util
import json

import pytest

from benchmarks import bench_closed_forms, reproduce
from benchmarks.reproduce import Claim, Source


def _fake_sources(calls: list) -> dict:
    def good(scale=1.0):
        calls.append("good")
        return {"a": 2.0 * scale, "b": 3.0 * scale}

    def broken():
        calls.append("broken")
        raise RuntimeError("rank 1 failed: out of memory\nTraceback (most recent call last): ...")

    return {
        "good": Source("bench_good", good, ({"scale": 1.0}, ""), ({"scale": 0.5}, "--small")),
        "broken": Source("bench_broken", broken),
    }


def _claims() -> list[Claim]:
    return [
        Claim("first", "Paper A; ALGORITHMS.md §A", "1.20x", "simulated", "good", lambda r: f"{r['a']:.2f}x"),
        Claim("second", "Paper B; ALGORITHMS.md §B", "0.5 | 0.6", "measured", "good", lambda r: f"{r['b']:.2f}"),
        Claim("third", "Paper C", "42", "measured", "broken", lambda r: "never read"),
        Claim("fourth", "Paper D", "7", "simulated", "good", lambda r: r["missing"]),
    ]


def test_table_has_one_row_per_claim_with_its_published_figure(tmp_path):
    calls: list = []
    rows = reproduce.reproduce(tmp_path, quick=False, rows=_claims(), sources=_fake_sources(calls))
    assert [r["claim"] for r in rows] == ["first", "second", "third", "fourth"]
    assert [r["published"] for r in rows] == ["1.20x", "0.5 | 0.6", "42", "7"]
    assert rows[0]["pipeflow"] == "2.00x" and rows[1]["pipeflow"] == "3.00"
    assert calls.count("good") == 1  # a source runs once for all the rows it feeds

    md = (tmp_path / "reproduction.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + len(rows)  # the header, then one line per claim
    assert "| 1.20x | 2.00x |" in table[1]
    assert "0.5 \\| 0.6" in table[2]  # a pipe inside a cell does not split it
    assert "`python -m benchmarks.bench_good`" in table[1]

    data = json.loads((tmp_path / "reproduction.json").read_text())
    assert data["rows"] == rows
    assert json.loads((tmp_path / "results.json").read_text())["good"]["results"] == {"a": 2.0, "b": 3.0}


def test_failing_measurement_becomes_a_failed_row(tmp_path):
    rows = reproduce.reproduce(tmp_path, quick=False, rows=_claims(), sources=_fake_sources([]))
    broken, unreadable = rows[2], rows[3]
    assert broken["status"] == "failed"
    assert broken["pipeflow"] == "failed: RuntimeError: rank 1 failed: out of memory"  # one line
    assert unreadable["status"] == "failed" and unreadable["pipeflow"] == "failed: KeyError: 'missing'"
    assert [r["status"] for r in rows[:2]] == ["ok", "ok"]  # the others still stand
    assert "failed: RuntimeError" in (tmp_path / "reproduction.md").read_text()


def test_quick_uses_the_small_sizes_and_their_command(tmp_path):
    rows = reproduce.reproduce(tmp_path, quick=True, rows=_claims()[:1], sources=_fake_sources([]))
    assert rows[0]["pipeflow"] == "1.00x"
    assert rows[0]["command"] == "python -m benchmarks.bench_good --small"


def test_long_reasons_are_cut_to_one_short_line():
    text = reproduce.reason(ValueError("x" * 1000 + "\nsecond line"))
    assert len(text) == reproduce.REASON_CHARS and text.startswith("ValueError: xxx") and "\n" not in text


def test_closed_form_rows_agree_with_their_closed_forms(tmp_path):
    claims = [c for c in reproduce.claims() if c.source.startswith("closed_form:")]
    assert len(claims) == len(bench_closed_forms.CHECKS)
    rows = reproduce.reproduce(tmp_path, quick=True, rows=claims)
    for row, check in zip(rows, bench_closed_forms.CHECKS.values()):
        assert row["status"] == "ok", row
        assert row["published"].endswith(f"= {check.expected:.4f}")
        assert float(row["pipeflow"]) == pytest.approx(check.expected, abs=1e-4), row["claim"]
        assert check.simulate() == pytest.approx(check.expected, abs=1e-12), row["claim"]


def test_every_claim_has_a_source_and_a_runnable_command():
    claims = reproduce.claims()
    assert len({c.claim for c in claims}) == len(claims)
    for c in claims:
        src = reproduce.SOURCES[c.source]
        assert importlib.util.find_spec(f"benchmarks.{src.module}") is not None
        for quick in (False, True):
            assert src.command(quick).startswith(f"python -m benchmarks.{src.module}")
        assert c.published and c.paper and c.method
    papers = {c.paper.split(";")[0] for c in claims}
    assert {"AMDP (ICML 2026)", "Seq1F1B (NAACL 2025)", "Chimera (SC'21)", "Luo et al. (INFOCOM 2022)"} <= papers


def test_published_figures_are_the_benchmarks_constants():
    by_claim = {c.claim: c for c in reproduce.claims()}
    amdp = by_claim["AMDP throughput vs PipeDream-2BW and Inter-1F1B, GPT d=8 update batch 128"]
    assert amdp.published == "1.169x 2BW, 1.240x Inter-1F1B (AMDP 83.7 ktok/s)"
    seq = by_claim["Seq1F1B throughput / 1F1B, 7B on 32 GPUs, seq 32768, m=8"]
    assert seq.published == "1.110x (53,485 vs 48,189 tok/s)"


def test_simulated_out_of_memory_fails_the_row_with_the_memory(tmp_path):
    name = "Seq1F1B throughput / 1F1B, 7B on 32 GPUs, seq 32768, m=8"
    claim = next(c for c in reproduce.claims() if c.claim == name)
    fits = {"tok": 2.0e4, "mem": 40.0, "act": 30.0, "oom": False, "segments": 4}
    oom = {**fits, "mem": 95.5, "oom": True}
    rows = {32768: {"1f1b": oom, "seq1f1b compute": fits, "seq1f1b uniform": fits}}
    sources = {claim.source: Source("bench_seq1f1b", lambda: rows)}
    [row] = reproduce.reproduce(tmp_path, quick=False, rows=[claim], sources=sources)
    assert row["status"] == "failed"
    assert row["pipeflow"] == "failed: MeasurementFailed: 1F1B simulated out of memory (95.5 GB > 80 GB)"
    rows[32768]["1f1b"] = fits
    [row] = reproduce.reproduce(tmp_path, quick=False, rows=[claim], sources=sources)
    assert row["status"] == "ok" and row["pipeflow"].startswith("1.000x")
