"""A concurrent-branch multimodal model (CBM), cut into the stages of a StageGraph: a
ViT-style vision branch and a bidirectional byte-text branch side by side; at each
interaction depth k (``model.interaction_layers``) block k of each branch cross-attends to
the other's depth k-1 (no cycle), and a fused head gives an image-text matching logit
and masked-token logits. :func:`cbm_stage_graph` cuts before every interaction depth.
Parameter names are global and drawn per (seed, name), as in :mod:`pipeflow.models.gpt`."""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeflow.models.attention import check_mode
from pipeflow.models.splittable import seeded_normal_  # the per-name seeded draw every stage model uses
from pipeflow.models.recompute import apply_recompute

# The model's shape and its cut into stages are torch-free (the configuration and the
# planner read them): pipeflow.planning.cbm_shape, re-exported here.
from pipeflow.planning.cbm_shape import (  # noqa: F401 - re-exported
    BRANCHES,
    BranchShape,
    CBMShape,
    CBMStageSpec,
    cbm_shape,
    cbm_stage_counts,
    cbm_stage_graph,
)

INIT_STD = 0.02


# ----------------------------------------------------------------------------- blocks


class MLP(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; with ``cross_dim`` it also cross-attends to the other
    branch (keys and values from it). ``attention``: ``sdpa`` (fused) or ``eager``."""

    def __init__(self, dim: int, n_head: int, dropout: float, cross_dim: int | None = None,
                 attention: str = "sdpa"):
        super().__init__()
        self.eager = check_mode(attention) == "eager"
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_head, dropout=dropout, batch_first=True)
        self.cross = cross_dim is not None
        if self.cross:
            self.ln_cross = nn.LayerNorm(dim)
            # the other branch's stream has its own scale: normalise it here
            self.ln_cross_kv = nn.LayerNorm(cross_dim)
            self.cross_attn = nn.MultiheadAttention(
                dim, n_head, dropout=dropout, kdim=cross_dim, vdim=cross_dim, batch_first=True
            )
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, other: Tensor | None = None) -> Tensor:
        x = x + self.drop(self.self_attend(self.ln_1(x)))
        if self.cross:
            if other is None:
                raise ValueError("an interaction block needs the other branch's hidden state")
            x = x + self.drop(self.cross_attend(self.ln_cross(x), self.ln_cross_kv(other)))
        return x + self.mlp(self.ln_2(x))

    # the attention sub-layers, as methods of one tensor each: what selective
    # recomputation recomputes (pipeflow.models.recompute); inside, the query, key and
    # value stay one object, so MultiheadAttention keeps its packed projection
    def self_attend(self, h: Tensor) -> Tensor:
        return self.attn(h, h, h, need_weights=self.eager)[0]

    def cross_attend(self, q: Tensor, kv: Tensor) -> Tensor:
        return self.cross_attn(q, kv, kv, need_weights=self.eager)[0]


class Branch(nn.Module):
    """Blocks [lo, hi) of one branch, plus its embedding when lo == 0."""

    def __init__(self, shape: CBMShape, branch: str, lo: int, hi: int):
        super().__init__()
        b: BranchShape = getattr(shape, branch)
        other: BranchShape = getattr(shape, "text" if branch == "vision" else "vision")
        self.branch, self.lo, self.hi = branch, lo, hi
        self.embeds = lo == 0
        if self.embeds and branch == "vision":
            self.patch_embed = nn.Conv2d(shape.channels, b.n_embd, shape.patch_size, stride=shape.patch_size)
            self.pos_embed = nn.Parameter(torch.zeros(1, shape.num_patches, b.n_embd))
        elif self.embeds:
            self.tok_embed = nn.Embedding(shape.vocab_size, b.n_embd)
            self.pos_embed = nn.Embedding(shape.seq_len, b.n_embd)
        self.drop = nn.Dropout(shape.dropout)
        # block i computes depth i+1; it is an interaction block when i+1 is listed
        self.blocks = nn.ModuleDict(
            {
                str(i): Block(
                    b.n_embd,
                    b.n_head,
                    shape.dropout,
                    cross_dim=other.n_embd if i + 1 in shape.interaction_layers else None,
                    attention=shape.attention,
                )
                for i in range(lo, hi)
            }
        )

    def embed(self, x: Tensor) -> Tensor:
        if self.branch == "vision":
            x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, C, H, W] -> [B, patches, n_embd]
            return self.drop(x + self.pos_embed)
        pos = torch.arange(x.size(1), device=x.device)
        return self.drop(self.tok_embed(x) + self.pos_embed(pos))

    def block(self, i: int, x: Tensor, other: Tensor | None) -> Tensor:
        return self.blocks[str(i)](x, other)


class Head(nn.Module):
    """Fused head: pooled vision + pooled text -> ITM logit; text positions -> MLM logits, as
    one tensor [B, 1 + T * vocab_size] (a stage sends one; :func:`split_head_output`)."""

    def __init__(self, shape: CBMShape):
        super().__init__()
        dv, dt = shape.vision.n_embd, shape.text.n_embd
        self.ln_vision = nn.LayerNorm(dv)
        self.ln_text = nn.LayerNorm(dt)
        self.itm_fc = nn.Linear(dv + dt, dt)
        self.itm_out = nn.Linear(dt, 1)
        self.mlm = nn.Linear(dt, shape.vocab_size)  # not tied: the embedding lives on another stage

    def forward(self, vision: Tensor, text: Tensor) -> Tensor:
        v, t = self.ln_vision(vision), self.ln_text(text)
        pooled = torch.cat([v.mean(1), t.mean(1)], dim=-1)
        itm = self.itm_out(F.gelu(self.itm_fc(pooled)))  # [B, 1]
        mlm = self.mlm(t)  # [B, T, V]
        return torch.cat([itm, mlm.flatten(1)], dim=1)


def _init_weights(module: nn.Module, shape: CBMShape, seed: int) -> None:
    """One generator per global parameter name, so any split draws the same values."""
    for name, param in module.named_parameters():
        branch = name.split(".", 1)[0]
        n_layer = getattr(shape, branch).n_layer if branch in BRANCHES else 1
        if ".ln_" in name or name.startswith("head.ln_"):
            if name.endswith(".weight"):
                nn.init.ones_(param)
            else:
                nn.init.zeros_(param)
        elif name.endswith("bias"):  # Linear .bias and MultiheadAttention's in_proj_bias
            nn.init.zeros_(param)
        elif name.endswith(("attn.out_proj.weight", "cross_attn.out_proj.weight", "mlp.c_proj.weight")):
            # GPT-2's scaling of projections into the stream, per branch depth
            seeded_normal_(param, INIT_STD / math.sqrt(2 * n_layer), seed, name)
        else:
            seeded_normal_(param, INIT_STD, seed, name)


# ----------------------------------------------------------------------------- stage graph


# ----------------------------------------------------------------------------- modules


class CBMStage(nn.Module):
    """One stage of :func:`cbm_stage_graph`. ``x``: a source stage's batch tensor (images
    [B, C, H, W] or token ids [B, T]), else {predecessor stage: tensor}. Returns the branch's
    hidden state at depth ``hi``, or the head's [B, 1 + T * vocab_size]."""

    def __init__(self, shape: CBMShape, spec: CBMStageSpec, seed: int):
        super().__init__()
        self.shape, self.spec = shape, spec
        if spec.branch == "head":
            self.head = Head(shape)
        else:
            # the attribute is the branch's name, so parameters read vision.blocks.<i>...
            self.add_module(spec.branch, Branch(shape, spec.branch, spec.lo, spec.hi))
        _init_weights(self, shape, seed)

    def forward(self, x: Tensor | Mapping[int, Tensor]) -> Tensor:
        spec = self.spec
        if spec.branch == "head":
            return self.head(x[spec.chain_pred], x[spec.partner_pred])
        branch: Branch = getattr(self, spec.branch)
        if spec.is_source:
            if isinstance(x, Mapping):
                raise TypeError(f"stage {spec.stage} is a source: pass the raw {spec.branch} input tensor, not a dict")
            h = branch.embed(x)
        elif isinstance(x, Mapping):
            h = x[spec.chain_pred]
        else:  # the runtime passes a stage with one predecessor (its chain) that tensor itself
            if spec.partner_pred is not None:
                raise TypeError(f"stage {spec.stage} reads two predecessors: pass a dict by stage")
            h = x
        other = x[spec.partner_pred] if spec.partner_pred is not None else None
        for i in range(spec.lo, spec.hi):
            # only the first block can interact: the split puts a boundary before each
            h = branch.block(i, h, other if i == spec.lo else None)
        return h


class CBMModel(nn.Module):
    """The whole CBM on one device: the reference a pipelined run must match."""

    def __init__(self, shape: CBMShape, seed: int):
        super().__init__()
        self.shape = shape
        self.vision = Branch(shape, "vision", 0, shape.vision.n_layer)
        self.text = Branch(shape, "text", 0, shape.text.n_layer)
        self.head = Head(shape)
        _init_weights(self, shape, seed)

    def forward(self, image: Tensor, input_ids: Tensor) -> Tensor:
        v, t = self.vision.embed(image), self.text.embed(input_ids)
        for depth in range(1, max(self.shape.vision.n_layer, self.shape.text.n_layer) + 1):
            # both blocks at this depth read the other branch's previous depth
            v_prev, t_prev = v, t
            if depth <= self.shape.vision.n_layer:
                v = self.vision.block(depth - 1, v_prev, t_prev)
            if depth <= self.shape.text.n_layer:
                t = self.text.block(depth - 1, t_prev, v_prev)
        return self.head(v, t)


def build_cbm_stage(model_cfg: Mapping, stage_specs: Sequence[CBMStageSpec], stage: int, seed: int) -> CBMStage:
    """Stage ``stage`` of a split made by :func:`cbm_stage_graph` (pass its stage_specs)."""
    shape = cbm_shape(model_cfg)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < len(stage_specs):
        raise ValueError(f"stage={stage!r}: allowed values: 0 to {len(stage_specs) - 1} (pipeline.stages)")
    return apply_recompute(CBMStage(shape, stage_specs[stage], seed), model_cfg.get("recompute") or "none", (Block,))


def build_cbm_model(model_cfg: Mapping, seed: int) -> CBMModel:
    """The whole model as one module computing what the chained stages compute."""
    return CBMModel(cbm_shape(model_cfg), seed)


# ----------------------------------------------------------------------------- data, loss


def source_input(spec: CBMStageSpec, batch: Mapping[str, Tensor]) -> Tensor:
    """The batch tensor a source stage takes: ``image`` for vision, ``input_ids`` for text."""
    if not spec.is_source:
        raise ValueError(f"stage {spec.stage} is not a source stage: it takes its predecessors' outputs")
    return batch["image" if spec.branch == "vision" else "input_ids"]


def message_shape(model_cfg: Mapping, spec: CBMStageSpec, microbatch_size: int) -> tuple[int, ...]:
    """Shape of the one tensor stage ``spec`` outputs (sent whole to every successor)."""
    shape = cbm_shape(model_cfg)
    if spec.branch == "vision":
        return (microbatch_size, shape.num_patches, shape.vision.n_embd)
    if spec.branch == "text":
        return (microbatch_size, shape.seq_len, shape.text.n_embd)
    return (microbatch_size, 1 + shape.seq_len * shape.vocab_size)


def split_head_output(head_out: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """The head's [B, 1 + T * V] as (ITM logits [B], MLM logits [B, T, V])."""
    itm, mlm = head_out[:, 0], head_out[:, 1:]
    return itm, mlm.reshape(head_out.size(0), seq_len, -1)


class CBMNormalizer(NamedTuple):
    """Counts over the whole batch: the ITM mean is over pairs, the MLM mean over masked tokens."""

    pairs: float
    masked_tokens: float


def normalizer(batch: Mapping[str, Tensor]) -> CBMNormalizer:
    """The global batch's counts, so that microbatch losses add up to the batch mean."""
    masked = int((batch["mlm_labels"] != -100).sum())
    return CBMNormalizer(float(batch["itm_label"].numel()), float(max(1, masked)))


def cbm_loss(head_out: Tensor, batch: Mapping[str, Tensor], norm: CBMNormalizer, rows: slice | None = None) -> Tensor:
    """Summed ITM BCE / pairs + summed MLM CE / masked tokens, for rows ``rows`` of ``batch``
    (the microbatch the head output belongs to; None: all of it)."""
    rows = slice(None) if rows is None else rows
    # the batch stays in host memory; a GPU stage's head reads its rows' labels there
    itm_label, mlm_labels = (batch[k][rows].to(head_out.device) for k in ("itm_label", "mlm_labels"))
    itm, mlm = split_head_output(head_out, mlm_labels.size(1))
    # the BCE keeps its input for the backward: a copy of the B logits, not a view, which
    # would keep the whole head output ([B, 1 + T * V]) alive until the backward
    itm_loss = F.binary_cross_entropy_with_logits(itm.float().clone(), itm_label.float(), reduction="sum")
    mlm_loss = F.cross_entropy(
        mlm.reshape(-1, mlm.size(-1)).float(), mlm_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return itm_loss / norm.pairs + mlm_loss / norm.masked_tokens
