"""One stage builder for every transformer family: a family names its modules globally (:class:`Parts`) and
:class:`SplitStage` holds layers ``[lo, hi)`` of it (the embedding when first, the head when last), so
any split holds and draws the whole model's parameters under their own names."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeflow.models.attention import Pattern, SegmentCache, check_mode
from pipeflow.models.recompute import apply_recompute
from pipeflow.models.splittable import block_output, layer_bounds, seeded_normal_
from pipeflow.models.tensor_parallel import enter, head_input, tokens

Part = tuple[str, Callable[[], "nn.Module | nn.Parameter"]]  # (global name, what makes it)


@dataclass(frozen=True)
class Parts:
    """A family's model by its modules' global names and what makes each, made in order so the draws match
    the whole model's (meta-device parts materialised first)."""

    embedding: Sequence[Part]  # the first stage's modules
    blocks: str  # the ModuleDict holding the blocks by their global index
    block: Callable[[int], nn.Module]  # block i
    head: Sequence[Part]  # the last stage's: the final norm, the head's own modules
    final: str  # what the last block's output passes before the head's product
    embed_weight: str  # the token table
    # the head's matrix; with ``tied`` a last stage's copy of the token table, left out
    # (with the module holding it) where the stage holds the table itself
    head_weight: str
    tied: bool
    causal: bool
    std: Callable[[str], float]  # the N(0, std) of a matrix's seeded draw, by its name
    head_bias: str | None = None
    positions: str | None = None  # a learned position embedding
    dropout: str | None = None  # the embedding's dropout
    rotary: Part | None = None  # a rotary table (no weights), made after the draw
    cache_kw: str = "past_key_values"  # how a block takes its key/value cache, where not ``cache``
    # the family's own embedding call (ids -> hidden states); None: tokens + positions, dropout
    embed: Callable[[nn.Module, Tensor], Tensor] | None = None
    # a stage holding both ends lists its one table as tied (the runtime sums it alone)
    whole_tied: bool = True


class SplitStage(nn.Module):
    """Layers [lo, hi) of a family's model; the embedding when first, final norm and head when last.
    ``vocab``: the table's real rows (the rest padding; None: all)."""

    padded_vocab = True  # model.vocab_size counts the words of a table padded past them

    def __init__(self, config, lo: int, hi: int, first: bool, last: bool, seed: int,
                 attention: str = "sdpa", vocab: int | None = None):
        super().__init__()
        self.attention = check_mode(attention)
        n_layer = config.num_hidden_layers
        if not 0 <= lo < hi <= n_layer:
            raise ValueError(f"stage layers [{lo}, {hi}): need 0 <= lo < hi <= model.n_layer={n_layer}")
        self.vocab = config.vocab_size if vocab is None else vocab
        self.config, self.lo, self.hi, self.first, self.last = config, lo, hi, first, last
        self.parts = parts = self.describe(config)
        own_head = parts.head_weight.rpartition(".")[0]
        for name, make in [*(parts.embedding if first else ()),
                           (parts.blocks, lambda: nn.ModuleDict({str(i): parts.block(i) for i in range(lo, hi)})),
                           *(parts.head if last else ())]:
            if not (parts.tied and first and name == own_head):
                self._place(name, make())
        meta = any(p.is_meta for p in self.parameters())
        if meta:
            self.to_empty(device="cpu")
        self._init_weights(seed)
        buffers = [name for name, _ in self.named_buffers()] if meta else []
        if buffers:
            raise ValueError(f"model.hf: {config.model_type} keeps a buffer ({buffers[0]}) the stage cannot "
                             f"rebuild from the meta device")
        if parts.rotary:
            self._place(parts.rotary[0], parts.rotary[1]())
        self.block_type = type(next(iter(self._blocks())))
        accepted = inspect.signature(self.block_type.forward).parameters
        self.cache_kw = "cache" if "cache" in accepted else parts.cache_kw  # (transformers 5 renamed it)

    def describe(self, config) -> Parts:
        """The family's parts, from its transformers config."""
        raise NotImplementedError

    @staticmethod
    def configure(model_cfg: Mapping, spec=None):
        """The family's transformers config from the ``model`` group."""
        raise NotImplementedError

    def load(self, model_cfg: Mapping) -> None:
        """Start from the checkpoint ``model_cfg`` names, where the family reads one."""

    def _place(self, name: str, part) -> None:
        parent_name, _, attr = name.rpartition(".")
        parent = self
        for step in parent_name.split(".") if parent_name else ():
            if not hasattr(parent, step):
                parent.add_module(step, nn.Module())
            parent = getattr(parent, step)
        if isinstance(part, nn.Parameter):
            parent.register_parameter(attr, part)
        else:
            parent.add_module(attr, part)

    def _init_weights(self, seed: int) -> None:
        """One generator per parameter name, so any split draws the same values: matrices N(0, std), norm
        weights 1, other vectors 0; a tied copy starts as the table."""
        parts = self.parts
        norms = {id(p) for m in self.modules() if "norm" in type(m).__name__.lower() for p in m.parameters(False)}
        for name, param in self.named_parameters():
            if name == parts.head_weight and parts.tied:
                seeded_normal_(param, parts.std(parts.embed_weight), seed, parts.embed_weight, rows=self.vocab)
            elif name == parts.embed_weight:
                seeded_normal_(param, parts.std(name), seed, name, rows=self.vocab)  # (padding rows: zero)
            elif param.dim() >= 2:
                seeded_normal_(param, parts.std(name), seed, name)
            elif id(param) in norms and not name.endswith(".bias"):
                nn.init.ones_(param)
            else:
                nn.init.zeros_(param)

    def tied_parameters(self) -> list[nn.Parameter]:
        """This stage's copies of a tied table, whose gradients the runtime sums across stages."""
        parts = self.parts
        if not parts.tied or (self.first and self.last and not parts.whole_tied):
            return []
        if self.first:
            return [self.get_parameter(parts.embed_weight)]
        return [self.get_parameter(parts.head_weight)] if self.last else []

    def _blocks(self):
        return self.get_submodule(self.parts.blocks).values()

    def _embed(self, ids: Tensor, offset: int) -> Tensor:
        T, n = ids.size(1), self.config.max_position_embeddings
        if offset + T > n:
            raise ValueError(f"sequence of {offset + T} tokens is longer than model.n_positions={n}; "
                             f"use seq_len <= {n}")
        parts = self.parts
        if parts.embed is not None:
            return enter(self, parts.embed(self, ids))
        x = self.get_submodule(parts.embed_weight.rpartition(".")[0])(ids)
        if parts.positions:
            x = x + self.get_submodule(parts.positions)(torch.arange(offset, offset + T, device=ids.device))
        if parts.dropout:
            x = self.get_submodule(parts.dropout)(x)
        return enter(self, x)  # (sequence parallel: this rank's slice of the tokens)

    def _block_kwargs(self, x: Tensor, offset: int) -> dict:
        kw = {"attention_mask": Pattern(self.attention, causal=self.parts.causal, offset=offset)}
        if self.parts.rotary:
            T = tokens(self, x.size(1))  # (sequence parallel: the rotary tables of every token)
            pos = torch.arange(offset, offset + T, device=x.device)[None]
            kw["position_embeddings"] = self.get_submodule(self.parts.rotary[0])(x, pos)
        return kw

    def _head(self, x: Tensor) -> Tensor:
        parts = self.parts
        x = head_input(self, self.get_submodule(parts.final)(x))  # (tensor parallel: every token)
        weight = self.get_parameter(parts.embed_weight if parts.tied and self.first else parts.head_weight)
        return F.linear(x, weight, self.get_parameter(parts.head_bias) if parts.head_bias else None)

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            x = self._embed(x, 0)
        kw = self._block_kwargs(x, 0)
        for block in self._blocks():
            x = block_output(block(x, **kw))
        return self._head(x) if self.last else x

    def forward_segment(
        self, x: Tensor, offset: int, prefix: Sequence[tuple[Tensor, Tensor]] | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One Seq1F1B segment at positions ``offset ..``; ``prefix[i]``: block i's keys and values of the
        earlier segments (None first). Returns the output and each block's own (keys, values)."""
        if self.first:
            x = self._embed(x, offset)
        kw = self._block_kwargs(x, offset)
        kvs: list[tuple[Tensor, Tensor]] = []
        for i, block in enumerate(self._blocks()):
            cache = SegmentCache(prefix[i] if prefix else None)
            x = block_output(block(x, **kw, **{self.cache_kw: cache}))
            kvs.append(cache.own)
        return (self._head(x) if self.last else x), kvs

    @classmethod
    def build_stage(cls, model_cfg: Mapping, layers_per_stage: Sequence[int], stage: int, seed: int,
                    spec=None) -> "SplitStage":
        """Stage ``stage`` of the split ``layers_per_stage``, recomputing as model.recompute says (``spec``:
        the model's shape, where a run plan carries it)."""
        return cls._cut(cls.configure(model_cfg, spec), model_cfg, layers_per_stage, stage, seed)

    @classmethod
    def build_model(cls, model_cfg: Mapping, seed: int) -> "SplitStage":
        """The whole model as one stage: the pipeline.stages=1 reference."""
        config = cls.configure(model_cfg)
        return cls._cut(config, model_cfg, [config.num_hidden_layers], 0, seed)

    @classmethod
    def _cut(cls, config, model_cfg: Mapping, layers_per_stage: Sequence[int], stage: int, seed: int) -> "SplitStage":
        lo, hi = layer_bounds(config.num_hidden_layers, layers_per_stage, stage)
        module = cls(config, lo, hi, first=stage == 0, last=stage == len(layers_per_stage) - 1, seed=seed,
                     attention=model_cfg.get("attention") or "sdpa",
                     vocab=model_cfg.get("vocab_size") if cls.padded_vocab else None)
        module.load(model_cfg)
        return apply_recompute(module, model_cfg.get("recompute") or "none", (module.block_type,))
