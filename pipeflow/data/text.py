"""Byte-level text for the GPT runs: a corpus loaded through ``datasets``, packed into
fixed-length windows, and batches that are a pure function of (seed, step), so any rank
recomputes any step's batch and a resumed run sees the batches it would have. The default
corpus is the running Python's standard library source (on disk, no download)."""

from __future__ import annotations

import os
import sysconfig
import tempfile
from typing import Iterator, Mapping, Sequence

import datasets
import numpy as np
import torch

# Ends every document, like GPT-2's <|endoftext|>: NUL never occurs in text files, so the
# model can tell where one file stops and the next starts.
EOT = 0

# default corpus: folders of the standard library that are not library source
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, nothing to download."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def default_corpus_files(max_files: int | None = None) -> list[str]:
    """The standard library's ``.py`` files (no site-packages, no test folders), sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    # sort by the path below the stdlib root, with '/' separators, so the order is the
    # same on every machine whatever os.walk returns
    found.sort(key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))
    return found if max_files is None else found[:max_files]


def _default_cache_dir() -> str:
    # A folder of our own under the temp dir: always writable, and it never mixes with
    # (or fills) the user's Hugging Face cache.
    return os.path.join(tempfile.gettempdir(), "pipeflow-datasets")


def load_tokenizer(folder: str):
    """``data.tokenizer``: a tokenizer saved in a local folder (``AutoTokenizer``, local
    files only: nothing is downloaded)."""
    from transformers import AutoTokenizer

    path = os.path.expanduser(str(folder))
    if not os.path.isdir(path):
        raise ValueError(f"data.tokenizer={folder}: not a folder (a tokenizer saved with save_pretrained); "
                         f"null tokenises bytes")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"data.tokenizer={folder}: no tokenizer there ({err}); null tokenises bytes") from None


def tokenize_documents(texts: Sequence[str], tokenizer) -> np.ndarray:
    """Each document's token ids followed by the tokenizer's end-of-text id (its eos, else
    its sep, else 0), in order."""
    end = tokenizer.eos_token_id
    if end is None:
        end = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else 0
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(int(end))
    return np.asarray(ids, dtype=np.int64)


def load_corpus_tokens(files: Sequence[str], max_bytes: int | None = None, cache_dir: str | None = None,
                       tokenizer: str | None = None) -> np.ndarray:
    """The files' text as bytes (uint8), in file order, each document followed by EOT; with
    ``tokenizer`` (a local folder), its ids (int64). Read through ``datasets`` (text mode:
    "\\r\\n" becomes "\\n"); ``max_bytes`` cuts the text to that many bytes."""
    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError("data.files is empty: list at least one text file, or set data.files=null for the default corpus")
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"data.files: {f} is not a readable file; list existing text files")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"data.max_bytes={max_bytes!r}: must be a whole number >= 1, or null for all the text")
    if max_bytes is not None:
        # file sizes are a good enough forecast of UTF-8 bytes: stop reading once the
        # leading files reach the cap, so a 3 MB cap costs 3 MB of reading
        keep, total = [], 0
        for f in files:
            keep.append(f)
            total += os.path.getsize(f) + 1
            if total >= max_bytes:
                break
        files = keep

    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # one bar per rank per load is noise
    try:
        ds = datasets.load_dataset(
            "text",
            data_files=files,
            sample_by="document",
            split="train",
            cache_dir=cache_dir or _default_cache_dir(),
        )
        texts = ds["text"]
    finally:
        if not quiet:
            datasets.utils.enable_progress_bars()
    sep = bytes([EOT])
    data = b"".join(t.encode("utf-8") + sep for t in texts)
    if max_bytes is not None:
        data = data[:max_bytes]
    if tokenizer is not None:
        docs = data.decode("utf-8", errors="ignore").split(chr(EOT))
        return tokenize_documents([d for d in docs if d], load_tokenizer(tokenizer))
    return np.frombuffer(data, dtype=np.uint8).copy()


class PackedText:
    """Tokens cut into non-overlapping windows of seq_len + 1 (inputs and shifted targets); the
    last ``val_fraction`` of them held out as one contiguous block, so no neighbouring window
    leaks into validation."""

    def __init__(self, tokens: np.ndarray, seq_len: int, val_fraction: float, seed: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r}: must be a whole number >= 1")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction!r}: the held-out share of the text; use a number in [0, 1)")
        tokens = np.asarray(tokens)
        window = seq_len + 1
        n = len(tokens) // window
        num_val = 0 if val_fraction == 0 else max(1, round(n * val_fraction))
        if n - num_val < 1:
            needs = f"training and validation (data.val_fraction={val_fraction}) need one each" if num_val else "training needs one"
            raise ValueError(
                f"too little text: {len(tokens)} tokens make {n} windows of seq_len+1={window} tokens, and {needs}; "
                f"add text (data.files, data.max_bytes) or lower seq_len"
            )
        self.seq_len, self.seed = seq_len, seed
        self.windows = tokens[: n * window].reshape(n, window)
        self.num_val = num_val
        self.num_train = n - num_val
        self._perms: dict[int, np.ndarray] = {}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """A permutation of the training windows, fixed by (seed, epoch)."""
        if epoch not in self._perms:
            if len(self._perms) > 4:  # a batch spans at most a few epochs
                self._perms.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_train)
        return self._perms[epoch]

    def _pairs(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self.windows[rows].astype(np.int64))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch_size, seq_len]: samples step*batch_size ... of the
        stream that walks a fresh permutation of the training windows each epoch."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be a whole number >= 0")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a whole number >= 1")
        first = step * batch_size
        rows = np.empty(batch_size, dtype=np.int64)
        for k in range(batch_size):
            epoch, pos = divmod(first + k, self.num_train)
            rows[k] = self._epoch_order(epoch)[pos]
        return self._pairs(rows)

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Up to ``max_batches`` full batches over the validation windows in order (the last wraps
        around to the first windows)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be a whole number >= 1")
        if self.num_val == 0:
            return
        count = min(max_batches, -(-self.num_val // batch_size))
        for b in range(count):
            rows = self.num_train + (np.arange(b * batch_size, (b + 1) * batch_size) % self.num_val)
            yield self._pairs(rows)


def build_text_data(data_cfg: Mapping, seq_len: int, seed: int) -> PackedText:
    """The ``data`` config group (text_corpus): files (null: the default corpus), max_bytes,
    val_fraction, cache_dir (null: under the temp dir), tokenizer (null: bytes)."""
    files = data_cfg.get("files")
    if files is None:
        files = default_corpus_files()
    elif isinstance(files, (str, os.PathLike)):
        files = [files]
    tokens = load_corpus_tokens(list(files), max_bytes=data_cfg.get("max_bytes"), cache_dir=data_cfg.get("cache_dir"),
                                tokenizer=data_cfg.get("tokenizer"))
    return PackedText(tokens, seq_len, val_fraction=data_cfg.get("val_fraction", 0.05), seed=seed)
