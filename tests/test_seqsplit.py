"""Sequence splits for Seq1F1B: the paper's 7B figure, equal FLOPs, equal lengths, sums,
and errors that name the key."""

from __future__ import annotations

import pytest

from pipeflow.planning.seqsplit import SPLITS, segment_flop, segment_flops, split_sequence
from pipeflow.planning.transformer import TransformerSpec, layer_forward_flops

GPT_7B = TransformerSpec("gpt_7b", n_layer=32, n_head=32, n_embd=4096, vocab_size=50304, seq_len=32768,
                         n_inner=16384)
SMALL = TransformerSpec("small", n_layer=4, n_head=4, n_embd=64, vocab_size=256, seq_len=512)
BERT = TransformerSpec("bert", n_layer=2, n_head=2, n_embd=32, vocab_size=100, seq_len=64, causal=False)


def test_the_generators_accept_exactly_these_splits():
    from pipeflow.schedules import seq1f1b

    assert seq1f1b.SPLITS == SPLITS == ("uniform", "compute")


def test_the_papers_7b_split():
    got = split_sequence("compute", 32768, 4, GPT_7B)
    want = [11021, 8421, 7087, 6239]
    assert sum(got) == 32768
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=0.01)
    assert got == want  # rounded down from the end, the rest to the first: the published numbers


@pytest.mark.parametrize("seq,s", [(32768, 2), (32768, 4), (32768, 8), (65536, 4), (131072, 4), (131072, 16)])
def test_compute_split_has_equal_flops(seq, s):
    spec = TransformerSpec("gpt_7b", 32, 32, 4096, 50304, seq, n_inner=16384)
    lengths = split_sequence("compute", seq, s, spec)
    flops = segment_flops(lengths, spec)
    assert max(flops) / min(flops) < 1.01
    # earlier segments are longer: later tokens attend to more keys
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert sum(flops) == pytest.approx(segment_flop(spec, seq, seq), rel=1e-12)


def test_segment_flops_follow_the_per_layer_model():
    lengths = [300, 212]
    got = segment_flops(lengths, SMALL)
    head = [4.0 * x * SMALL.n_embd * SMALL.vocab_size for x in lengths]
    want = [SMALL.n_layer * layer_forward_flops(SMALL, 300, 300) + head[0],
            SMALL.n_layer * layer_forward_flops(SMALL, 212, 512) + head[1]]
    assert got == pytest.approx(want)


@pytest.mark.parametrize("seq,s", [(32768, 4), (10, 3), (7, 7), (100, 1), (5, 4)])
def test_uniform_split_is_equal_with_the_remainder_first(seq, s):
    lengths = split_sequence("uniform", seq, s, SMALL)
    assert sum(lengths) == seq and len(lengths) == s
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)
    assert split_sequence("uniform", seq, s) == lengths  # needs no model


@pytest.mark.parametrize("strategy", SPLITS)
@pytest.mark.parametrize("seq", [1, 2, 3, 5, 17, 128, 512, 4096])
@pytest.mark.parametrize("s", [1, 2, 3, 4, 8, 16])
def test_lengths_are_whole_positive_and_add_up(strategy, seq, s):
    if s > seq:
        with pytest.raises(ValueError, match=rf"^pipeline\.segments={s}: more segments than tokens"):
            split_sequence(strategy, seq, s, SMALL)
        return
    lengths = split_sequence(strategy, seq, s, SMALL)
    assert len(lengths) == s and sum(lengths) == seq
    assert all(isinstance(x, int) and x >= 1 for x in lengths)


def test_one_segment_is_the_whole_sequence():
    assert split_sequence("compute", 4096, 1, GPT_7B) == [4096]
    assert split_sequence("compute", 64, 1, BERT) == [64]  # one segment needs no causal attention


@pytest.mark.parametrize(
    "args,key",
    [
        (("halves", 128, 2, SMALL), "schedule.split=halves"),
        (("uniform", 128, 0, SMALL), "pipeline.segments=0"),
        (("uniform", 128, 2.5, SMALL), "pipeline.segments=2.5"),
        (("compute", 4, 5, SMALL), "pipeline.segments=5"),
        (("uniform", 0, 1, SMALL), "model.seq_len=0"),
        (("compute", 64, 2, BERT), "pipeline.segments=2"),
        (("compute", 64, 2, None), "schedule.split=compute"),
    ],
)
def test_errors_name_the_key(args, key):
    with pytest.raises(ValueError) as e:
        split_sequence(*args)
    assert str(e.value).startswith(key)


@pytest.mark.parametrize("strategy", ["uniform", "compute"])
def test_sequence_parallel_segments_are_multiples_of_the_tensor_degree(strategy):
    """With pipeline.sequence_parallel each segment splits into T slices: the split's
    lengths rounded to multiples of T (the first ones to the nearest, the last the rest),
    as close to the unrounded split as that allows; a whole split stays as it is."""
    spec = TransformerSpec("gpt_7b", n_layer=32, n_head=32, n_embd=4096, vocab_size=50304, seq_len=32768)
    plain = split_sequence(strategy, 32768, 4, spec)
    got = split_sequence(strategy, 32768, 4, spec, multiple=8)
    assert sum(got) == 32768 and all(x % 8 == 0 for x in got)
    assert all(abs(a - b) <= 4 for a, b in zip(got[:-1], plain[:-1]))
    if all(x % 8 == 0 for x in plain):
        assert got == plain
    assert split_sequence(strategy, 30, 4, spec, multiple=8) == split_sequence(strategy, 30, 4, spec)  # 30 % 8
    with pytest.raises(ValueError, match="schedule.split=uniform: 4 segments of 16 tokens"):
        split_sequence("uniform", 16, 4, spec, multiple=8)
