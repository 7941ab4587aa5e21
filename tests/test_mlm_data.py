"""Masked-LM batches: BERT's 15% / 80-10-10 masking statistics, labels only where a
position is scored, at least one target per sequence, and batches that are a pure
function of (seed, step) (what lets every rank, and a resumed run, recompute them)."""

from pathlib import Path

import pytest
import torch

from pipeflow.data.mlm import IGNORE_INDEX, MASK_ID, MLM_VOCAB, MaskedText, build_mlm_data, mask_tokens
from pipeflow.data.text import PackedText

SEED = 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    # plain bytes only (no MASK id and no byte 0): any MASK_ID in the inputs is masking
    path = tmp_path_factory.mktemp("mlm") / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2000)))
    return path


@pytest.fixture(scope="module")
def data(corpus, tmp_path_factory):
    cfg = {"files": [str(corpus)], "max_bytes": None, "val_fraction": 0.05, "mask_prob": 0.15,
           "cache_dir": str(tmp_path_factory.mktemp("cache"))}
    return build_mlm_data(cfg, 64, SEED)


def test_masking_statistics():
    tokens = torch.randint(0, 256, (512, 128), generator=torch.Generator().manual_seed(0))
    inputs, labels = mask_tokens(tokens, 0.15, torch.Generator().manual_seed(1))
    chosen = labels != IGNORE_INDEX
    n = int(chosen.sum())
    assert abs(n / tokens.numel() - 0.15) < 0.005  # 65k positions: the share is within 3 sigma
    # labels hold the original bytes exactly where a position is scored
    assert torch.equal(labels[chosen], tokens[chosen])
    # positions not chosen are untouched
    assert torch.equal(inputs[~chosen], tokens[~chosen])
    masked = (inputs == MASK_ID) & chosen
    kept = (inputs == tokens) & chosen
    replaced = chosen & ~masked & ~kept
    assert not (inputs[~chosen] == MASK_ID).any()
    assert abs(masked.sum().item() / n - 0.8) < 0.015
    # a random byte equal to the original (1/256) counts as kept: 10% + 10%/256
    assert abs(kept.sum().item() / n - (0.1 + 0.1 / 256)) < 0.01
    assert abs(replaced.sum().item() / n - (0.1 - 0.1 / 256)) < 0.01
    assert int(inputs[replaced].max()) < 256 and int(inputs.max()) < MLM_VOCAB


def test_every_sequence_has_a_target():
    # a mask_prob so low that most rows would draw nothing
    tokens = torch.randint(0, 256, (200, 16), generator=torch.Generator().manual_seed(0))
    _, labels = mask_tokens(tokens, 0.001, torch.Generator().manual_seed(2))
    per_row = (labels != IGNORE_INDEX).sum(dim=1)
    assert per_row.min() >= 1
    assert (per_row == 1).float().mean() > 0.9  # rows that drew nothing got exactly one


def test_batches_are_a_function_of_seed_and_step(data, corpus, tmp_path):
    x, y = data.train_batch(3, 8)
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert ((y != IGNORE_INDEX).sum(dim=1) >= 1).all()
    # the same step again, and on a fresh copy (another rank, a resumed run): identical
    again = data.train_batch(3, 8)
    cfg = {"files": [str(corpus)], "max_bytes": None, "val_fraction": 0.05, "mask_prob": 0.15,
           "cache_dir": str(tmp_path)}
    other = build_mlm_data(cfg, 64, SEED)
    for a, b in zip((x, y), again):
        assert torch.equal(a, b)
    for a, b in zip((x, y), other.train_batch(3, 8)):
        assert torch.equal(a, b)
    # another step or another seed masks differently
    assert not torch.equal(y, data.train_batch(4, 8)[1])
    assert not torch.equal(y, build_mlm_data(cfg, 64, SEED + 1).train_batch(3, 8)[1])


def test_same_windows_as_the_text_data(data):
    # the MLM batch is the GPT run's input window, masked: unmasked positions agree
    tokens, _ = data.text.train_batch(5, 4)
    x, y = data.train_batch(5, 4)
    scored = y != IGNORE_INDEX
    assert torch.equal(x[~scored], tokens[~scored]) and torch.equal(y[scored], tokens[scored])


def test_validation_batches_repeat_exactly(data):
    first = list(data.val_batches(4, 3))
    second = list(data.val_batches(4, 3))
    assert len(first) == 3
    for (a, b), (c, d) in zip(first, second):
        assert torch.equal(a, c) and torch.equal(b, d)
        assert ((b != IGNORE_INDEX).sum(dim=1) >= 1).all()


def test_bad_mask_prob_names_the_key():
    text = PackedText(torch.arange(1000).numpy() % 256, 16, 0.1, SEED)
    for bad in (0, 1, 1.5, True):
        with pytest.raises(ValueError, match=r"data\.mask_prob="):
            MaskedText(text, bad, SEED)
