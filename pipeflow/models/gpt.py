"""GPT-2, cut into pipeline stages.

The blocks are transformers' own GPT-2 blocks (``GPT2Block``), their attention computed
by :mod:`pipeflow.models.attention` (``model.attention``: fused or eager); what lives
here is the cut: a :class:`GPTStage` holds blocks ``[lo, hi)``, plus the token
and position embeddings when it is the first stage and the final LayerNorm and the LM
head when it is the last.

Two properties let a pipelined run be checked against the same model on one device:

- Parameter names are global: ``wte.weight``, ``wpe.weight``, ``h.<layer>.<...>``,
  ``ln_f.*``, ``lm_head.weight``, whatever the split, so gradients compare by name.
- Initialisation does not depend on the split: every parameter is drawn from its own
  generator seeded by (seed, name), so the stages of any split hold exactly the
  whole model's weights.

The LM head is tied to the token embedding (GPT-2). When one stage holds both, the head
uses ``wte.weight`` itself. Otherwise the last stage keeps a copy, ``lm_head.weight``,
initialised equal to ``wte.weight``; the runtime all-reduces the two copies' gradients
so they stay equal (Megatron-LM's tied embeddings across pipeline stages).
"""

from __future__ import annotations

import inspect
import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from pipeflow.models.attention import IMPLEMENTATION, Pattern, SegmentCache, check_mode
from pipeflow.models.splittable import block_output, family_spec, layer_bounds, seeded_normal_
from pipeflow.models.loss import cross_entropy_sum
from pipeflow.models.recompute import apply_recompute
from pipeflow.models.tensor_parallel import enter, head_input

# the keyword GPT2Block takes its key/value cache by: transformers renamed
# past_key_values to cache (5.17, on the H200 of 2026-12-04, still names it past_key_values;
# hf_causal asks its layers the same way)
_CACHE_KW = "cache" if "cache" in inspect.signature(GPT2Block.forward).parameters else "past_key_values"

INIT_STD = 0.02  # GPT-2's initializer_range


def gpt2_config(model_cfg: Mapping) -> GPT2Config:
    """A transformers ``GPT2Config`` from the ``model`` config group (family gpt)."""
    spec, dropout = family_spec(model_cfg, "gpt", "GPT-2")
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


class GPTStage(nn.Module):
    """Layers [lo, hi) of a GPT-2; the token+position embedding when first, final LayerNorm + LM head when last."""

    def __init__(self, config: GPT2Config, lo: int, hi: int, first: bool, last: bool, seed: int,
                 attention: str = "sdpa", vocab: int | None = None):
        super().__init__()
        self.attention = check_mode(attention)
        # the words the loss scores; config.vocab_size may be padded past them (model.vocab_multiple)
        self.vocab = config.vocab_size if vocab is None else vocab
        if not 0 <= lo < hi <= config.n_layer:
            raise ValueError(
                f"stage layers [{lo}, {hi}): need 0 <= lo < hi <= model.n_layer={config.n_layer}"
            )
        self.config = config
        self.lo, self.hi, self.first, self.last = lo, hi, first, last
        if first:
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.n_positions, config.n_embd)
            self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleDict({str(i): GPT2Block(config, layer_idx=i) for i in range(lo, hi)})
        if last:
            self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
            if not first:
                self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """GPT-2's initialisation, one generator per parameter name so any split draws the same values."""
        projection_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, param in self.named_parameters():
            if name == "lm_head.weight":
                # the tied copy starts equal to the embedding it mirrors
                seeded_normal_(param, INIT_STD, seed, "wte.weight", rows=self.vocab)
            elif name == "wte.weight":
                seeded_normal_(param, INIT_STD, seed, name, rows=self.vocab)  # (padding rows: zero)
            elif name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                nn.init.ones_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
                # GPT-2: projections into the stream scaled by 1/sqrt(2 * n_layer)
                seeded_normal_(param, projection_std, seed, name)
            else:
                seeded_normal_(param, INIT_STD, seed, name)

    def tied_parameters(self) -> list[nn.Parameter]:
        """This stage's copies of the tied embedding, whose gradients the runtime sums across stages."""
        tied = []
        if self.first:
            tied.append(self.wte.weight)
        if self.last and not self.first:
            tied.append(self.lm_head.weight)
        return tied

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            T = x.size(1)
            if T > self.config.n_positions:
                raise ValueError(
                    f"sequence of {T} tokens is longer than model.n_positions={self.config.n_positions}; "
                    f"use seq_len <= {self.config.n_positions}"
                )
            pos = torch.arange(T, device=x.device)
            x = enter(self, self.drop(self.wte(x) + self.wpe(pos)))
        pattern = Pattern(self.attention, causal=True)
        for block in self.h.values():
            x = block_output(block(x, attention_mask=pattern))
        return self._head(x) if self.last else x

    def _head(self, x: Tensor) -> Tensor:
        x = head_input(self, self.ln_f(x))  # (tensor parallel: every token, before the head's slice)
        return F.linear(x, self.wte.weight if self.first else self.lm_head.weight)

    def forward_segment(
        self, x: Tensor, offset: int, prefix: Sequence[tuple[Tensor, Tensor]] | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One sequence segment (Seq1F1B): positions ``offset .. offset + T - 1``.

        ``prefix[i]`` holds the keys and values ([B, heads, P, head_dim]) that block i
        computed for the earlier segments of the same microbatch (P = ``offset``), or
        None for the first segment; this segment's queries attend over the prefix and
        its own tokens, causally (the blocks see them through their key/value cache).
        Returns the output and, per block, this segment's own (keys, values), which
        later segments take as their prefix.
        """
        T = x.size(1)
        if self.first:
            if offset + T > self.config.n_positions:
                raise ValueError(
                    f"sequence of {offset + T} tokens is longer than model.n_positions={self.config.n_positions}; "
                    f"use seq_len <= {self.config.n_positions}"
                )
            pos = torch.arange(offset, offset + T, device=x.device)
            x = enter(self, self.drop(self.wte(x) + self.wpe(pos)))
        pattern = Pattern(self.attention, causal=True, offset=offset)
        kvs: list[tuple[Tensor, Tensor]] = []
        for i, block in enumerate(self.h.values()):
            cache = SegmentCache(prefix[i] if prefix else None)
            x = block_output(block(x, **{_CACHE_KW: cache}, attention_mask=pattern))
            kvs.append(cache.own)
        return (self._head(x) if self.last else x), kvs


def build_stage(model_cfg: Mapping, layers_per_stage: Sequence[int], stage: int, seed: int) -> GPTStage:
    """Stage ``stage`` of the split ``layers_per_stage`` (see pipeflow.planning.partitioners)."""
    config = gpt2_config(model_cfg)
    lo, hi = layer_bounds(config.n_layer, layers_per_stage, stage)
    module = GPTStage(config, lo, hi, first=stage == 0, last=stage == len(layers_per_stage) - 1, seed=seed,
                      attention=model_cfg.get("attention") or "sdpa", vocab=model_cfg.get("vocab_size"))
    return apply_recompute(module, model_cfg.get("recompute") or "none", (GPT2Block,))


def build_model(model_cfg: Mapping, seed: int) -> GPTStage:
    """The whole model as one stage: the pipeline.stages=1 reference."""
    config = gpt2_config(model_cfg)
    return GPTStage(config, 0, config.n_layer, first=True, last=True, seed=seed,
                    attention=model_cfg.get("attention") or "sdpa", vocab=model_cfg.get("vocab_size"))


def lm_loss(logits: Tensor, targets: Tensor, normalizer: float, vocab: int | None = None) -> Tensor:
    """Summed next-token cross-entropy divided by ``normalizer``, over the first ``vocab``
    logits of each token (a padded head's; None: all of them).

    The runtime passes the global batch's token count, so the losses (and gradients)
    of its microbatches and segments add up to the global batch's mean — the scaling a
    pipelined step needs to match one device."""
    return cross_entropy_sum(logits, targets, vocab=vocab) / normalizer  # (chunked: no fp32 copy of the logits)


def hidden_shape(model_cfg: Mapping, microbatch_size: int, seq_len: int) -> tuple[int, int, int]:
    """Shape of the activation one stage sends the next for one microbatch."""
    return (microbatch_size, seq_len, model_cfg["n_embd"])
