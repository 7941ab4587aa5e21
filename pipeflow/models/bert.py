"""BERT for masked-language modelling, cut into pipeline stages.

The encoder layers are transformers' own ``BertLayer`` (no mask: every token attends to
every token), their attention computed by :mod:`pipeflow.models.attention`
(``model.attention``: fused or eager); the embeddings are its ``BertEmbeddings`` and the head's
transform its ``BertPredictionHeadTransform``. A :class:`BertStage` holds layers
``[lo, hi)``, plus the embeddings when it is the first stage and the MLM head when it
is the last. It follows :mod:`pipeflow.models.gpt` so the runtime treats both alike:

- Parameter names are global whatever the split: ``embeddings.*`` (word, position and
  token-type embeddings, LayerNorm), ``layer.<i>.*``, ``cls.transform.*``, ``cls.bias``
  and, on a last stage that is not also the first, ``cls.decoder.weight``.
- Initialisation does not depend on the split: each parameter is drawn from its own
  generator seeded by (seed, name), with BERT's scheme (normal 0.02 for matrices and
  embeddings, LayerNorm weight 1, biases 0).

The decoder is tied to the word embedding (as in BERT). When one stage holds both it
uses ``embeddings.word_embeddings.weight`` itself; otherwise the last stage keeps a copy,
``cls.decoder.weight``, initialised equal, whose gradient the runtime sums with the
embedding's so the two stay equal.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPredictionHeadTransform

from pipeflow.models.attention import IMPLEMENTATION, Pattern, check_mode
from pipeflow.models.splittable import block_output, family_spec, layer_bounds, seeded_normal_
from pipeflow.models.loss import cross_entropy_sum
from pipeflow.models.recompute import apply_recompute
from pipeflow.models.tensor_parallel import enter, head_input

INIT_STD = 0.02  # BERT's initializer_range
IGNORE_INDEX = -100  # labels of positions that are not scored (not masked)


def bert_config(model_cfg: Mapping) -> BertConfig:
    """A transformers ``BertConfig`` from the ``model`` config group (family bert); the
    group's GPT-style key names map onto BERT's (n_layer -> num_hidden_layers, ...)."""
    spec, dropout = family_spec(model_cfg, "bert", "BERT")
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


class _MLMHead(nn.Module):
    """BERT's MLM head without its decoder matrix when that is the embedding itself."""

    def __init__(self, config: BertConfig, own_decoder: bool):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        if own_decoder:
            # only its weight is used (the output bias is cls.bias, as in BERT)
            self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))


class BertStage(nn.Module):
    """Layers [lo, hi) of a BERT encoder; the embeddings when first, the MLM head when last."""

    def __init__(self, config: BertConfig, lo: int, hi: int, first: bool, last: bool, seed: int,
                 attention: str = "sdpa", vocab: int | None = None):
        super().__init__()
        self.attention = check_mode(attention)
        # the words the loss scores; config.vocab_size may be padded past them (model.vocab_multiple)
        self.vocab = config.vocab_size if vocab is None else vocab
        if not 0 <= lo < hi <= config.num_hidden_layers:
            raise ValueError(
                f"stage layers [{lo}, {hi}): need 0 <= lo < hi <= model.n_layer={config.num_hidden_layers}"
            )
        self.config = config
        self.lo, self.hi, self.first, self.last = lo, hi, first, last
        if first:
            self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleDict({str(i): BertLayer(config, layer_idx=i) for i in range(lo, hi)})
        if last:
            self.cls = _MLMHead(config, own_decoder=not first)
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """BERT's initialisation, one generator per parameter name so any split draws the same values."""
        for name, param in self.named_parameters():
            if name == "cls.decoder.weight":
                # the tied copy starts equal to the embedding it mirrors
                seeded_normal_(param, INIT_STD, seed, "embeddings.word_embeddings.weight", rows=self.vocab)
            elif name == "embeddings.word_embeddings.weight":
                seeded_normal_(param, INIT_STD, seed, name, rows=self.vocab)  # (padding rows: zero)
            elif name.endswith("LayerNorm.weight"):
                nn.init.ones_(param)
            elif name.endswith("bias"):  # Linear and LayerNorm biases, and cls.bias
                nn.init.zeros_(param)
            else:
                seeded_normal_(param, INIT_STD, seed, name)

    def decoder_weight(self) -> Tensor:
        return self.embeddings.word_embeddings.weight if self.first else self.cls.decoder.weight

    def tied_parameters(self) -> list[nn.Parameter]:
        """This stage's copies of the tied embedding, whose gradients the runtime sums across stages."""
        tied = []
        if self.first:
            tied.append(self.embeddings.word_embeddings.weight)
        if self.last and not self.first:
            tied.append(self.cls.decoder.weight)
        return tied

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            T = x.size(1)
            if T > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence of {T} tokens is longer than model.n_positions={self.config.max_position_embeddings}; "
                    f"use seq_len <= {self.config.max_position_embeddings}"
                )
            x = enter(self, self.embeddings(input_ids=x))  # token type 0 everywhere: one segment per sequence
        # full bidirectional attention over the window: the MLM data never pads
        pattern = Pattern(self.attention, causal=False)
        for block in self.layer.values():
            x = block_output(block(x, attention_mask=pattern))
        if self.last:
            x = head_input(self, self.cls.transform(x))
            x = F.linear(x, self.decoder_weight(), self.cls.bias)
        return x


def build_stage(model_cfg: Mapping, layers_per_stage: Sequence[int], stage: int, seed: int) -> BertStage:
    """Stage ``stage`` of the split ``layers_per_stage`` (see pipeflow.planning.partitioners)."""
    config = bert_config(model_cfg)
    lo, hi = layer_bounds(config.num_hidden_layers, layers_per_stage, stage)
    module = BertStage(config, lo, hi, first=stage == 0, last=stage == len(layers_per_stage) - 1, seed=seed,
                       attention=model_cfg.get("attention") or "sdpa", vocab=model_cfg.get("vocab_size"))
    return apply_recompute(module, model_cfg.get("recompute") or "none", (BertLayer,))


def build_model(model_cfg: Mapping, seed: int) -> BertStage:
    """The whole model as one stage: the pipeline.stages=1 reference."""
    config = bert_config(model_cfg)
    return BertStage(config, 0, config.num_hidden_layers, first=True, last=True, seed=seed,
                     attention=model_cfg.get("attention") or "sdpa", vocab=model_cfg.get("vocab_size"))


def mlm_loss(logits: Tensor, labels: Tensor, normalizer: float, vocab: int | None = None) -> Tensor:
    """Cross-entropy summed over the masked positions (label != -100), divided by
    ``normalizer``, over the first ``vocab`` logits of each (a padded head's; None: all).

    The runtime passes the global batch's count of masked positions, so the losses of
    its microbatches add up to the mean over every masked token of the batch."""
    return cross_entropy_sum(logits, labels, IGNORE_INDEX, vocab) / normalizer  # (chunked: no fp32 copy of the logits)
