"""Model family specs (``model.family``): each family's stage models, runtime adapter (by
import path), data set and what it supports, declared once and read by the checks, the
runtime, the cost model and the planner instead of family names. Torch-free."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class FamilySpec:
    name: str
    summary: str
    data: str  # the data set it trains on (data=auto picks it): conf/data/<data>.yaml
    adapter: str  # "module:Class" of its runtime adapter (pipeflow.runtime.adapters)
    causal: bool = False  # causal attention: sequence segments (Seq1F1B) can split its sequences
    branched: bool = False  # its stages form a DAG of branches (the concurrent-branch model)
    vocab: int | None = None  # token ids its data set feeds (model.vocab_size must cover them)
    # its shape reads as a TransformerSpec (pipeflow.planning.transformer): the analytic cost
    # model and the planner price it; a branched family is priced per branch instead
    transformer: bool = True
    # the head shares the embedding's weight (its first and last stages hold copies):
    # always (GPT-2's, BERT's), where the model's config says so (``model.tied``: a Hugging Face
    # config's tie_word_embeddings), or never
    tied_head: str = "never"

    def tied(self, model_cfg) -> bool:
        """Whether this model's head is tied to its embedding."""
        return self.tied_head == "always" or (self.tied_head == "config" and bool(model_cfg.get("tied", False)))

    def load_adapter(self):
        module, _, cls = self.adapter.partition(":")
        return getattr(importlib.import_module(module), cls)


# token ids the byte-level data sets feed: UTF-8 bytes (text_corpus), bytes plus four
# special ids (mlm_corpus); a test keeps these equal to the data package's
BYTE_VOCAB = 256
MLM_VOCAB = 260

FAMILIES: dict[str, FamilySpec] = {
    f.name: f
    for f in (
        FamilySpec("gpt", "decoder-only transformer, next-token loss", "text_corpus",
                   "pipeflow.runtime.adapters:GPTAdapter", causal=True, vocab=BYTE_VOCAB, tied_head="always"),
        FamilySpec("bert", "encoder-only transformer, masked-LM loss", "mlm_corpus",
                   "pipeflow.runtime.adapters:BertAdapter", vocab=MLM_VOCAB, tied_head="always"),
        FamilySpec("hf_causal", "a Hugging Face decoder (Llama, Qwen2, Mistral, GPT-NeoX, GPT-2) from its config.json, "
                   "next-token loss", "text_corpus", "pipeflow.runtime.adapters:HFCausalAdapter", causal=True,
                   vocab=BYTE_VOCAB, tied_head="config"),
        FamilySpec("cbm", "vision + text branches with co-attention, image-text matching and masked LM",
                   "image_text", "pipeflow.runtime.adapters:CBMAdapter", branched=True, transformer=False),
    )
}


def family_of(model_cfg) -> FamilySpec:
    """The spec of ``model.family`` (default gpt); ValueError naming the key and the families."""
    name = model_cfg.get("family", "gpt") or "gpt"
    spec = FAMILIES.get(name)
    if spec is None:
        raise ValueError(f"model.family={name}: unknown model family; allowed values: {', '.join(FAMILIES)}")
    return spec


def data_family() -> dict[str, tuple[str, ...]]:
    """Data set -> the families it feeds (text_corpus: gpt and hf_causal)."""
    feeds: dict[str, tuple[str, ...]] = {}
    for f in FAMILIES.values():
        feeds[f.data] = (*feeds.get(f.data, ()), f.name)
    return feeds
