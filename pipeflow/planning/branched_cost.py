"""Analytic cost of a concurrent-branch model's stages (vision tower, text tower, fused head).

Each branch is a bidirectional transformer over its own tokens (image patches or text
bytes), priced with the same per-layer FLOP and activation model as a single-branch
transformer (:mod:`pipeflow.planning.transformer`). An interaction block adds a
cross-attention over the other branch's tokens: a query projection of its own tokens,
key/value projections of the partner's, the score and weighted-sum matmuls and an output
projection. The head pools both branches, scores image-text matching (negligible) and
predicts the masked text bytes (one vocabulary projection per text token).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..topology.topology import Device
from .cbm_shape import cbm_shape
from .cost import CostModel, _check_int, _check_number
from .transformer import TransformerSpec, layer_forward_flops, layer_linear_flops, layer_params


def _branch_spec(name: str, branch, tokens: int, vocab: int) -> TransformerSpec:
    return TransformerSpec(name=name, n_layer=branch.n_layer, n_head=branch.n_head, n_embd=branch.n_embd,
                           vocab_size=vocab, seq_len=tokens, causal=False)


class BranchedAnalyticCost(CostModel):
    """Stage times from FLOPs for a stage DAG whose stages hold [lo, hi) blocks of one branch.

    ``stages``: (branch, lo, hi) per stage, branch in vision | text | head.
    """

    name = "analytic"

    def __init__(
        self,
        model_cfg: Mapping,
        stages: Sequence[tuple[str, int, int]],
        microbatch_size: int = 1,
        efficiency: float = 0.5,
        dtype_bytes: int = 2,
    ) -> None:
        self.num_stages = len(stages)
        self.stages = [tuple(s) for s in stages]
        self.microbatch_size = _check_int("pipeline.microbatch_size", microbatch_size)
        self.efficiency = _check_number("cost.efficiency", efficiency, 0.0, strict=True)
        self.dtype_bytes = _check_int("cost.dtype_bytes", dtype_bytes)
        shape = cbm_shape(model_cfg)  # the one reading of the model group, the model's own
        patches = shape.num_patches
        self.tokens = {"vision": patches, "text": shape.seq_len}
        self.vocab = shape.vocab_size
        self.patch_dim = shape.patch_size ** 2 * shape.channels
        self.spec = {
            "vision": _branch_spec("vision", shape.vision, patches, self.vocab),
            "text": _branch_spec("text", shape.text, shape.seq_len, self.vocab),
        }
        self.interactions = {k - 1 for k in shape.interaction_layers}  # 0-based blocks
        self._flops = [self._stage_flops(i) for i in range(self.num_stages)]

    # ---- FLOPs per stage (one sequence / image), forward: (total, weight-matmul part)
    def _cross(self, branch: str) -> tuple[float, float]:
        other = "text" if branch == "vision" else "vision"
        x, y = self.tokens[branch], self.tokens[other]
        h, ho = self.spec[branch].n_embd, self.spec[other].n_embd
        linear = 2 * x * h * h * 2 + 2 * y * ho * h * 2  # q and output projections; k and v of the partner
        return linear + 4 * x * y * h, linear

    def _stage_flops(self, stage: int) -> tuple[float, float]:
        branch, lo, hi = self.stages[stage]
        if branch == "head":
            t = self.tokens["text"]
            linear = 2 * t * self.spec["text"].n_embd * self.vocab
            return linear, linear
        spec, x = self.spec[branch], self.tokens[branch]
        total = linear = 0.0
        if lo == 0 and branch == "vision":
            total += 2 * x * self.patch_dim * spec.n_embd  # patch embedding
            linear += 2 * x * self.patch_dim * spec.n_embd
        for block in range(lo, hi):
            total += layer_forward_flops(spec, x, x)
            linear += layer_linear_flops(spec, x)
            if block in self.interactions:
                f, lin = self._cross(branch)
                total += f
                linear += lin
        return total, linear

    def compute_time(self, kind: str, stage: int, segment: int, device: Device) -> float:
        total, linear = self._flops[stage]
        rate = device.peak_flops * self.efficiency / self.microbatch_size
        if kind == "F":
            return total / rate
        if kind == "B":
            return 2 * total / rate
        if kind == "W":
            return linear / rate
        if kind == "I":
            return (2 * total - linear) / rate
        if kind == "S":
            if not device.memory_bandwidth:
                return 0.0
            return 16 * 3 * self._params(stage) / device.memory_bandwidth  # fp32 AdamW: read/write state
        raise self._bad_kind(kind)

    def message_bytes(self, src_stage: int, dst_stage: int, segment: int) -> float:
        branch = self.stages[src_stage][0]
        if branch == "head":
            return 0.0
        return self.microbatch_size * self.tokens[branch] * self.spec[branch].n_embd * self.dtype_bytes

    def activation_bytes(self, stage: int, segment: int) -> float:
        branch, lo, hi = self.stages[stage]
        b = self.microbatch_size
        if branch == "head":
            t = self.tokens["text"]
            return b * t * self.vocab * 4  # the MLM logits kept for the loss's backward
        spec, x = self.spec[branch], self.tokens[branch]
        # Korthikanti et al. per layer without recomputation (16-bit), bidirectional
        per_layer = x * b * spec.n_embd * 34 + 5 * b * spec.n_head * x * x
        return (hi - lo) * per_layer * self.dtype_bytes / 2

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        branch, lo, hi = self.stages[stage]
        if branch == "head":
            return 0.0
        spec, x = self.spec[branch], self.tokens[branch]
        return (hi - lo) * (3 * spec.n_embd + spec.ffn_width) * x * self.microbatch_size * self.dtype_bytes

    def _params(self, stage: int) -> float:
        branch, lo, hi = self.stages[stage]
        if branch == "head":
            return self.spec["text"].n_embd * self.vocab
        spec = self.spec[branch]
        n = (hi - lo) * layer_params(spec)
        n += sum(4 * spec.n_embd * spec.n_embd for b in range(lo, hi) if b in self.interactions)
        return float(n)

    def param_bytes(self, stage: int) -> float:
        return self._params(stage) * self.dtype_bytes

    def describe(self) -> dict:
        return {
            "name": self.name,
            "model": "concurrent-branch",
            "num_stages": self.num_stages,
            "stages": [list(s) for s in self.stages],
            "microbatch_size": self.microbatch_size,
            "efficiency": self.efficiency,
            "dtype_bytes": self.dtype_bytes,
        }
