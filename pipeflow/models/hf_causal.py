"""Any supported Hugging Face decoder, cut into pipeline stages (``model.family=hf_causal``).

The model is transformers' own: ``AutoModelForCausalLM.from_config`` builds it on the
meta device (no memory, whatever its size), and a stage takes the modules it holds out
of that tree: the token embedding (and learned positions) when first, decoder layers
``[lo, hi)``, the final norm and the LM head when last. Only those are materialised.
Rotary tables are built afresh on every stage that holds layers (they have no weights).

As for the GPT (:mod:`pipeflow.models.gpt`):

- Parameter names are transformers' own (``model.layers.3.self_attn.q_proj.weight``),
  whatever the split, so gradients compare by name and ``model.weights`` loads a local
  checkpoint's safetensors by name.
- Weights are drawn per parameter name (normal with the config's
  ``initializer_range``; norms one, biases zero), so any split holds the whole model's
  values; transformers' own initialisation differs per architecture and is not used.
- A tied head (``tie_word_embeddings``) is the embedding itself on a one-stage model;
  split, the last stage keeps a copy initialised equal to it, and the runtime sums the
  two copies' gradients.

Attention is pipeflow's (:mod:`pipeflow.models.attention`, ``model.attention``: fused or
eager), causal, with the sliding window the layer's own attention module names. Seq1F1B's
segments go through the layers' own key/value cache interface: a
:class:`~pipeflow.models.attention.SegmentCache` hands a layer the keys and values of the
microbatch's earlier segments and keeps this segment's, with autograd connecting them, so
a later segment's backward reaches the earlier segments' keys and values.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeflow.hf import architecture, load_hf_config
from pipeflow.models.attention import IMPLEMENTATION, Pattern, SegmentCache, check_mode
from pipeflow.models.splittable import block_output, layer_bounds, seeded_normal_
from pipeflow.models.recompute import apply_recompute
from pipeflow.models.tensor_parallel import enter, head_input, tokens


class HFCausalStage(nn.Module):
    """Decoder layers [lo, hi) of a transformers causal LM, with the embedding when first
    and the final norm and LM head when last."""

    def __init__(self, config, lo: int, hi: int, first: bool, last: bool, seed: int, attention: str = "sdpa"):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.attention = check_mode(attention)
        config._attn_implementation = IMPLEMENTATION  # the layers call pipeflow's attention
        n_layer = config.num_hidden_layers
        if not 0 <= lo < hi <= n_layer:
            raise ValueError(f"stage layers [{lo}, {hi}): need 0 <= lo < hi <= model.n_layer={n_layer}")
        self.config, self.arch = config, architecture(config.model_type)
        self.lo, self.hi, self.first, self.last = lo, hi, first, last
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(config)
        a, src = self.arch, getattr(whole, self.arch.base)
        base = nn.Module()
        setattr(self, a.base, base)
        if first:
            setattr(base, a.embed, getattr(src, a.embed))
            for name in (a.positions, a.dropout):
                if name:
                    setattr(base, name, getattr(src, name))
        setattr(base, a.layers, nn.ModuleDict({str(i): getattr(src, a.layers)[i] for i in range(lo, hi)}))
        if last:
            setattr(base, a.norm, getattr(src, a.norm))
            if not (self.tied and first):
                setattr(self, a.head, getattr(whole, a.head))
        self.to_empty(device="cpu")
        self._init_weights(seed)
        if a.rotary:  # computed tables, no weights: built for real, not from the meta tree
            setattr(base, a.rotary, type(getattr(src, a.rotary))(config=config))
        self.block_type = type(getattr(src, a.layers)[0])
        # the keyword a layer takes its key/value cache by: transformers renamed
        # past_key_values to cache (5.x), GPT-NeoX keeps layer_past
        import inspect

        accepted = inspect.signature(self.block_type.forward).parameters
        self.cache_kw = "cache" if "cache" in accepted else a.cache_kw

    # ------------------------------------------------------------------ weights

    @property
    def _base(self) -> nn.Module:
        return getattr(self, self.arch.base)

    @property
    def embed_name(self) -> str:
        return f"{self.arch.base}.{self.arch.embed}.weight"

    def _init_weights(self, seed: int) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        norms = {id(p) for m in self.modules() if "norm" in type(m).__name__.lower() for p in m.parameters(False)}
        for name, param in self.named_parameters():
            if name == f"{self.arch.head}.weight" and self.tied:
                seeded_normal_(param, std, seed, self.embed_name)  # the tied copy starts equal to the embedding
            elif param.dim() >= 2:
                seeded_normal_(param, std, seed, name)
            elif id(param) in norms and not name.endswith(".bias"):
                nn.init.ones_(param)
            else:
                nn.init.zeros_(param)
        for buf_name, buf in self.named_buffers():
            raise ValueError(f"model.hf: {self.config.model_type} keeps a buffer ({buf_name}) the stage cannot "
                             f"rebuild from the meta device")

    def load_weights(self, folder: str) -> None:
        """Load this stage's parameters from a local checkpoint's ``*.safetensors``, by name
        (a tied copy from the embedding it mirrors)."""
        from safetensors import safe_open

        from pipeflow.hf import weight_files

        files = weight_files(folder)  # checked before any rank started (pipeflow.hf.check_weights)
        want = dict(self.named_parameters())
        found: dict[str, Tensor] = {}
        alias = {f"{self.arch.head}.weight": self.embed_name} if self.tied else {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    for name in [n for n in want if key in (n, alias.get(n))]:
                        found.setdefault(name, st.get_tensor(key))
        missing = sorted(set(want) - set(found))
        if missing:
            raise ValueError(f"model.weights={folder}: the checkpoint lacks {', '.join(missing[:4])}"
                             + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
        with torch.no_grad():
            for name, value in found.items():
                if want[name].shape != value.shape:
                    raise ValueError(f"model.weights={folder}: {name} is {tuple(value.shape)} there, "
                                     f"{tuple(want[name].shape)} in the model's config")
                want[name].copy_(value.to(want[name].dtype))

    def tied_parameters(self) -> list[nn.Parameter]:
        """This stage's copies of a tied embedding, whose gradients the runtime sums across stages."""
        if not self.tied or (self.first and self.last):
            return []
        if self.first:
            return [getattr(self._base, self.arch.embed).weight]
        if self.last:
            return [getattr(self, self.arch.head).weight]
        return []

    # ------------------------------------------------------------------ forward

    def _embed(self, ids: Tensor, offset: int) -> Tensor:
        T = ids.size(1)
        if offset + T > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {offset + T} tokens is longer than model.n_positions="
                             f"{self.config.max_position_embeddings}; use seq_len <= "
                             f"{self.config.max_position_embeddings}")
        a, base = self.arch, self._base
        x = getattr(base, a.embed)(ids)
        if a.positions:
            x = x + getattr(base, a.positions)(torch.arange(offset, offset + T, device=ids.device))
        if a.dropout:
            x = getattr(base, a.dropout)(x)
        return enter(self, x)  # (sequence parallel: this rank's slice of the tokens)

    def _head(self, x: Tensor) -> Tensor:
        x = head_input(self, getattr(self._base, self.arch.norm)(x))
        if self.tied and self.first:
            return F.linear(x, getattr(self._base, self.arch.embed).weight)
        return getattr(self, self.arch.head)(x)

    def _layer_kwargs(self, x: Tensor, offset: int) -> dict:
        T = tokens(self, x.size(1))  # (sequence parallel: the rotary tables of every token)
        # a sliding window, where there is one, comes from each layer's attention module
        kw = {"attention_mask": Pattern(self.attention, causal=True, offset=offset)}
        if self.arch.rotary:
            pos = torch.arange(offset, offset + T, device=x.device)[None]
            kw["position_embeddings"] = getattr(self._base, self.arch.rotary)(x, pos)
        return kw

    def _layers(self):
        return getattr(self._base, self.arch.layers).values()

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            x = self._embed(x, 0)
        kw = self._layer_kwargs(x, 0)
        for layer in self._layers():
            x = block_output(layer(x, **kw))
        return self._head(x) if self.last else x

    def forward_segment(
        self, x: Tensor, offset: int, prefix: Sequence[tuple[Tensor, Tensor]] | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One sequence segment (Seq1F1B): positions ``offset .. offset + T - 1``, attending
        over ``prefix[i]``, the keys and values layer i computed for the earlier segments
        (None for the first). Returns the output and each layer's own keys and values."""
        if self.first:
            x = self._embed(x, offset)
        kw = self._layer_kwargs(x, offset)
        kvs: list[tuple[Tensor, Tensor]] = []
        for i, layer in enumerate(self._layers()):
            cache = SegmentCache(prefix[i] if prefix else None)
            x = block_output(layer(x, **kw, **{self.cache_kw: cache}))
            kvs.append(cache.own)
        return (self._head(x) if self.last else x), kvs


def build_stage(model_cfg: Mapping, layers_per_stage: Sequence[int], stage: int, seed: int) -> HFCausalStage:
    """Stage ``stage`` of the split ``layers_per_stage`` (see pipeflow.planning.partitioners)."""
    config = load_hf_config(model_cfg)
    lo, hi = layer_bounds(config.num_hidden_layers, layers_per_stage, stage)
    module = HFCausalStage(config, lo, hi, first=stage == 0, last=stage == len(layers_per_stage) - 1, seed=seed,
                           attention=model_cfg.get("attention") or "sdpa")
    if model_cfg.get("weights"):
        module.load_weights(str(model_cfg["weights"]))
    return apply_recompute(module, model_cfg.get("recompute") or "none", (module.block_type,))


def build_model(model_cfg: Mapping, seed: int) -> HFCausalStage:
    """The whole model as one stage: the pipeline.stages=1 reference."""
    return build_stage(model_cfg, [load_hf_config(model_cfg).num_hidden_layers], 0, seed)
