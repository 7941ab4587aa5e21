"""benchmarks/bench_step_vs_plain.py's plain loop trains what pipeflow's one stage trains:
transformers' GPT2LMHeadModel with pipeflow's weights, fused AdamW and pipeflow's loss
and learning rate give pipeflow's losses step by step, its head padded as pipeflow's
(scoring the words' logits). No timing is asserted."""

from __future__ import annotations

import pytest

from benchmarks import bench_step_vs_plain as bench

pytestmark = pytest.mark.slow  # starts a process: make test-fast leaves it out


def test_the_plain_loop_trains_what_pipeflow_trains():
    r = bench.measure(model="gpt_tiny", layers=2, seq=32, microbatches=2, mbs=2, repeats=1, steps=4, threads=1,
                      compiled=False, warmup=1, vocab_multiple=48)
    assert (r["vocab"], r["rows"]) == (256, 288)
    run = r["runs"][0]
    ours, plain = run["loss"]["pipeflow"], run["loss"]["plain"]
    assert len(ours) == len(plain) == 4
    # the same fp32 training: identical for 3 steps, then fused AdamW rounds apart (1e-7)
    assert plain == pytest.approx(ours, rel=1e-6)
    assert ours[-1] < ours[0] and plain[-1] < plain[0]  # both train
    assert set(r["median"]) == {"pipeflow", "plain"} and r["compiled_ratio"] is None
