"""benchmarks/bench_vocab_padding.py times the head at two widths doing the same work: the
padded head's loss is the unpadded one's, the words' gradient too, the padding's zero;
and the H200 profile prices the padded product below the unpadded. No timing is asserted."""

from __future__ import annotations

from benchmarks import bench_vocab_padding as bench


def test_the_padded_head_is_timed_doing_the_unpadded_heads_work():
    r = bench.measure(width=32, vocab=260, multiple=64, tokens=48, repeats=2)
    assert (r["vocab"], r["rows"]) == (260, 320) and len(r["run_ratios"]) == 2
    assert r["loss_max_rel_diff"] < 1e-6 and r["words_grad_equal"] and r["padding_grad_zero"]
    assert r["loss"] > 0
    prices = bench.h200_prices(768, 50257, 50304, 1024)  # (the sweep's rows at both widths)
    assert 0 < prices[50304] < prices[50257]
