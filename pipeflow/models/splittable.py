"""What the stage-splittable models share: the checked shape of a model config, the
per-name seeded initialisation that makes every split draw the same weights, and the
layer range a stage holds."""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..planning.transformer import TransformerSpec


def family_spec(model_cfg: Mapping, family: str, what: str,
                spec: TransformerSpec | None = None) -> tuple[TransformerSpec, float]:
    """The model's shape (checked with the project's messages; ``spec``: the one a run plan
    carries, else read from ``model_cfg``) and its dropout, for a builder of ``family``
    models (``what`` names it in the error)."""
    got = model_cfg.get("family", "gpt")
    if got != family:
        raise ValueError(f"model.family={got}: the {what} stage model builds {what} only; allowed values: {family}")
    spec = spec or TransformerSpec.from_config(model_cfg)
    dropout = model_cfg.get("dropout", 0.0)
    if dropout is None:
        dropout = 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout={dropout!r}: a probability; use a number in [0, 1)")
    return spec, float(dropout)


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded by (seed, name) through a stable hash (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def seeded_normal_(param: Tensor, std: float, seed: int, name: str, rows: int | None = None) -> None:
    """``param`` drawn from N(0, std) by the generator of (seed, name). ``rows``: only its
    first rows are drawn (as an unpadded table of that many rows draws them) and the rest
    are zero: a vocabulary table padded past its words (model.vocab_multiple), whose padding
    rows no token looks up and no loss scores, so they stay zero as they train."""
    rows = param.size(0) if rows is None else rows
    values = torch.randn((rows, *param.shape[1:]), generator=seeded_generator(seed, name), dtype=torch.float32) * std
    with torch.no_grad():
        param[:rows].copy_(values)
        param[rows:].zero_()


def block_output(out) -> Tensor:
    """A transformers block's hidden states (some versions return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def layer_bounds(n_layer: int, layers_per_stage: Sequence[int], stage: int) -> tuple[int, int]:
    layers = list(layers_per_stage)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers) or sum(layers) != n_layer:
        raise ValueError(
            f"partition layers_per_stage={layers}: needs whole numbers >= 1, one per stage, "
            f"adding up to model.n_layer={n_layer}"
        )
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < len(layers):
        raise ValueError(f"stage={stage!r}: allowed values: 0 to {len(layers) - 1} (pipeline.stages={len(layers)})")
    lo = sum(layers[:stage])
    return lo, lo + layers[stage]
