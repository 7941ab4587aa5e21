"""Megatron-LM's Table 1 (SC'21) as benchmarks/bench_megatron.py simulates it.

The FLOP count is checked by hand; the two smallest rows (32 and 64 GPUs, one pipeline
stage each) are simulated and their TFLOP/s per GPU kept within the benchmark's pass
band of the published figures. The larger rows take seconds each (a 1,920-GPU topology
is built pair by pair) and live in the benchmark alone.
"""

import pytest

from benchmarks import bench_megatron, reproduce
from benchmarks.bench_megatron import SIZES, model_flops
from benchmarks.reproduce import Source


def test_model_flops_is_the_papers_formula_by_hand():
    # 1.7B: B=512, s=2048, l=24, h=2304, V=51200; the three terms one by one
    dense = 96 * 512 * 2048 * 24 * 2304 * 2304  # 96 B s l h^2
    attention = dense * 2048 / (6 * 2304)  # x s/(6h)
    logits = dense * 51200 / (16 * 24 * 2304)  # x V/(16 l h)
    assert model_flops(SIZES["1.7"]) == pytest.approx(dense + attention + logits, rel=1e-12)
    assert dense == 12_824_703_626_379_264
    assert model_flops(SIZES["1.7"]) == pytest.approx(1.54668e16, rel=1e-5)


def test_the_table_is_the_papers():
    sizes = list(SIZES.values())
    assert [s.published for s in sizes] == [137, 138, 142, 135, 138, 140, 148, 155]
    assert [s.dp for s in sizes] == [32, 32, 32, 32, 32, 32, 24, 15]
    # global batch = DP x microbatch size x microbatches, with nothing left over
    assert all(s.dp * s.microbatch * s.microbatches == s.batch for s in sizes)
    assert [s.microbatches for s in sizes] == [1, 1, 1, 4, 12, 28, 48, 144]


def test_overrides_name_the_rows_parallelism():
    ov = bench_megatron.overrides(SIZES["310.1"])
    for key in ("topology.nodes=240", "pipeline.stages=16", "pipeline.tensor_parallel=8",
                "pipeline.data_parallel=15", "pipeline.microbatches=144", "model.recompute=full", "schedule=1f1b"):
        assert key in ov
    inter = bench_megatron.overrides(SIZES["310.1"], interleaved=True)
    assert "schedule=interleaved_1f1b" in inter and "pipeline.virtual_stages=2" in inter
    assert "schedule=1f1b" in bench_megatron.overrides(SIZES["1.7"], interleaved=True)  # not interleaved there


@pytest.mark.parametrize("params", ["1.7", "3.6"])
def test_small_rows_land_in_the_pass_band(params):
    row = bench_megatron.measure(params)
    assert row["config"]["dp"] == 32 and row["config"]["schedule"] == "1f1b"
    assert row["tflops"] == pytest.approx(model_flops(SIZES[params]) / (row["step_s"] * SIZES[params].gpus) / 1e12)
    assert not row["oom"]
    assert bench_megatron.in_band(row["ratio"]), row


def test_reproduce_has_a_row_per_size_and_fails_an_unrun_one(tmp_path):
    claims = [c for c in reproduce.claims() if c.source == "megatron"]
    assert len(claims) == len(SIZES)
    assert claims[0].published == "137 TFLOP/s per GPU (pass: 0.8-1.2x)"
    row = {"size": "1.7", "tflops": 150.0, "ratio": 150 / 137, "step_s": 3.2, "oom": False, "memory_gb": 48.0}
    sources = {"megatron": Source("bench_megatron", lambda: [row])}
    rows = reproduce.reproduce(tmp_path, quick=False, rows=claims[:2], sources=sources)
    assert rows[0]["pipeflow"] == "150.0 TFLOP/s per GPU, 1.095x published, within the 0.8-1.2 band (step 3.20 s)"
    assert rows[1]["status"] == "failed" and "3.6B was not run" in rows[1]["pipeflow"]
