"""How a model plugs into the runtime: build a stage, feed the first stage, score the
last, and say what a message between two stages looks like (receivers allocate
buffers before the data arrives)."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..models.gpt import build_stage, hidden_shape, lm_loss


class GPTAdapter:
    """A GPT split into a chain of stages; a batch is (input ids, targets), [B, T] each."""

    def __init__(
        self,
        model_cfg: Mapping,
        layers_per_stage: Sequence[int],
        microbatch_size: int,
        seq_len: int,
        seed: int,
        device: torch.device,
    ):
        self.model_cfg = model_cfg
        self.layers_per_stage = list(layers_per_stage)
        self.num_stages = len(self.layers_per_stage)
        self.mbs = microbatch_size
        self.seq_len = seq_len
        self.seed = seed
        self.device = device
        self._hidden = hidden_shape(model_cfg, microbatch_size, seq_len)
        # the embedding (first stage) and the LM head (last stage) share one weight
        self.tied_stages = (0, self.num_stages - 1)

    def build_stage(self, stage: int) -> torch.nn.Module:
        return build_stage(self.model_cfg, self.layers_per_stage, stage, self.seed).to(self.device)

    def _rows(self, t: torch.Tensor, mb: int) -> torch.Tensor:
        return t[mb * self.mbs : (mb + 1) * self.mbs].to(self.device, non_blocking=True)

    def stage_input(self, batch, mb: int) -> torch.Tensor:
        return self._rows(batch[0], mb)

    def loss(self, logits: torch.Tensor, batch, mb: int, normalizer: float) -> torch.Tensor:
        return lm_loss(logits, self._rows(batch[1], mb), normalizer)

    def message_spec(self, src_stage: int, dst_stage: int) -> tuple[tuple[int, ...], torch.dtype]:
        return self._hidden, torch.float32

    def tokens_per_microbatch(self) -> int:
        return self.mbs * self.seq_len
