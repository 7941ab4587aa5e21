"""Any supported Hugging Face decoder, cut into pipeline stages (``model.family=hf_causal``)
by :mod:`pipeflow.models.stage_builder`: built on the meta device by transformers, a stage
materialises only its embedding, layers ``[lo, hi)`` or final norm and head (where the
config ties the head, a last stage's copy is summed by the runtime); ``model.weights``
loads a local checkpoint by name."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from pipeflow.hf import architecture, load_hf_config
from pipeflow.models.attention import IMPLEMENTATION
from pipeflow.models.stage_builder import Parts, SplitStage


class HFCausalStage(SplitStage):
    """Decoder layers [lo, hi) of a transformers causal LM, with the embedding when first
    and the final norm and LM head when last."""

    padded_vocab = False  # the table is the HF config's (model.vocab_size is read from it)

    @staticmethod
    def configure(model_cfg: Mapping, spec=None):
        return load_hf_config(model_cfg)

    def describe(self, config) -> Parts:
        from transformers import AutoModelForCausalLM

        config._attn_implementation = IMPLEMENTATION  # the layers call pipeflow's attention
        self.arch = a = architecture(config.model_type)
        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(config)
        src = getattr(whole, a.base)

        def on_base(name: str):
            return f"{a.base}.{name}", lambda: getattr(src, name)

        std = float(getattr(config, "initializer_range", 0.02))
        return Parts(
            embedding=[on_base(name) for name in (a.embed, a.positions, a.dropout) if name],
            blocks=f"{a.base}.{a.layers}", block=lambda i: getattr(src, a.layers)[i],
            head=[on_base(a.norm), (a.head, lambda: getattr(whole, a.head))],
            final=f"{a.base}.{a.norm}", embed_weight=f"{a.base}.{a.embed}.weight", head_weight=f"{a.head}.weight",
            head_bias=f"{a.head}.bias" if getattr(whole, a.head).bias is not None else None,
            tied=bool(getattr(config, "tie_word_embeddings", False)), causal=True, std=lambda name: std,
            positions=a.positions and f"{a.base}.{a.positions}", dropout=a.dropout and f"{a.base}.{a.dropout}",
            # computed tables, no weights: built for real, not from the meta tree
            rotary=a.rotary and (f"{a.base}.{a.rotary}", lambda: type(getattr(src, a.rotary))(config=config)),
            cache_kw=a.cache_kw, whole_tied=False,
        )

    @property
    def _base(self) -> nn.Module:  # (the layer profiler empties its layers)
        return getattr(self, self.arch.base)

    @property
    def embed_name(self) -> str:
        return self.parts.embed_weight

    def load(self, model_cfg: Mapping) -> None:
        if model_cfg.get("weights"):
            self.load_weights(str(model_cfg["weights"]))

    def load_weights(self, folder: str) -> None:
        """Load this stage's parameters from a local checkpoint's ``*.safetensors``, by name
        (a tied copy from the embedding it mirrors)."""
        from safetensors import safe_open

        from pipeflow.hf import weight_files

        files = weight_files(folder)  # checked before any rank started (pipeflow.hf.check_weights)
        want = dict(self.named_parameters())
        found: dict[str, Tensor] = {}
        alias = {self.parts.head_weight: self.embed_name} if self.parts.tied else {}
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


build_stage = HFCausalStage.build_stage
build_model = HFCausalStage.build_model
