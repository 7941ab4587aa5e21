"""Tensor (and sequence) parallelism inside a pipeline stage, Megatron-LM style
(``pipeline.tensor_parallel=T``): :func:`shard_stage` cuts a whole stage in place, Q/K/V
and the MLP's first projections by column, the output projections by row, embedding and
head by vocabulary. The collectives live only in the autograd functions here, so every
schedule runs unchanged (docs/training.md, "Tensor and sequence parallelism")."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class TensorGroup:
    """This rank's tensor-parallel group: ``size`` ranks, this one ``rank``, the process
    ``group``, ``sequence_parallel``, and ``kv_group``: the ranks sharing this rank's
    replicated key/value heads (None where they are split)."""

    size: int
    rank: int
    group: object
    sequence_parallel: bool = False
    kv_group: object = None
    kv_copies: int = 1
    gloo: bool = field(default=True)
    # the runtime's memory profile told that a buffer handed to gloo is done with here
    # (gloo may drop its last reference on its own thread, where the profiler records no free)
    released: object = field(default=lambda *tensors: None, repr=False)

    # ---- the sequence dimension (dim 1 of a [batch, tokens, features] activation) ----------
    def enter(self, x: Tensor) -> Tensor:
        """After the embedding: the rank's slice of the tokens under sequence parallelism."""
        return _SplitSeq.apply(x, self) if self.sequence_parallel else x

    def column_input(self, x: Tensor) -> Tensor:
        """The input of a group of column-parallel projections (the attention, the MLP)."""
        return _GatherSeq.apply(x, self) if self.sequence_parallel else _CopyToGroup.apply(x, self)

    def row_output(self, x: Tensor) -> Tensor:
        """The partial products of a row-parallel projection, summed (and cut by tokens)."""
        return _ScatterSeq.apply(x, self) if self.sequence_parallel else _ReduceFromGroup.apply(x, self)

    def tokens(self, local: int) -> int:
        """Tokens of the whole (segment of the) sequence, from the rank's slice."""
        return local * self.size if self.sequence_parallel else local

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, x: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        out = torch.cat(parts, dim)
        self.released(x, *parts)
        return out

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        if self.gloo:  # gloo has no reduce-scatter: the same bytes as an all-reduce, then the share
            summed = self.all_reduce(x)
            out = summed.chunk(self.size, dim)[self.rank].contiguous()
            self.released(summed)
            return out
        parts = [p.contiguous() for p in x.chunk(self.size, dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=self.group)
        return out

    def own(self, x: Tensor, dim: int) -> Tensor:
        size = x.size(dim)
        if size % self.size:
            raise ValueError(f"{size} tokens do not split across pipeline.tensor_parallel={self.size} ranks")
        return x.chunk(self.size, dim)[self.rank].contiguous()


def _collective(name: str, forward, backward, doc: str) -> type:
    """An autograd function of ``(x, tp)``: ``forward(tp, x)`` ahead, ``backward(tp, g)``
    for the gradient of ``x`` (the group ``tp`` gets none)."""
    def fwd(ctx, x, tp):
        ctx.tp = tp
        return forward(tp, x)

    def bwd(ctx, g):
        return backward(ctx.tp, g), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd),
                                                    "__doc__": doc})


def _all_gather(tp, x):
    return tp.all_gather(x, 1)


def _reduce_scatter(tp, x):
    return tp.reduce_scatter(x, 1)


def _own(tp, x):
    return tp.own(x, 1)


# the sequence dimension is dim 1 of a [batch, tokens, features] activation
_CopyToGroup = _collective("_CopyToGroup", lambda tp, x: x.view_as(x), TensorGroup.all_reduce,
                           "Identity ahead; the gradient summed across the group.")
_ReduceFromGroup = _collective("_ReduceFromGroup", TensorGroup.all_reduce, lambda tp, g: g,
                               "The partial products summed across the group; the gradient as it comes.")
_GatherSeq = _collective("_GatherSeq", _all_gather, _reduce_scatter,
                         "The rank's tokens to all of them; the gradient summed and cut back to the rank's.")
_ScatterSeq = _collective("_ScatterSeq", _reduce_scatter, _all_gather,
                          "Partial products summed and cut to the rank's tokens; the gradient gathered.")
_SplitSeq = _collective("_SplitSeq", _own, _all_gather,
                        "Replicated tokens to the rank's slice (the gradient: every rank's slices gathered).")
_GatherSeqReplicated = _collective(
    "_GatherSeqReplicated", _all_gather, _own,
    "The rank's slice to all tokens, for work every rank then repeats whole (a replicated head): the gradient is "
    "each rank's own slice of the same whole.")


# ----------------------------------------------------------------------------- layers


class ParallelLinear(nn.Module):
    """A linear layer's piece: ``weight`` [out, in] (``transposed``: [in, out], GPT-2's
    Conv1D) and ``bias``. Row-parallel: the partial product is summed across the group
    (:meth:`TensorGroup.row_output`) before the bias, which every rank keeps whole."""

    def __init__(self, weight: Tensor, bias: Tensor | None, transposed: bool, row: bool, tp: TensorGroup):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.transposed, self.row, self.tp = transposed, row, tp

    def forward(self, x: Tensor) -> Tensor:
        if not self.row:
            return self._product(x, self.bias)
        y = self.tp.row_output(self._product(x, None))
        return y if self.bias is None else y + self.bias

    def _product(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, bias)
        # GPT-2's Conv1D as Conv1D computes it, x @ W on the parameter itself: autocast
        # caches its cast of a leaf for the step, not of a view (F.linear(x, W.t()) cast
        # W anew for every microbatch, each in flight keeping its own 16-bit copy of the
        # stage's matrices: gpt_small's first stage at bf16 with tensor and sequence
        # parallelism held 26.8 MiB of them, where one shared copy is 7.1)
        flat = x.reshape(-1, x.size(-1))
        y = torch.mm(flat, self.weight) if bias is None else torch.addmm(bias, flat, self.weight)
        return y.view(*x.shape[:-1], y.size(-1))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[lo, hi)`` of a token embedding: ids outside give zero, and the group sums."""

    def __init__(self, weight: Tensor, tp: TensorGroup):
        super().__init__()
        rows = weight.size(0) // tp.size
        self.lo, self.hi, self.tp = tp.rank * rows, (tp.rank + 1) * rows, tp
        self.weight = nn.Parameter(weight.detach()[self.lo:self.hi].clone())

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        local = torch.where(outside, 0, ids - self.lo)
        out = F.embedding(local, self.weight) * (~outside).unsqueeze(-1).to(self.weight.dtype)
        return _ReduceFromGroup.apply(out, self.tp)


class _ParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy per token over logits cut by vocabulary (this rank's ``[lo, lo + V/T)``);
    the first ``scored`` columns are words, the padding gets a zero gradient."""

    @staticmethod
    def forward(ctx, logits, targets, lo, tp, ignore_index, scored):
        width = logits.size(-1)
        words = logits[..., :scored].float()
        # (a rank whose whole cut is padding takes part in the sums with nothing)
        top = words.max(-1).values if scored else words.new_full(words.shape[:-1], float("-inf"))
        top = tp.all_reduce(top, dist.ReduceOp.MAX)
        shifted = words - top.unsqueeze(-1)
        exp = shifted.exp()
        total = tp.all_reduce(exp.sum(-1))
        ignored = targets == ignore_index
        local = targets - lo
        mine = (local >= 0) & (local < scored) & ~ignored
        picked = shifted.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1) * mine if scored \
            else torch.zeros_like(total)
        picked = tp.all_reduce(picked)
        loss = (total.log() - picked) * ~ignored
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, mine, ignored)
        ctx.width = width
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local, mine, ignored = ctx.saved_tensors
        g = g * ~ignored
        scored = softmax.size(-1)
        if scored == ctx.width:
            grad = softmax * g.unsqueeze(-1)
        else:  # the padding's columns: zero, in the one gradient tensor
            grad = softmax.new_zeros((*softmax.shape[:-1], ctx.width))
            torch.mul(softmax, g.unsqueeze(-1), out=grad[..., :scored])
        if scored:
            grad.scatter_add_(-1, torch.where(mine, local, 0).unsqueeze(-1), (-g * mine).unsqueeze(-1))
        return grad, None, None, None, None, None


def parallel_cross_entropy(logits: Tensor, targets: Tensor, tp: TensorGroup, ignore_index: int = -100,
                           vocab: int | None = None) -> Tensor:
    """Summed cross-entropy of ``logits`` [..., V/T] (this rank's vocabulary slice) against
    ``targets``; of the whole head's columns the first ``vocab`` are words (a padded head,
    model.vocab_multiple; None: every column)."""
    lo = tp.rank * logits.size(-1)
    scored = logits.size(-1) if vocab is None else min(logits.size(-1), max(0, vocab - lo))
    return _ParallelCrossEntropy.apply(logits, targets, lo, tp, ignore_index, scored).sum()


# ----------------------------------------------------------------------------- cutting a stage

# a layer's projections by their qualified name's ending: GPT-2 (pipeflow's and Hugging
# Face's), Llama-style decoders (Llama, Mistral, Qwen2), GPT-NeoX and BERT
COLUMN = ("attn.c_attn", "mlp.c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query_key_value",
          "dense_h_to_4h", "self.query", "self.key", "self.value", "intermediate.dense")
ROW = ("attn.c_proj", "mlp.c_proj", "o_proj", "down_proj", "attention.dense", "dense_4h_to_h", "output.dense")
# where the activations enter a group of column-parallel projections: the attention and MLP modules
ENTRIES = ("attn", "mlp", "self_attn", "attention.self", "intermediate", "attention")
KV = ("k_proj", "v_proj")
FUSED_QKV = "attn.c_attn"  # GPT-2's one matrix of Q|K|V: each of the three cut apart


def _qualified(module: nn.Module):
    return [(name, m) for name, m in module.named_modules() if name]


def shard_stage(module: nn.Module, tp: TensorGroup, n_head: int, n_kv_head: int | None = None) -> nn.Module:
    """Cut a whole stage across its tensor group in place; returns it. Marks each parameter
    with how its gradient comes together: ``_tp_split`` ((dim, blocks) of a piece),
    ``_tp_partial`` (a group it is summed over), ``_tp_copies`` (ranks holding it whole)."""
    T = tp.size
    n_kv = n_kv_head or n_head
    if n_head % T or (n_kv % T and T % n_kv):
        raise ValueError(f"pipeline.tensor_parallel={T}: {n_head} heads ({n_kv} key/value heads) do not split")
    layers = _layers(module)
    for prefix, layer in layers:
        for name, child in _qualified(layer):
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            if name.endswith(COLUMN) and _is_linear(child):
                blocks = 3 if name.endswith(FUSED_QKV) else 1
                kv = name.endswith(KV) or (name.endswith("self.key") or name.endswith("self.value"))
                setattr(parent, attr, _column(child, tp, blocks, n_kv if kv and n_kv != n_head else None))
            elif name.endswith(ROW) and _is_linear(child):
                setattr(parent, attr, _row(child, tp))
        for name, child in _qualified(layer):
            if name.endswith(ENTRIES) and not _is_linear(child) and any(
                    isinstance(c, ParallelLinear) and not c.row for c in child.children()):
                child.register_forward_pre_hook(_entry_hook(tp), with_kwargs=True)
        for attn in layer.modules():  # GPT-2's attention splits its fused output by this width
            if hasattr(attn, "split_size") and hasattr(attn, "c_attn"):
                attn.split_size //= T
    _cut_vocabulary(module, tp)
    _mark(module, tp, {p for _, layer in layers for p in layer.parameters()})
    module.tp = tp
    return module


def _layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stage's transformer layers (a ModuleDict of them: h, layer, layers)."""
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleDict) and name.rpartition(".")[2] in ("h", "layer", "layers"):
            return [(f"{name}.{k}", v) for k, v in child.items()]
    raise ValueError(f"{type(module).__name__}: no transformer layers to split (pipeline.tensor_parallel)")


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _column(m: nn.Module, tp: TensorGroup, blocks: int, kv_heads: int | None) -> ParallelLinear:
    transposed = not isinstance(m, nn.Linear)
    dim = 1 if transposed else 0
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    if kv_heads is not None and kv_heads < tp.size:  # replicated key/value heads: this rank's group's
        head = tp.rank * kv_heads // tp.size
        w = w.chunk(kv_heads, dim)[head]
        b = None if b is None else b.chunk(kv_heads, 0)[head]
        out = ParallelLinear(w, b, transposed, False, tp)
        for p in out.parameters():  # held by T/kv ranks each, whose gradients are summed among them
            p._tp_split = (dim if p.dim() > 1 else 0, 1, kv_heads)
            p._tp_partial, p._tp_copies = tp.kv_group, tp.kv_copies
        return out
    w = torch.cat([c.chunk(tp.size, dim)[tp.rank] for c in w.chunk(blocks, dim)], dim)
    if b is not None:
        b = torch.cat([c.chunk(tp.size, 0)[tp.rank] for c in b.chunk(blocks, 0)], 0)
    out = ParallelLinear(w, b, transposed, False, tp)
    out.weight._tp_split = (dim, blocks, None)
    if out.bias is not None:
        out.bias._tp_split = (0, blocks, None)
    return out


def _row(m: nn.Module, tp: TensorGroup) -> ParallelLinear:
    transposed = not isinstance(m, nn.Linear)
    dim = 0 if transposed else 1
    w = m.weight.detach().chunk(tp.size, dim)[tp.rank]
    out = ParallelLinear(w, None if m.bias is None else m.bias.detach(), transposed, True, tp)
    out.weight._tp_split = (dim, 1, None)
    return out


def _entry_hook(tp: TensorGroup):
    def hook(module, args, kwargs):
        if args:
            return (tp.column_input(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": tp.column_input(kwargs["hidden_states"])}
    return hook


def _cut_vocabulary(module: nn.Module, tp: TensorGroup) -> None:
    """The token embedding and the LM head by vocabulary, where T divides it."""
    emb = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Embedding)
           and n.rpartition(".")[2] in ("wte", "embed_tokens", "word_embeddings", "embed_in")]
    heads = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)
             and n.rpartition(".")[2] in ("lm_head", "decoder", "embed_out")]
    vocab = (emb or heads)[0][1].weight.size(0) if (emb or heads) else 0
    module.tp_vocab = bool(vocab) and vocab % tp.size == 0
    if not module.tp_vocab:
        return
    for name, m in emb:
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, VocabParallelEmbedding(m.weight, tp))
    for _, m in heads:
        m.weight = nn.Parameter(m.weight.detach().chunk(tp.size, 0)[tp.rank].clone())
    for name, p in module.named_parameters():
        if any(name == f"{n}.weight" for n, _ in (*emb, *heads)):
            p._tp_split = (0, 1, None)
    bias = getattr(getattr(module, "cls", None), "bias", None)  # BERT's MLM decoder bias
    if bias is not None:
        module.cls.bias = nn.Parameter(bias.detach().chunk(tp.size, 0)[tp.rank].clone())
        module.cls.bias._tp_split = (0, 1, None)


def _mark(module: nn.Module, tp: TensorGroup, in_layers: set) -> None:
    """How many ranks hold each parameter whole, and which gradients are partial."""
    norm_after = {id(p) for n, m in module.named_modules() if n.rpartition(".")[2] in ("ln_f", "norm", "final_layer_norm")
                  for p in m.parameters()}
    transform = getattr(getattr(module, "cls", None), "transform", None)
    head_side = {id(p) for p in transform.parameters()} if transform is not None else set()
    for p in module.parameters():
        split = getattr(p, "_tp_split", None)
        if hasattr(p, "_tp_copies"):  # (replicated key/value heads: marked where they were cut)
            continue
        if split is not None:
            p._tp_copies = 1
            continue
        p._tp_copies = tp.size
        # sequence parallel: what sees only this rank's tokens has a partial gradient
        if tp.sequence_parallel and (p in in_layers or id(p) in norm_after or id(p) in head_side):
            p._tp_partial = tp.group


def head_input(module: nn.Module, x: Tensor) -> Tensor:
    """What the LM head multiplies: every token, with the gradient the head's layout needs."""
    tp = getattr(module, "tp", None)
    if tp is None:
        return x
    if module.tp_vocab:
        return tp.column_input(x)
    return _GatherSeqReplicated.apply(x, tp) if tp.sequence_parallel else x


def enter(module: nn.Module, x: Tensor) -> Tensor:
    tp = getattr(module, "tp", None)
    return x if tp is None else tp.enter(x)


def tokens(module: nn.Module, local: int) -> int:
    tp = getattr(module, "tp", None)
    return local if tp is None else tp.tokens(local)


def reduce_partial_gradients(params: list) -> None:
    """Sum the partial gradients (sequence-parallel norms and biases, replicated key/value
    heads) across the ranks that hold the parameter; one flat all-reduce per group."""
    by_group: dict = {}
    for p in params:
        group = getattr(p, "_tp_partial", None)
        if group is not None and p.grad is not None:
            by_group.setdefault(id(group), (group, []))[1].append(p)
    for group, ps in by_group.values():
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        dist.all_reduce(flat, group=group)
        at = 0
        for p in ps:
            p.grad.copy_(flat[at:at + p.numel()].view_as(p.grad))
            at += p.numel()


def whole_gradient(p: Tensor, grad: Tensor, tp: TensorGroup) -> Tensor:
    """A piece's gradient put back together from every rank of the group (a test hook)."""
    split = getattr(p, "_tp_split", None)
    if split is None:
        return grad
    dim, blocks, heads = split
    parts = tp.all_gather(grad.unsqueeze(0), 0).unbind(0)
    if heads is not None and heads < tp.size:  # replicated key/value heads: one copy of each
        parts = parts[::tp.size // heads]
    pieces = [part.chunk(blocks, dim) for part in parts]
    return torch.cat([torch.cat([pc[b] for pc in pieces], dim) for b in range(blocks)], dim)
