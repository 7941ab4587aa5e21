"""benchmarks/bench_memory.py's own plumbing (no ranks): a case of any length gets a
folder it can write, and a case that cannot run is reported in a line while the others'
rows are kept."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_memory  # noqa: E402


def test_a_case_of_any_length_gets_a_folder_of_its_own():
    long = " ".join(f"model.hf.field_{i}={i}" for i in range(40))  # 600 characters of overrides
    other = long.replace("field_39=39", "field_39=40")
    a, b = bench_memory._folder(long), bench_memory._folder(other)
    assert len(long) > 255 and len(a) <= 80 and a != b
    assert bench_memory._folder("gpt 1f1b fp32 recompute=full") == "gpt_1f1b_fp32_recompute-full"


def test_a_refused_case_is_reported_and_the_others_kept(monkeypatch, capsys):
    def measure(label, over, work, *args):
        if "bad" in label:
            raise ValueError("pipeline.stages=3: schedule 'chimera' needs an even number of stages\n(2, 4, ...)")
        return [{"case": label}]

    monkeypatch.setattr(bench_memory, "measure", measure)
    rows = bench_memory.measure_all([("good one", []), ("bad one", []), ("good two", [])])
    assert [r["case"] for r in rows] == ["good one", "good two"]
    err = capsys.readouterr().err
    assert "bad one: not measured: pipeline.stages=3: schedule 'chimera' needs an even number of stages (2, 4, ...)" in err
