"""Analytic cost of a concurrent-branch model's stages (vision tower, text tower, fused head): each branch a
bidirectional transformer over its own tokens priced as :mod:`pipeflow.planning.transformer` prices one,
an interaction block adding a cross-attention over the other branch's tokens (docs/planning.md, "The
concurrent-branch model")."""

from __future__ import annotations

from typing import Mapping, Sequence

from ..topology.topology import Device
from .cbm_shape import cbm_shape
from .cost import CostModel, _check_int, _check_number, layer_cost
from .branched_memory import BranchedWorkingSet
from .model_state import cast_bytes, parameter_state
from .operators import Shape
from .saved_tensors import block_residual
from .transformer import TransformerSpec, layer_forward_flops, layer_linear_flops, layer_params


def _branch_spec(name: str, branch, tokens: int, vocab: int, recompute: str = "none") -> TransformerSpec:
    return TransformerSpec(name=name, n_layer=branch.n_layer, n_head=branch.n_head, n_embd=branch.n_embd,
                           vocab_size=vocab, seq_len=tokens, causal=False, recompute=recompute)


class BranchedAnalyticCost(BranchedWorkingSet, CostModel):
    """Times and memory terms of a stage DAG whose ``stages`` are (branch, lo, hi): blocks [lo, hi) of
    vision, text or head."""

    # no tied weights, no tensor groups, no sequence segments; its optimizer step's
    # buffers are not priced yet
    absent_terms = frozenset({"tied_gradient_bytes", "forward_late_saved_bytes", "kv_gradient_bytes",
                              "step_workspace_bytes"})

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
        self.recompute = str(model_cfg.get("recompute") or "none")  # model.recompute: each block's regions
        self.spec = {
            "vision": _branch_spec("vision", shape.vision, patches, self.vocab, self.recompute),
            "text": _branch_spec("text", shape.text, shape.seq_len, self.vocab, self.recompute),
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
        """Bytes one microbatch's forward keeps on the stage, counted tensor by tensor on
        pipeflow/models/cbm.py: its GPT blocks' (:func:`~pipeflow.planning.cost.layer_cost`), interaction
        blocks' cross-attentions, the embedding's input, the head's."""
        branch, lo, hi = self.stages[stage]
        b, c = self.microbatch_size, self.dtype_bytes
        if branch == "head":
            Hv, Ht = self.spec["vision"].n_embd, self.spec["text"].n_embd
            xv, xt = self.tokens["vision"], self.tokens["text"]
            per_text = 4 * Ht + 8 + Ht * c + 4 * self.vocab + 8
            per_pair = (Hv + Ht) * c + 2 * Ht * c + 8
            return float(b * (xv * (4 * Hv + 8) + xt * per_text + per_pair))
        spec, x = self.spec[branch], self.tokens[branch]
        a = (hi - lo) * layer_cost(spec, x, x, b, c).saved + self._cross_saved(stage)
        if lo == 0:
            a += b * self.patch_dim * c * x if branch == "vision" else 8.0 * b * x + 8.0 * x
        return float(a)

    def _cross_saved(self, stage: int) -> float:
        """Bytes the stage's interaction blocks' cross-attentions keep."""
        branch, lo, hi = self.stages[stage]
        b, c = self.microbatch_size, self.dtype_bytes
        spec, x = self.spec[branch], self.tokens[branch]
        other = "text" if branch == "vision" else "vision"
        H, Ho, y = spec.n_embd, self.spec[other].n_embd, self.tokens[other]
        a = 0.0
        for blk in range(lo, hi):
            if blk not in self.interactions:
                continue
            if self.recompute == "full":  # the block keeps its inputs: the other branch's too
                a += b * y * Ho * 4
            elif self.recompute == "selective":  # the norms, and the sub-layer's two inputs (fp32)
                a += b * x * (4 * H + 8 + 4 * H) + b * y * (4 * Ho + 8 + 4 * Ho)
            else:
                a += b * x * (4 * H + 8 + 3 * H * c + 4 * spec.n_head)
                # (one copy when the widths match: MultiheadAttention then packs the
                # key and value projections into one product of the one input)
                a += b * y * (4 * Ho + 8 + (1 if Ho == H else 2) * Ho * c + 2 * H * c)
        return float(a)

    def _cross_residual(self, stage: int) -> float:
        """Bytes the stage's cross-attentions keep from I for W."""
        branch, lo, hi = self.stages[stage]
        spec, x = self.spec[branch], self.tokens[branch]
        other = "text" if branch == "vision" else "vision"
        H, Ho, y = spec.n_embd, self.spec[other].n_embd, self.tokens[other]
        n = sum(4 * H * x + (Ho + 2 * H) * y for blk in range(lo, hi) if blk in self.interactions)
        return float(n * self.microbatch_size * self.dtype_bytes)

    def input_gradient_bytes(self, stage: int, segment: int) -> float:
        """Bytes of the fp32 input gradients a backward makes: its branch's stream, the other branch's for
        an interaction block, both for the head."""
        branch, lo, hi = self.stages[stage]
        b = self.microbatch_size
        width = {k: self.tokens[k] * self.spec[k].n_embd for k in ("vision", "text")}
        if branch == "head":
            return float(4 * b * (width["vision"] + width["text"]))
        other = "text" if branch == "vision" else "vision"
        n = (width[branch] if lo > 0 else 0) + (width[other] if any(k in self.interactions for k in range(lo, hi)) else 0)
        return float(4 * b * n)

    def output_bytes(self, stage: int, segment: int) -> float:
        """Bytes of a branch stage's output held until its gradient returns (fp32, and its 16-bit copy)."""
        branch = self.stages[stage][0]
        if branch == "head":
            return 0.0
        x, H = self.tokens[branch], self.spec[branch].n_embd
        return float(self.microbatch_size * x * H * (4 + (self.dtype_bytes if self.dtype_bytes < 4 else 0)))

    def sent_copy_bytes(self, stage: int, segment: int) -> float:
        """Of :meth:`output_bytes`, the 16-bit copy sent (gone once a later message proves it arrived)."""
        branch = self.stages[stage][0]
        if branch == "head" or self.dtype_bytes >= 4:
            return 0.0
        return float(self.microbatch_size * self.tokens[branch] * self.spec[branch].n_embd * self.dtype_bytes)

    def local_output_bytes(self, stage: int, segment: int) -> float:
        """At 16 bits, bytes of an output kept to its backward for a successor on this device."""
        return self._own_output(stage) if self.dtype_bytes < 4 and self.stages[stage][0] != "head" else 0.0

    def shared_output_bytes(self, stage: int, segment: int) -> float:
        """At fp32, bytes of the output a successor on this device took as its input."""
        return self._own_output(stage) if self.dtype_bytes >= 4 and self.stages[stage][0] != "head" else 0.0

    def _own_output(self, stage: int) -> float:
        branch = self.stages[stage][0]
        return float(self.microbatch_size * self.tokens[branch] * self.spec[branch].n_embd * 4)

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        """Bytes a zero-bubble I keeps for W: each matrix product's input and output gradient
        (:func:`~pipeflow.planning.saved_tensors.block_residual` per block, plus the cross-attentions'
        and the head's products)."""
        branch, lo, hi = self.stages[stage]
        b, c = self.microbatch_size, self.dtype_bytes
        if branch == "head":
            Hv, Ht = self.spec["vision"].n_embd, self.spec["text"].n_embd
            per_pair = Hv + Ht + Ht + Ht + 1
            return float(b * c * (per_pair + self.tokens["text"] * (Ht + self.vocab)))
        spec, x = self.spec[branch], self.tokens[branch]
        return float((hi - lo) * block_residual(Shape(spec, b, x, x, c)) + self._cross_residual(stage))

    def _params(self, stage: int) -> float:
        """The stage's parameters, counted on pipeflow/models/cbm.py."""
        branch, lo, hi = self.stages[stage]
        Ht, V = self.spec["text"].n_embd, self.vocab
        if branch == "head":
            Hv = self.spec["vision"].n_embd
            return float(2 * Hv + 2 * Ht + (Hv + Ht) * Ht + Ht + Ht + 1 + Ht * V + V)
        H = self.spec[branch].n_embd
        n = sum(self._block_params(branch, blk) for blk in range(lo, hi))
        if lo == 0 and branch == "vision":
            n += self.patch_dim * H + H + self.tokens["vision"] * H
        elif lo == 0:
            n += V * H + self.tokens["text"] * H
        return float(n)

    def _block_params(self, branch: str, blk: int) -> float:
        """A block's parameters (with its cross-attention's in an interaction block)."""
        return float(layer_params(self.spec[branch]) + (self._cross_params(branch) if blk in self.interactions else 0))

    def _cross_params(self, branch: str) -> float:
        """An interaction block's cross-attention's parameters (see :meth:`_params`)."""
        H, Ho = self.spec[branch].n_embd, self.spec["text" if branch == "vision" else "vision"].n_embd
        return float(2 * H + 2 * Ho + H * H + 2 * H * Ho + 3 * H + H * H + H)

    def param_bytes(self, stage: int) -> float:
        return self._params(stage) * self.dtype_bytes

    def _cast_params(self, stage: int) -> float:
        """The parameters autocast casts to 16 bits (matrix products and the patch projection, with biases)."""
        branch, lo, hi = self.stages[stage]
        Ht, V = self.spec["text"].n_embd, self.vocab
        if branch == "head":
            Hv = self.spec["vision"].n_embd
            return float((Hv + Ht) * Ht + Ht + Ht + 1 + Ht * V + V)
        spec = self.spec[branch]
        H, I = spec.n_embd, spec.ffn_width
        Ho = self.spec["text" if branch == "vision" else "vision"].n_embd
        n = (hi - lo) * (4 * H * H + 4 * H + 2 * H * I + I + H)  # attention and MLP products with biases
        n += sum(2 * H * H + 2 * H * Ho + 4 * H for b in range(lo, hi) if b in self.interactions)
        if lo == 0 and branch == "vision":
            n += self.patch_dim * H + H
        return float(n)

    def _recomputed_cast_params(self, stage: int) -> float:
        """Of :meth:`_cast_params`, those a recomputed region casts anew."""
        branch, lo, hi = self.stages[stage]
        if branch == "head" or self.recompute == "none":
            return 0.0
        spec = self.spec[branch]
        H, I = spec.n_embd, spec.ffn_width
        Ho = self.spec["text" if branch == "vision" else "vision"].n_embd
        block = 4 * H * H + 4 * H + (2 * H * I + I + H if self.recompute == "full" else 0)
        cross = 2 * H * H + 2 * H * Ho + 4 * H
        return float(sum(block + (cross if b in self.interactions else 0) for b in range(lo, hi)))

    def held_cast_bytes(self, stage: int) -> float:
        """Bytes of the step's shared 16-bit casts: every cast weight but a recomputed region's."""
        return cast_bytes(self._cast_params(stage) - self._recomputed_cast_params(stage), self.dtype_bytes)

    def state_bytes(self, stage: int) -> dict:
        """A stage's model state by category, the shared 16-bit casts included."""
        return {**parameter_state(self._params(stage)), "casts": self.held_cast_bytes(stage)}

    def model_state_bytes(self, stage: int) -> float:
        return float(sum(self.state_bytes(stage).values()))

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
