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
from .cost import CostModel, _check_int, _check_number, layer_cost
from .branched_memory import BranchedWorkingSet
from .operators import Shape, block_residual
from .transformer import TransformerSpec, layer_forward_flops, layer_linear_flops, layer_params


def _branch_spec(name: str, branch, tokens: int, vocab: int, recompute: str = "none") -> TransformerSpec:
    return TransformerSpec(name=name, n_layer=branch.n_layer, n_head=branch.n_head, n_embd=branch.n_embd,
                           vocab_size=vocab, seq_len=tokens, causal=False, recompute=recompute)


class BranchedAnalyticCost(BranchedWorkingSet, CostModel):
    """Stage times from FLOPs for a stage DAG whose stages hold [lo, hi) blocks of one branch.

    ``stages``: (branch, lo, hi) per stage, branch in vision | text | head.
    """

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
        """What one microbatch's forward keeps on the stage, counted tensor by tensor on
        pipeflow/models/cbm.py (c the compute dtype's bytes, the stream and norms fp32):

        - a block is a GPT block (``nn.MultiheadAttention`` keeps its packed Q/K/V
          projection's input and output, the fused kernel's output and log-sum-exp):
          :func:`~pipeflow.planning.cost.layer_cost` of the branch's shape;
        - an interaction block adds its cross-attention: per own token a norm (4H + 8),
          the query projection's input, the query and the kernel's output (3H c) and the
          log-sum-exp (4h); per token of the other branch (width Ho) its norm (4Ho + 8),
          the key and value projections' input (Ho c; two copies where Ho != H, when
          the projections are separate) and the keys and values (2H c);
        - the embedding: the image (its cast, C*S^2 c per image) or the token ids and
          position ids (int64);
        - the head: per vision token its norm's input (4Hv + 8); per text token its
          norm's (4Ht + 8), the MLM projection's input (Ht c), the fp32 log-softmax over
          the vocabulary (4V) and the target (int64); per pair the matching MLP's
          inputs ((Hv + Ht) c, Ht c twice) and the logit and label of its loss.
        ``benchmarks/bench_memory.py`` compares it with what the runtime's ranks hold."""
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
        """What the stage's interaction blocks' cross-attentions keep (see :meth:`activation_bytes`)."""
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
        """What the stage's interaction blocks' cross-attentions keep from I for W (see
        :meth:`weight_residual_bytes`)."""
        branch, lo, hi = self.stages[stage]
        spec, x = self.spec[branch], self.tokens[branch]
        other = "text" if branch == "vision" else "vision"
        H, Ho, y = spec.n_embd, self.spec[other].n_embd, self.tokens[other]
        n = sum(4 * H * x + (Ho + 2 * H) * y for blk in range(lo, hi) if blk in self.interactions)
        return float(n * self.microbatch_size * self.dtype_bytes)

    def input_gradient_bytes(self, stage: int, segment: int) -> float:
        """The gradients a backward makes for its stage's inputs (fp32): the branch's
        stream from the stage below, the other branch's for an interaction block, both
        branches' for the head."""
        branch, lo, hi = self.stages[stage]
        b = self.microbatch_size
        width = {k: self.tokens[k] * self.spec[k].n_embd for k in ("vision", "text")}
        if branch == "head":
            return float(4 * b * (width["vision"] + width["text"]))
        other = "text" if branch == "vision" else "vision"
        n = (width[branch] if lo > 0 else 0) + (width[other] if any(k in self.interactions for k in range(lo, hi)) else 0)
        return float(4 * b * n)

    def output_bytes(self, stage: int, segment: int) -> float:
        """A branch stage's output (fp32) stays until its gradient returns; at 16 bits so
        does the copy it was sent as (one per successor at most)."""
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
        """A branch stage's output (fp32) kept until its backward where a successor runs on
        the same device; at 16 bits beside the copy the successor restores (at fp32 the
        successor's input is the output itself: :meth:`shared_output_bytes`)."""
        return self._own_output(stage) if self.dtype_bytes < 4 and self.stages[stage][0] != "head" else 0.0

    def shared_output_bytes(self, stage: int, segment: int) -> float:
        """At fp32, the output a successor on the same device took as its input: the
        stage's alone once that successor's backward has let go of it."""
        return self._own_output(stage) if self.dtype_bytes >= 4 and self.stages[stage][0] != "head" else 0.0

    def _own_output(self, stage: int) -> float:
        branch = self.stages[stage][0]
        return float(self.microbatch_size * self.tokens[branch] * self.spec[branch].n_embd * 4)

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        """What a zero-bubble I keeps for W: each matrix product's input and output
        gradient (compute dtype). A block's are a GPT block's
        (:func:`~pipeflow.planning.operators.block_residual`); an interaction
        block's cross-attention adds its query and output projections' (4H per own
        token) and the packed key/value projection's (Ho + 2H per token of the other
        branch); the head keeps its matching MLP's (Hv + Ht in, Ht out; Ht in, 1 out per
        pair) and the MLM projection's (Ht + V per text token)."""
        branch, lo, hi = self.stages[stage]
        b, c = self.microbatch_size, self.dtype_bytes
        if branch == "head":
            Hv, Ht = self.spec["vision"].n_embd, self.spec["text"].n_embd
            per_pair = Hv + Ht + Ht + Ht + 1
            return float(b * c * (per_pair + self.tokens["text"] * (Ht + self.vocab)))
        spec, x = self.spec[branch], self.tokens[branch]
        return float((hi - lo) * block_residual(Shape(spec, b, x, x, c)) + self._cross_residual(stage))

    def _params(self, stage: int) -> float:
        """The stage's parameters, counted on pipeflow/models/cbm.py: a branch's blocks
        (a GPT block each), an interaction block's cross-attention (a norm for each side,
        a query projection of this branch, key and value projections from the other's
        width, an output projection, their biases), the branch's embedding on its first
        stage (the vision patch projection and position table; the text token and
        position tables); the head's two norms, its matching MLP and its MLM projection."""
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
        """A block's parameters (see :meth:`_params`): a GPT block's, an interaction block's
        cross-attention's besides."""
        return float(layer_params(self.spec[branch]) + (self._cross_params(branch) if blk in self.interactions else 0))

    def _cross_params(self, branch: str) -> float:
        """An interaction block's cross-attention's parameters (see :meth:`_params`)."""
        H, Ho = self.spec[branch].n_embd, self.spec["text" if branch == "vision" else "vision"].n_embd
        return float(2 * H + 2 * Ho + H * H + 2 * H * Ho + 3 * H + H * H + H)

    def param_bytes(self, stage: int) -> float:
        return self._params(stage) * self.dtype_bytes

    def _cast_params(self, stage: int) -> float:
        """The parameters autocast casts to 16 bits (the weights of matrix products and of
        the patch projection, their biases; not the embedding tables or the norms)."""
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
        """Of :meth:`_cast_params`, the weights a recomputed region casts anew (full: the
        blocks'; selective: their attention sub-layers')."""
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
        """The step's shared 16-bit casts (what a later microbatch's backward holds the
        gradients of): every cast weight but a recomputed region's."""
        if self.dtype_bytes >= 4:
            return 0.0
        return 2.0 * (self._cast_params(stage) - self._recomputed_cast_params(stage))

    def state_bytes(self, stage: int) -> dict:
        """The runtime's model state of a stage (:meth:`CostModel.state_bytes`): fp32
        weights and gradients and AdamW's two fp32 moments, whatever the precision, and
        at 16 bits one cast of each weight autocast casts, shared by the step's
        microbatches (``Precision.shared_casts``; a recomputed region casts its own)."""
        p = self._params(stage)
        casts = self.held_cast_bytes(stage)
        return {"parameters": 4.0 * p, "gradients": 4.0 * p, "optimizer_state": 8.0 * p, "casts": casts}

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
