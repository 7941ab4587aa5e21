"""Byte-level text data: tokenizer, the default corpus, loading user files through
datasets, packing, train batches as a pure function of (seed, step), held-out windows."""

import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeflow.data import ByteTokenizer, PackedText, build_text_data, default_corpus_files, load_corpus_tokens
from pipeflow.data.text import EOT

CONF = Path(__file__).resolve().parent.parent / "conf"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # everything here must work with no network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # π ≈ 3.14159 ✓"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"  # invalid UTF-8 is replaced, not raised


def test_default_corpus_is_stdlib_source_and_deterministic():
    files = default_corpus_files()
    assert len(files) > 50 and files == default_corpus_files()
    root = sysconfig.get_paths()["stdlib"]
    rel = [os.path.relpath(f, root).replace(os.sep, "/") for f in files]
    assert rel == sorted(rel)
    assert all(f.endswith(".py") and os.path.isfile(f) for f in files)
    for r in rel:
        parts = r.split("/")[:-1]
        assert "site-packages" not in parts and "test" not in parts and "tests" not in parts, r
    assert default_corpus_files(max_files=5) == files[:5]


def test_user_files_load_in_order_with_separators(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file\nwith two lines\n", encoding="utf-8")
    b.write_text("zweite Datei: äöü\n", encoding="utf-8")
    tokens = load_corpus_tokens([str(b), str(a)], cache_dir=str(tmp_path / "cache"))
    assert tokens.dtype == np.uint8
    expected = b.read_bytes() + bytes([EOT]) + a.read_bytes() + bytes([EOT])
    assert tokens.tobytes() == expected
    # max_bytes cuts the result
    assert load_corpus_tokens([str(b), str(a)], max_bytes=7, cache_dir=str(tmp_path / "cache")).tobytes() == expected[:7]


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^data\.files is empty"):
        load_corpus_tokens([])
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt"):
        load_corpus_tokens([str(missing)])


def test_packing_targets_shift_and_splits():
    tokens = _tokens(10_000)
    data = PackedText(tokens, seq_len=32, val_fraction=0.1, seed=0)
    n = len(tokens) // 33
    assert data.num_train + data.num_val == n and data.num_val == round(0.1 * n)
    x, y = data.train_batch(0, 8)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is one packed window of the token stream
    windows = tokens[: n * 33].reshape(n, 33)
    for row_x, row_y in zip(x, y):
        full = np.concatenate([row_x.numpy(), row_y.numpy()[-1:]])
        assert any(np.array_equal(full, w) for w in windows[: data.num_train])


def test_train_batches_are_a_function_of_seed_and_step():
    tokens = _tokens(20_000)
    a = PackedText(tokens, seq_len=16, val_fraction=0.05, seed=3)
    b = PackedText(tokens, seq_len=16, val_fraction=0.05, seed=3)
    # b asks in another order (a resumed run, another rank): same batches
    for step in [7, 0, 123, 7]:
        assert all(torch.equal(u, v) for u, v in zip(a.train_batch(step, 4), b.train_batch(step, 4)))
    other = PackedText(tokens, seq_len=16, val_fraction=0.05, seed=4)
    assert not torch.equal(a.train_batch(0, 4)[0], other.train_batch(0, 4)[0])
    assert not torch.equal(a.train_batch(0, 4)[0], a.train_batch(1, 4)[0])


def test_one_epoch_visits_every_training_window_once():
    data = PackedText(_tokens(5 * 11 * 20), seq_len=10, val_fraction=0.2, seed=1)
    assert data.num_train == 80
    rows = torch.cat([data.train_batch(step, 5)[0] for step in range(16)])
    keys = {tuple(r.tolist()) for r in rows}
    train = {tuple(w[:-1].tolist()) for w in data.windows[: data.num_train]}
    assert keys == train
    # the next epoch is another order of the same windows
    nxt = torch.cat([data.train_batch(step, 5)[0] for step in range(16, 32)])
    assert not torch.equal(rows, nxt) and {tuple(r.tolist()) for r in nxt} == train


def test_validation_windows_are_held_out():
    tokens = _tokens(30_000)
    data = PackedText(tokens, seq_len=20, val_fraction=0.1, seed=0)
    val = [x for x, _ in data.val_batches(batch_size=8, max_batches=1000)]
    assert len(val) == -(-data.num_val // 8) and all(v.shape == (8, 20) for v in val)
    val_rows = {tuple(r.tolist()) for v in val for r in v}
    assert len(val_rows) == data.num_val  # each held-out window, the last batch wrapping around
    train_rows = {tuple(r.tolist()) for s in range(0, 2 * data.num_train // 16) for r in data.train_batch(s, 16)[0]}
    assert not val_rows & train_rows
    # the held-out block is the end of the text
    last = data.windows[-1]
    assert tuple(last[:-1].tolist()) in val_rows
    again = [x for x, _ in data.val_batches(batch_size=8, max_batches=2)]
    assert len(again) == 2 and all(torch.equal(u, v) for u, v in zip(again, val))


def test_too_little_data():
    with pytest.raises(ValueError, match=r"too little text.*data\.val_fraction=0\.05"):
        PackedText(_tokens(40), seq_len=32, val_fraction=0.05, seed=0)
    with pytest.raises(ValueError, match=r"data\.val_fraction=1"):
        PackedText(_tokens(4000), seq_len=32, val_fraction=1, seed=0)
    data = PackedText(_tokens(66), seq_len=32, val_fraction=0.05, seed=0)
    assert data.num_train == data.num_val == 1


def test_build_from_config_default_corpus(tmp_path):
    cfg = OmegaConf.load(CONF / "data" / "text_corpus.yaml")
    cfg.max_bytes = 200_000
    cfg.cache_dir = str(tmp_path)
    data = build_text_data(cfg, seq_len=64, seed=0)
    assert data.num_train > 1000 and data.num_val >= 1
    x, _ = data.train_batch(0, 2)
    # Python source: mostly printable ASCII
    assert (x < 128).float().mean() > 0.95
    # the stream starts with the first corpus file
    first = Path(default_corpus_files()[0]).read_bytes().replace(b"\r\n", b"\n")
    assert len(first) > 65 and data.windows[0].tobytes() == first[:65]
