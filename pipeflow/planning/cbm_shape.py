"""The concurrent-branch model's shape and its cut into stages, torch-free (the config, the
planner and the coordinator read it; :mod:`pipeflow.models.cbm` builds the modules)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from pipeflow.numbers import whole
from pipeflow.schedules.ir import StageGraph

BRANCHES = ("vision", "text")
ATTENTION_MODES = ("sdpa", "eager")  # model.attention (pipeflow.models.attention.MODES)


@dataclass(frozen=True)
class BranchShape:
    n_layer: int
    n_embd: int
    n_head: int


@dataclass(frozen=True)
class CBMShape:
    """The checked ``model`` config group (family cbm)."""

    vision: BranchShape
    text: BranchShape
    image_size: int
    patch_size: int
    channels: int
    vocab_size: int
    seq_len: int
    interaction_layers: tuple[int, ...]
    dropout: float
    attention: str = "sdpa"  # model.attention: sdpa (the fused kernel) | eager

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def cbm_shape(model_cfg: Mapping) -> CBMShape:
    """Read and check the ``model`` group of a CBM; errors name the offending key."""
    family = model_cfg.get("family")
    if family != "cbm":
        raise ValueError(f"model.family={family}: the concurrent-branch model builds family cbm only; allowed values: cbm")
    branches = {}
    for b in BRANCHES:
        sub = model_cfg.get(b)
        if sub is None:
            raise ValueError(f"model.{b} is missing: a CBM needs model.{b} with n_layer, n_embd, n_head")
        n_layer = whole(f"model.{b}.n_layer", sub.get("n_layer"))
        n_embd = whole(f"model.{b}.n_embd", sub.get("n_embd"))
        n_head = whole(f"model.{b}.n_head", sub.get("n_head"))
        if n_embd % n_head:
            raise ValueError(f"model.{b}.n_head={n_head}: must divide model.{b}.n_embd={n_embd}")
        branches[b] = BranchShape(n_layer, n_embd, n_head)
    vis, txt = model_cfg["vision"], model_cfg["text"]
    image_size = whole("model.vision.image_size", vis.get("image_size"))
    patch_size = whole("model.vision.patch_size", vis.get("patch_size"))
    if image_size % patch_size:
        raise ValueError(f"model.vision.patch_size={patch_size}: must divide model.vision.image_size={image_size}")
    channels = whole("model.vision.channels", vis.get("channels", 1))
    vocab_size = whole("model.text.vocab_size", txt.get("vocab_size"))
    seq_len = whole("model.text.seq_len", txt.get("seq_len"))

    depths = model_cfg.get("interaction_layers") or []
    top = min(branches["vision"].n_layer, branches["text"].n_layer)
    for k in depths:
        # depth 1 would cross-attend to the embeddings: a stage holding only an
        # embedding, which the split does not make (every stage holds >= 1 block)
        if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= top:
            raise ValueError(
                f"model.interaction_layers={list(depths)}: each depth must be a whole number in 2..{top} "
                f"(at most both branches' n_layer)"
            )
    if len(set(depths)) != len(depths):
        raise ValueError(f"model.interaction_layers={list(depths)}: list each depth once")

    dropout = model_cfg.get("dropout", 0.0)
    if dropout is None:
        dropout = 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout={dropout!r}: a probability; use a number in [0, 1)")
    return CBMShape(
        vision=branches["vision"],
        text=branches["text"],
        image_size=image_size,
        patch_size=patch_size,
        channels=channels,
        vocab_size=vocab_size,
        seq_len=seq_len,
        interaction_layers=tuple(sorted(depths)),
        dropout=float(dropout),
        attention=_attention(model_cfg.get("attention") or "sdpa"),
    )


def _attention(mode) -> str:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"model.attention={mode}: allowed values: {', '.join(ATTENTION_MODES)}")
    return str(mode)


@dataclass(frozen=True)
class CBMStageSpec:
    """What one stage of :func:`cbm_stage_graph` holds and which predecessors feed it.

    branch: "vision", "text" or "head". lo, hi: the branch's blocks [lo, hi) (block i computes
    depth i+1); -1 for the head. chain_pred: the branch's previous stage (None: the first,
    fed the batch). partner_pred: the other branch's stage ending at depth lo when block lo is
    an interaction block. The head's: the last vision and the last text stage."""

    stage: int
    branch: str
    lo: int
    hi: int
    chain_pred: int | None
    partner_pred: int | None

    @property
    def is_source(self) -> bool:
        return self.chain_pred is None and self.partner_pred is None


def _split_branch(n_layer: int, cuts: Sequence[int], stages: int, branch: str) -> list[tuple[int, int]]:
    """``stages`` contiguous block ranges covering [0, n_layer) with a boundary at every cut;
    each extra stage goes to the segment between cuts whose stages are the longest (ties: the
    first), so the largest stage is as small as it can be."""
    bounds = [0, *sorted(cuts), n_layer]
    seg_len = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
    if not len(seg_len) <= stages <= n_layer:
        raise ValueError(
            f"pipeline.stages: {stages} {branch} stages cannot hold model.{branch}.n_layer={n_layer} layers with a "
            f"boundary before each interaction depth (needs {len(seg_len)} to {n_layer} {branch} stages)"
        )
    per_seg = [1] * len(seg_len)
    for _ in range(stages - len(seg_len)):
        open_segs = [i for i in range(len(seg_len)) if per_seg[i] < seg_len[i]]
        best = max(open_segs, key=lambda i: (math.ceil(seg_len[i] / per_seg[i]), -i))
        per_seg[best] += 1
    ranges = []
    for start, length, n in zip(bounds, seg_len, per_seg):
        base, extra = divmod(length, n)
        for j in range(n):  # the earlier stages of a segment take the remainder
            size = base + (1 if j < extra else 0)
            ranges.append((start, start + size))
            start += size
    return ranges


def cbm_stage_graph(model_cfg: Mapping, vision_stages: int, text_stages: int) -> tuple[StageGraph, list[CBMStageSpec]]:
    """The CBM as a StageGraph and what each stage holds: stages 0..Vs-1 the vision chain
    (stage 0 with the patch embedding), Vs..Vs+Ts-1 the text chain (stage Vs with the token
    embedding), Vs+Ts the fused head. Edges: each chain; at every interaction depth k, from
    each branch's stage ending at k-1 to the other's starting with block k; both last stages
    to the head. A boundary stands before every interaction depth, the rest spread evenly.
    Indices are branch-major, not a topological order: run ``graph.topological_order()``."""
    shape = cbm_shape(model_cfg)
    vs = whole("pipeline.stages (vision stages)", vision_stages)
    ts = whole("pipeline.stages (text stages)", text_stages)
    cuts = [k - 1 for k in shape.interaction_layers]  # a stage must end at depth k-1
    ranges = {
        "vision": _split_branch(shape.vision.n_layer, cuts, vs, "vision"),
        "text": _split_branch(shape.text.n_layer, cuts, ts, "text"),
    }
    offset = {"vision": 0, "text": vs}
    head = vs + ts

    def ending_at(branch: str, depth: int) -> int:
        return offset[branch] + next(j for j, (_, hi) in enumerate(ranges[branch]) if hi == depth)

    specs: list[CBMStageSpec] = []
    edges: list[tuple[int, int]] = []
    for branch in BRANCHES:
        other = "text" if branch == "vision" else "vision"
        for j, (lo, hi) in enumerate(ranges[branch]):
            stage = offset[branch] + j
            chain_pred = stage - 1 if j else None
            partner_pred = ending_at(other, lo) if lo + 1 in shape.interaction_layers else None
            specs.append(CBMStageSpec(stage, branch, lo, hi, chain_pred, partner_pred))
            for pred in (chain_pred, partner_pred):
                if pred is not None and (pred, stage) not in edges:
                    edges.append((pred, stage))
    last_vision, last_text = vs - 1, vs + ts - 1
    specs.append(CBMStageSpec(head, "head", -1, -1, last_vision, last_text))
    edges += [(last_vision, head), (last_text, head)]
    graph = StageGraph(head + 1, tuple(edges), branch=tuple(s.branch for s in specs))
    return graph, specs


def cbm_stage_counts(shape, num_devices: int) -> tuple[int, int]:
    """Stages per branch for a run over ``num_devices``: the fewest that put a boundary
    before every interaction, more (alternating branches) while the graph has fewer
    stages than devices."""
    vs = ts = 1 + len(shape.interaction_layers)
    while vs + ts + 1 < num_devices and (vs < shape.vision.n_layer or ts < shape.text.n_layer):
        if vs <= ts and vs < shape.vision.n_layer:
            vs += 1
        elif ts < shape.text.n_layer:
            ts += 1
        else:
            vs += 1
    return vs, ts
