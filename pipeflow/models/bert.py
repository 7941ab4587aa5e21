"""BERT for masked-language modelling, cut into pipeline stages by
:mod:`pipeflow.models.stage_builder`: a :class:`BertStage` holds transformers' ``BertLayer``
layers ``[lo, hi)``, the embeddings when first and the MLM head when last, the decoder
tied to the word embedding (a last stage's copy, ``cls.decoder.weight``, summed by the
runtime)."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPredictionHeadTransform

from pipeflow.models.attention import IMPLEMENTATION
from pipeflow.models.loss import cross_entropy_sum
from pipeflow.models.splittable import family_spec
from pipeflow.models.stage_builder import Parts, SplitStage
from pipeflow.planning.transformer import TransformerSpec

INIT_STD = 0.02  # BERT's initializer_range
IGNORE_INDEX = -100  # labels of positions that are not scored (not masked)


def bert_config(model_cfg: Mapping, spec: TransformerSpec | None = None) -> BertConfig:
    """A transformers ``BertConfig`` from the ``model`` config group (family bert); the
    group's GPT-style key names map onto BERT's (n_layer -> num_hidden_layers, ...);
    ``spec``: its shape, where a run plan carries it."""
    spec, dropout = family_spec(model_cfg, "bert", "BERT", spec)
    config = BertConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.n_embd,
        num_hidden_layers=spec.n_layer,
        num_attention_heads=spec.n_head,
        intermediate_size=spec.ffn_width,
        hidden_act="gelu",
        hidden_dropout_prob=float(dropout),
        attention_probs_dropout_prob=float(dropout),
        max_position_embeddings=spec.positions,
        type_vocab_size=2,
        initializer_range=INIT_STD,
        layer_norm_eps=1e-12,
        # no padding row: the MLM data never pads (every window is full), and BERT's
        # default pad id 0 would be the byte-level corpus' end-of-document token
        pad_token_id=None,
        is_decoder=False,
        add_cross_attention=False,
        use_cache=False,
    )
    # the layers' attention is pipeflow's (model.attention picks the fused kernel or eager)
    config._attn_implementation = IMPLEMENTATION
    return config


class BertStage(SplitStage):
    """Layers [lo, hi) of a BERT encoder; the embeddings when first, the MLM head when last."""

    configure = staticmethod(bert_config)

    def describe(self, config: BertConfig) -> Parts:
        H, V = config.hidden_size, config.vocab_size
        return Parts(
            embedding=[("embeddings", lambda: BertEmbeddings(config))],
            blocks="layer", block=lambda i: BertLayer(config, layer_idx=i),
            # BERT's MLM head: only the decoder's weight is used, its output bias is cls.bias
            head=[("cls.transform", lambda: BertPredictionHeadTransform(config)),
                  ("cls.decoder", lambda: nn.Linear(H, V, bias=False)),
                  ("cls.bias", lambda: nn.Parameter(torch.zeros(V)))],
            final="cls.transform", embed_weight="embeddings.word_embeddings.weight",
            head_weight="cls.decoder.weight", head_bias="cls.bias", tied=True,
            # full bidirectional attention over the window: the MLM data never pads
            causal=False, std=lambda name: INIT_STD,
            # token type 0 everywhere: one segment per sequence
            embed=lambda stage, ids: stage.embeddings(input_ids=ids),
        )


build_stage = BertStage.build_stage
build_model = BertStage.build_model


def mlm_loss(logits: Tensor, labels: Tensor, normalizer: float, vocab: int | None = None) -> Tensor:
    """Cross-entropy summed over the masked positions (label != -100), divided by
    ``normalizer`` (the global batch's masked count), over the first ``vocab`` logits of each
    (a padded head's; None: all)."""
    return cross_entropy_sum(logits, labels, IGNORE_INDEX, vocab) / normalizer  # (chunked: no fp32 copy of the logits)
