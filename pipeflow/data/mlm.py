"""Masked-language-modelling batches over the byte-level corpus (BERT runs): the windows of
:mod:`pipeflow.data.text`, ``data.mask_prob`` (15%) of positions chosen (80% [MASK], 10% a
random byte, 10% kept; at least one per sequence), labels -100 elsewhere. Ids: bytes
0..255, then the special tokens ([MASK] used; [PAD], [CLS], [SEP] reserved), so
``model.vocab_size >= MLM_VOCAB``. A pure function of (seed, step), or (seed, batch index)
for validation."""

from __future__ import annotations

import hashlib
from typing import Iterator, Mapping

import torch

from .text import ByteTokenizer, PackedText, build_text_data

PAD_ID = ByteTokenizer.vocab_size  # 256, reserved
MASK_ID = PAD_ID + 1  # 257
CLS_ID = PAD_ID + 2  # 258, reserved
SEP_ID = PAD_ID + 3  # 259, reserved
MLM_VOCAB = PAD_ID + 4  # 260: the smallest model.vocab_size that covers every id
IGNORE_INDEX = -100  # label of a position that is not scored (torch's cross_entropy default)

# BERT's split of the chosen positions
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1  # the remaining 10% keep their byte


def _generator(seed: int, kind: str, index: int) -> torch.Generator:
    """A generator fixed by (seed, kind, index) through a stable hash (Python's hash() is salted)."""
    digest = hashlib.sha256(f"mlm:{seed}:{kind}:{index}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def mask_tokens(tokens: torch.Tensor, mask_prob: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) for byte tokens [B, T], BERT's 80/10/10 masking drawn from ``gen``."""
    if tokens.dim() != 2 or tokens.size(1) < 1:
        raise ValueError(f"tokens of shape {tuple(tokens.shape)}: need [batch, seq_len] with seq_len >= 1")
    B, T = tokens.shape
    chosen = torch.rand((B, T), generator=gen) < mask_prob
    # at least one target per sequence: a row that drew none gets one position at random
    forced = torch.randint(0, T, (B,), generator=gen)
    empty = ~chosen.any(dim=1)
    chosen[empty, forced[empty]] = True

    how = torch.rand((B, T), generator=gen)
    random_bytes = torch.randint(0, ByteTokenizer.vocab_size, (B, T), generator=gen)
    inputs = tokens.clone()
    to_mask = chosen & (how < MASK_SHARE)
    to_random = chosen & (how >= MASK_SHARE) & (how < MASK_SHARE + RANDOM_SHARE)
    inputs[to_mask] = MASK_ID
    inputs[to_random] = random_bytes[to_random]
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[chosen] = tokens[chosen]
    return inputs, labels


class MaskedText:
    """MLM batches over packed byte windows: (input_ids, labels), each [batch_size, seq_len]."""

    def __init__(self, text: PackedText, mask_prob: float, seed: int):
        if isinstance(mask_prob, bool) or not isinstance(mask_prob, (int, float)) or not 0 < mask_prob < 1:
            raise ValueError(f"data.mask_prob={mask_prob!r}: the share of positions to predict; use a number in (0, 1)")
        self.text, self.mask_prob, self.seed = text, float(mask_prob), seed
        self.seq_len = text.seq_len

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same windows the GPT runs see at this step, masked by (seed, step)."""
        tokens, _next = self.text.train_batch(step, batch_size)  # validates step and batch_size
        return mask_tokens(tokens, self.mask_prob, _generator(self.seed, "train", step))

    def val_batches(self, batch_size: int, max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Up to ``max_batches`` batches of held-out windows, masked the same way on every call."""
        for b, (tokens, _next) in enumerate(self.text.val_batches(batch_size, max_batches)):
            yield mask_tokens(tokens, self.mask_prob, _generator(self.seed, "val", b))


def build_mlm_data(data_cfg: Mapping, seq_len: int, seed: int) -> MaskedText:
    """The ``data`` config group (mlm_corpus): text_corpus' keys (files, max_bytes,
    val_fraction, cache_dir) plus mask_prob."""
    return MaskedText(build_text_data(data_cfg, seq_len, seed), data_cfg.get("mask_prob", 0.15), seed)
