"""benchmarks/bench_runtime_vs_torch.py runs the same training in pipeflow and in
torch.distributed.pipelining for every schedule pair it compares: a short run of the
harness gives the same losses, step by step, and the same compute order per rank.
No timing is asserted (the benchmark reports times; tests do not judge them)."""

from __future__ import annotations

import pytest

from benchmarks import bench_runtime_vs_torch as bench

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

STEPS = 3


@pytest.mark.parametrize("schedule", list(bench.SCHEDULES))
def test_pipeflow_and_torch_train_the_same(schedule):
    res = bench.results(repeats=1, steps=STEPS, schedules=[schedule], warmup=1)
    r = res["schedules"][schedule]
    run = r["runs"][0]
    ours, theirs = run["loss"]["pipeflow"], run["loss"]["torch"]
    assert len(ours) == len(theirs) == STEPS
    # identical, not close: the same fp32 operations in the same order, ZB-H1's by-hand
    # weight gradients summed into .grad as autograd's accumulator sums them
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        assert a == b, f"{schedule} step {step}: pipeflow {a} vs torch {b}"
    assert r["loss_max_rel_diff"] == 0.0
    # it trains: the loss moves (a torch side that never updated would fail the check above
    # from step 2 on; this guards against both sides standing still)
    assert ours[-1] < ours[0]
    # the same work in the same order, rank by rank
    assert r["same_order"], run["order"]
    # interleaving: 4 one-layer chunks, rank r holding chunks r and r + 2
    if schedule == "interleaved_1f1b":
        assert r["layers_per_stage"] == [1, 1, 1, 1] and r["placement"] == [0, 1, 0, 1]
    else:
        assert r["layers_per_stage"] == [2, 2] and r["placement"] == [0, 1]
    # the keys benchmarks/reproduce.py reads
    if schedule == "1f1b":
        assert {"ratio", "median", "pair_ratio", "steady_steps", "loss_max_rel_diff"} <= set(res)
    assert set(r["median"]) == {"pipeflow", "torch"} and r["steady_steps"] == STEPS - 1
