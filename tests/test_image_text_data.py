"""Image-text pairs: the digits default, user files through datasets with their errors,
half-mismatched batches, BERT masking, batches as a pure function of (seed, step)."""

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeflow.data.image_text import IGNORE, MASK, PAD, build_image_text_data, digits_dataset

CONF = Path(__file__).resolve().parent.parent / "conf"
TINY = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "cbm_tiny.yaml"))
DATA = OmegaConf.to_container(OmegaConf.load(CONF / "data" / "image_text.yaml"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def digits():
    return build_image_text_data(DATA, TINY, seed=3)


def _indexed_pairs(n=40, size=8):
    """Image i is filled with i/100 and captioned "caption <i>": a batch row tells its pair."""
    return {"image": [np.full((size, size), i / 100, dtype=np.float32).tolist() for i in range(n)],
            "text": [f"caption {i}" for i in range(n)]}


def _write(tmp_path, columns, fmt="parquet"):
    ds = datasets.Dataset.from_dict(columns)
    path = tmp_path / f"pairs.{fmt}"
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "json":
        ds.to_json(str(path))
    else:
        ds.map(lambda r: {"image": json.dumps(r["image"])}).to_csv(str(path), index=False)
    return str(path)


def _unmasked(batch):
    """The captions before masking: the labels hold the original bytes where masked."""
    ids = batch["input_ids"].clone()
    picked = batch["mlm_labels"] != IGNORE
    ids[picked] = batch["mlm_labels"][picked]
    return ["".join(chr(t) for t in row if t != PAD) for row in ids.tolist()]


def test_digits_are_captioned_from_labels():
    ds = digits_dataset()
    assert ds.column_names == ["image", "text"] and len(ds) == 1797
    img = np.asarray(ds[7]["image"])
    assert img.shape == (8, 8) and 0 <= img.min() and img.max() <= 1 and img.max() > 0.5
    assert ds[7]["text"] == "a handwritten digit seven"


def test_batch_format(digits):
    b = digits.train_batch(0, 10)
    assert b["image"].shape == (10, 1, 8, 8) and b["image"].dtype == torch.float32
    assert b["input_ids"].shape == b["mlm_labels"].shape == (10, TINY["text"]["seq_len"])
    assert b["input_ids"].dtype == b["mlm_labels"].dtype == torch.int64
    assert b["itm_label"].tolist().count(0.0) == 5 and b["itm_label"].tolist().count(1.0) == 5
    assert int(b["input_ids"].max()) < TINY["text"]["vocab_size"]
    assert all(c.startswith("a handwritten digit ") for c in _unmasked(b))


def test_batches_are_a_pure_function_of_seed_and_step(digits):
    again = build_image_text_data(DATA, TINY, seed=3)
    for step in (0, 5, 400):  # 400 * 16 rows is past the first epoch
        a, b = digits.train_batch(step, 16), again.train_batch(step, 16)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(digits.train_batch(1, 16)["image"], digits.train_batch(2, 16)["image"])
    other = build_image_text_data(DATA, TINY, seed=4).train_batch(5, 16)
    assert not torch.equal(other["image"], digits.train_batch(5, 16)["image"])


def test_mismatched_pairs_have_another_caption(tmp_path):
    data = build_image_text_data({**DATA, "files": [_write(tmp_path, _indexed_pairs())]}, TINY, seed=0)
    for step in range(5):
        b = data.train_batch(step, 8)
        own = [f"caption {round(float(im.mean()) * 100)}" for im in b["image"]]
        for caption, mine, label in zip(_unmasked(b), own, b["itm_label"].tolist()):
            assert (caption == mine) == (label == 1.0)


def test_masking_follows_bert(digits):
    picked = masked = swapped = real = 0
    for step in range(60):
        b = digits.train_batch(step, 32)
        ids, labels = b["input_ids"], b["mlm_labels"]
        sel = labels != IGNORE
        assert (ids[~sel] != MASK).all()  # only picked positions change
        assert (labels[sel] != PAD).all() and sel.any(1).all()  # never PAD; >= 1 target per row
        real += sum(len(c) for c in _unmasked(b))  # caption bytes (ASCII), PAD excluded
        picked += int(sel.sum())
        masked += int((ids[sel] == MASK).sum())
        swapped += int(((ids[sel] != MASK) & (ids[sel] != labels[sel])).sum())
    assert 0.13 < picked / real < 0.18
    assert 0.75 < masked / picked < 0.85
    assert 0.06 < swapped / picked < 0.12  # 10% random bytes, minus those that hit the same byte


def test_validation_is_held_out_and_fixed(digits):
    assert not set(digits.val_rows) & set(digits.train_rows)
    assert len(digits.val_rows) == round(1797 * DATA["val_fraction"])
    other = build_image_text_data(DATA, TINY, seed=99)
    a, b = list(digits.val_batches(16, 3)), list(other.val_batches(16, 3))
    assert len(a) == 3 and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


@pytest.mark.parametrize("fmt", ["parquet", "json", "csv"])
def test_user_files_load(tmp_path, fmt):
    data = build_image_text_data({**DATA, "files": _write(tmp_path, _indexed_pairs(), fmt)}, TINY, seed=0)
    assert data.image_shape == (1, 8, 8) and len(data.train_rows) + len(data.val_rows) == 40


@pytest.mark.parametrize("drop", ["image", "text"])
def test_missing_column_fails(tmp_path, drop):
    cols = _indexed_pairs()
    del cols[drop]
    cols["other"] = list(range(40))
    with pytest.raises(ValueError, match=f"data.files has no '{drop}' column"):
        build_image_text_data({**DATA, "files": [_write(tmp_path, cols)]}, TINY, seed=0)


def test_empty_file_list_fails():
    with pytest.raises(ValueError, match="data.files is empty"):
        build_image_text_data({**DATA, "files": []}, TINY, seed=0)


def test_inconsistent_image_sizes_fail(tmp_path):
    cols = _indexed_pairs()
    cols["image"][5] = np.zeros((9, 9)).tolist()
    with pytest.raises(ValueError, match="data.files: images have inconsistent sizes"):
        build_image_text_data({**DATA, "files": [_write(tmp_path, cols, "json")]}, TINY, seed=0)


def test_images_must_fit_the_model(tmp_path):
    with pytest.raises(ValueError, match="model.vision"):
        build_image_text_data({**DATA, "files": [_write(tmp_path, _indexed_pairs(size=16))]}, TINY, seed=0)
    small_vocab = {**TINY, "text": {**TINY["text"], "vocab_size": 256}}
    with pytest.raises(ValueError, match="model.text.vocab_size"):
        build_image_text_data(DATA, small_vocab, seed=0)
