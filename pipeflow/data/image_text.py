"""Image-text pairs for the concurrent-branch model (pipeflow.models.cbm): a
``datasets.Dataset`` with "image" ([H, W] or [C, H, W] floats) and "text" (a caption)
columns; by default scikit-learn's bundled 8x8 digits, captioned from their labels, or a
user's ``data.files`` (parquet, json/jsonl, csv with images as JSON lists).

Each batch trains ITM (half the rows get another example's caption, label 0) and MLM (15%
of a caption's bytes picked: 80% MASK, 10% a random byte, 10% kept), and is a pure
function of (seed, step), as in pipeflow.data.text."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Iterator, Mapping, Sequence

import datasets
import numpy as np
import torch

MASK = 256  # token ids: 0..255 bytes, then MASK and PAD
PAD = 257
NUM_TOKEN_IDS = 258  # model.text.vocab_size must be at least this
IGNORE = -100  # label of positions without an MLM target (torch's cross_entropy default)

_DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_LOADERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# the held-out rows do not depend on the run's seed, so validation losses compare across seeds
_SPLIT_SEED = 0


def digits_dataset() -> datasets.Dataset:
    """scikit-learn's 1797 8x8 digits as (image in [0, 1], caption from the label) pairs."""
    from sklearn.datasets import load_digits  # imported here: only the default data needs it

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)  # pixel values are 0..16
    captions = [f"a handwritten digit {_DIGIT_WORDS[d]}" for d in digits.target]
    return datasets.Dataset.from_dict({"image": [im.tolist() for im in images], "text": captions})


def load_pairs(files: Sequence[str], cache_dir: str | None = None) -> datasets.Dataset:
    """The user's image-text files through ``datasets.load_dataset``; checks the columns."""
    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError("data.files is empty: list at least one parquet/json/csv file, or set data.files=null for the digits")
    kinds = set()
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"data.files: {f} is not a readable file; list existing parquet/json/csv files")
        ext = os.path.splitext(f)[1].lower()
        if ext not in _LOADERS:
            raise ValueError(f"data.files: {f} is not .parquet, .json, .jsonl or .csv; convert it to one of those")
        kinds.add(_LOADERS[ext])
    if len(kinds) > 1:
        raise ValueError(f"data.files mixes formats ({', '.join(sorted(kinds))}); give files of one format")
    ds = datasets.load_dataset(
        kinds.pop(),
        data_files=files,
        split="train",
        cache_dir=cache_dir or os.path.join(tempfile.gettempdir(), "pipeflow-datasets"),
    )
    for column in ("image", "text"):
        if column not in ds.column_names:
            raise ValueError(
                f"data.files has no {column!r} column (found {ds.column_names}); the pairs need 'image' and 'text'"
            )
    return ds


def _images_array(column: Sequence) -> np.ndarray:
    """The image column as one float32 array [N, C, H, W]; every image the same size."""
    out, first = [], None
    for i, im in enumerate(column):
        if isinstance(im, str):  # csv stores an image as a JSON list
            im = json.loads(im)
        a = np.asarray(im, dtype=np.float32)
        if a.ndim == 2:
            a = a[None]  # grey: one channel
        if a.ndim != 3:
            raise ValueError(f"data.files: image {i} has shape {a.shape}; images must be [H, W] or [C, H, W] arrays")
        if first is None:
            first = a.shape
        elif a.shape != first:
            raise ValueError(
                f"data.files: images have inconsistent sizes ({first} for image 0, {a.shape} for image {i}); "
                f"give every image the same size"
            )
        out.append(a)
    return np.stack(out)


def encode_caption(text: str, seq_len: int) -> np.ndarray:
    """UTF-8 bytes cut or padded (PAD) to seq_len."""
    ids = np.full(seq_len, PAD, dtype=np.int64)
    b = list(text.encode("utf-8"))[:seq_len]
    ids[: len(b)] = b
    return ids


class ImageTextPairs:
    """Images [N, C, H, W], captions as tokens [N, T], a held-out validation block."""

    def __init__(self, ds: datasets.Dataset, seq_len: int, val_fraction: float, seed: int, mask_prob: float = 0.15):
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction!r}: the held-out share of the pairs; use a number in [0, 1)")
        if isinstance(mask_prob, bool) or not isinstance(mask_prob, (int, float)) or not 0 < mask_prob <= 1:
            raise ValueError(f"data.mask_prob={mask_prob!r}: the share of caption bytes masked; use a number in (0, 1]")
        if len(ds) == 0:
            raise ValueError("data.files holds no rows; give files with image-text pairs")
        self.images = torch.from_numpy(_images_array(ds["image"]))
        texts = list(ds["text"])
        if len(set(texts)) < 2:
            raise ValueError("data.files: every caption is the same, so no mismatched (ITM negative) pair can be made")
        self.tokens = torch.from_numpy(np.stack([encode_caption(t, seq_len) for t in texts]))
        # caption identity (not row identity) decides what a mismatch is: two rows with
        # the same caption are not a negative pair
        _, self.caption_id = np.unique(np.asarray(texts, dtype=object).astype(str), return_inverse=True)
        self.seq_len, self.seed, self.mask_prob = seq_len, seed, float(mask_prob)

        n = len(texts)
        order = np.random.default_rng(_SPLIT_SEED).permutation(n)
        num_val = 0 if val_fraction == 0 else max(1, round(n * val_fraction))
        if n - num_val < 2:
            raise ValueError(f"too few pairs: {n} rows leave {n - num_val} for training; add pairs or lower data.val_fraction")
        self.train_rows, self.val_rows = order[: n - num_val], order[n - num_val :]
        self._perms: dict[int, np.ndarray] = {}

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """A permutation of the training rows, fixed by (seed, epoch)."""
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.train_rows)
        return self._perms[epoch]

    def _make_batch(self, rows: np.ndarray, pool: np.ndarray, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """Rows' images with own or mismatched captions (from ``pool``), then MLM masking."""
        B = len(rows)
        itm = np.ones(B, dtype=np.float32)
        text_rows = rows.copy()
        for r in rng.permutation(B)[: B // 2]:  # exactly half of the batch are negatives
            while True:  # another caption; there are at least two distinct ones
                j = pool[rng.integers(len(pool))]
                if self.caption_id[j] != self.caption_id[rows[r]]:
                    break
            text_rows[r], itm[r] = j, 0.0
        ids = self.tokens[text_rows].clone()
        input_ids, labels = self._mask(ids, rng)
        return {
            "image": self.images[rows].clone(),
            "input_ids": input_ids,
            "mlm_labels": labels,
            "itm_label": torch.from_numpy(itm),
        }

    def _mask(self, ids: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT's masking of the caption bytes (never PAD); at least one target per row."""
        real = (ids != PAD).numpy()
        picked = (rng.random(ids.shape) < self.mask_prob) & real
        for r in np.flatnonzero(~picked.any(1) & real.any(1)):
            picked[r, rng.choice(np.flatnonzero(real[r]))] = True
        action = rng.random(ids.shape)  # < .8 MASK, < .9 random byte, else unchanged
        random_bytes = rng.integers(0, 256, ids.shape)
        labels = np.where(picked, ids.numpy(), IGNORE)
        out = ids.numpy().copy()
        out[picked & (action < 0.8)] = MASK
        swap = picked & (action >= 0.8) & (action < 0.9)
        out[swap] = random_bytes[swap]
        return torch.from_numpy(out), torch.from_numpy(labels)

    def train_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """A batch dict (see :func:`build_image_text_data`): samples step*batch_size ... of the
        stream that walks a fresh permutation of the training pairs each epoch."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be a whole number >= 0")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a whole number >= 1")
        first, n = step * batch_size, len(self.train_rows)
        rows = np.array([self._epoch_order((first + k) // n)[(first + k) % n] for k in range(batch_size)])
        return self._make_batch(rows, self.train_rows, np.random.default_rng([self.seed, step, 1]))

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        """Up to ``max_batches`` full batches over the held-out pairs in order (the last wraps
        around); negatives come from the held-out pairs too, the same on every call."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a whole number >= 1")
        nv = len(self.val_rows)
        if nv == 0:
            return
        pool = self.val_rows if len(set(self.caption_id[self.val_rows])) > 1 else self.train_rows
        for b in range(min(max_batches, -(-nv // batch_size))):
            rows = self.val_rows[np.arange(b * batch_size, (b + 1) * batch_size) % nv]
            yield self._make_batch(rows, pool, np.random.default_rng([_SPLIT_SEED, b, 2]))


def build_image_text_data(data_cfg: Mapping, model_cfg: Mapping, seed: int) -> ImageTextPairs:
    """The ``data`` group (image_text): files (null: the digits), val_fraction, mask_prob,
    cache_dir; ValueError where the images do not fit ``model.vision`` or the ids
    ``model.text``. A batch: image [B, C, H, W] float32, input_ids [B, T] int64, mlm_labels
    [B, T] int64 (-100: nothing predicted), itm_label [B] float32 (1 matched, 0 mismatched)."""
    files = data_cfg.get("files")
    if files is None:
        ds = digits_dataset()
    else:
        ds = load_pairs([files] if isinstance(files, (str, os.PathLike)) else list(files), data_cfg.get("cache_dir"))
    vision, text = model_cfg["vision"], model_cfg["text"]
    if text["vocab_size"] < NUM_TOKEN_IDS:
        raise ValueError(
            f"model.text.vocab_size={text['vocab_size']} is below the {NUM_TOKEN_IDS} ids captions use "
            f"(256 bytes, MASK, PAD); use at least {NUM_TOKEN_IDS}"
        )
    data = ImageTextPairs(
        ds,
        seq_len=text["seq_len"],
        val_fraction=data_cfg.get("val_fraction", 0.1),
        seed=seed,
        mask_prob=data_cfg.get("mask_prob", 0.15),
    )
    want = (vision.get("channels", 1), vision["image_size"], vision["image_size"])
    if data.image_shape != want:
        src = "data.files" if files is not None else "the digits (data.files=null)"
        raise ValueError(
            f"{src}: images are {data.image_shape} but model.vision asks for {want} "
            f"(channels, image_size, image_size); use a model whose vision branch matches"
        )
    return data
