"""GPT-2, cut into pipeline stages by :mod:`pipeflow.models.stage_builder`: a
:class:`GPTStage` holds transformers' ``GPT2Block`` blocks ``[lo, hi)``, the embeddings when
first and the final LayerNorm and LM head when last. The LM head is tied to ``wte``; a
last stage without it keeps a copy, ``lm_head.weight``, whose gradient the runtime sums
with the first's."""

from __future__ import annotations

import math
from typing import Mapping

from torch import Tensor, nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from pipeflow.models.attention import IMPLEMENTATION
from pipeflow.models.loss import cross_entropy_sum
from pipeflow.models.splittable import family_spec
from pipeflow.models.stage_builder import Parts, SplitStage
from pipeflow.planning.transformer import TransformerSpec

INIT_STD = 0.02  # GPT-2's initializer_range


def gpt2_config(model_cfg: Mapping, spec: TransformerSpec | None = None) -> GPT2Config:
    """A transformers ``GPT2Config`` from the ``model`` config group (family gpt); ``spec``:
    its shape, where a run plan carries it."""
    spec, dropout = family_spec(model_cfg, "gpt", "GPT-2", spec)
    config = GPT2Config(
        vocab_size=spec.vocab_size,
        n_positions=spec.positions,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        n_inner=spec.ffn_width,
        # the fused tanh GeLU kernel (GPT-2's gelu_new to rounding): it keeps its input only,
        # where gelu_new written in Python kept five tensors of the MLP's width
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=float(dropout),
        embd_pdrop=float(dropout),
        attn_pdrop=float(dropout),
        layer_norm_epsilon=1e-5,
        initializer_range=INIT_STD,
        use_cache=False,
        # GPT-2's <|endoftext|> id (50256) means nothing to other vocabularies (bytes)
        bos_token_id=None,
        eos_token_id=None,
    )
    # the blocks' attention is pipeflow's (model.attention picks the fused kernel or eager)
    config._attn_implementation = IMPLEMENTATION
    return config


class GPTStage(SplitStage):
    """Layers [lo, hi) of a GPT-2; the token+position embedding when first, final LayerNorm + LM head when last."""

    configure = staticmethod(gpt2_config)

    def describe(self, config: GPT2Config) -> Parts:
        # GPT-2: projections into the stream drawn with std / sqrt(2 * n_layer)
        projection_std = INIT_STD / math.sqrt(2 * config.n_layer)
        projections = ("attn.c_proj.weight", "mlp.c_proj.weight")
        return Parts(
            embedding=[("wte", lambda: nn.Embedding(config.vocab_size, config.n_embd)),
                       ("wpe", lambda: nn.Embedding(config.n_positions, config.n_embd)),
                       ("drop", lambda: nn.Dropout(config.embd_pdrop))],
            blocks="h", block=lambda i: GPT2Block(config, layer_idx=i),
            head=[("ln_f", lambda: nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)),
                  ("lm_head", lambda: nn.Linear(config.n_embd, config.vocab_size, bias=False))],
            final="ln_f", embed_weight="wte.weight", head_weight="lm_head.weight", tied=True, causal=True,
            std=lambda name: projection_std if name.endswith(projections) else INIT_STD,
            positions="wpe", dropout="drop",
        )


build_stage = GPTStage.build_stage
build_model = GPTStage.build_model


def lm_loss(logits: Tensor, targets: Tensor, normalizer: float, vocab: int | None = None) -> Tensor:
    """Summed next-token cross-entropy divided by ``normalizer`` (the global batch's token
    count, so microbatch losses add up to the batch mean), over the first ``vocab`` logits of
    each token (a padded head's; None: all)."""
    return cross_entropy_sum(logits, targets, vocab=vocab) / normalizer  # (chunked: no fp32 copy of the logits)


def hidden_shape(model_cfg: Mapping, microbatch_size: int, seq_len: int) -> tuple[int, int, int]:
    """Shape of the activation one stage sends the next for one microbatch."""
    return (microbatch_size, seq_len, model_cfg["n_embd"])
