"""The ``model`` group: GPT/BERT shapes, Hugging Face decoders (read from their config before
any check), recomputation and attention."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import MISSING, DictConfig

from pipeflow.planning.transformer import TransformerSpec, total_params

from ..values import ConfigError
from .runtime import rank_memory

RECOMPUTE = ("none", "full", "selective")  # model.recompute (pipeflow.models.recompute.MODES, torch-free here)

ATTENTION = ("sdpa", "eager")  # model.attention (pipeflow.models.attention.MODES, torch-free here)

@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = "gpt"  # one of pipeflow.families.FAMILIES: gpt, bert (hf_causal: HFModelConfig; cbm: cbm_shape)
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    n_inner: Optional[int] = None  # FFN width; None means 4 * n_embd
    vocab_size: int = MISSING
    # the embedding's and the head's rows padded to a multiple of this for their products
    # (GPT-2's 50,257 -> 50,304 at 64); the padded logits never reach the loss; 1: unpadded
    vocab_multiple: int = 1
    n_positions: int = MISSING
    seq_len: int = MISSING
    dropout: float = 0.0  # read by pipeflow.models; the cost model counts dropout masks when > 0
    recompute: str = "none"  # activation recomputation: none | full | selective (pipeflow.models.recompute)
    attention: str = "sdpa"  # sdpa (the fused kernel) | eager (scores kept): pipeflow.models.attention

@dataclass
class HFModelConfig:
    """model.family=hf_causal: a Hugging Face decoder from its config (pipeflow.hf)."""

    name: str = MISSING
    family: str = "hf_causal"
    config: Optional[str] = None  # a config.json, or a local model folder holding one (never a hub id)
    hf: Dict[str, Any] = field(default_factory=dict)  # transformers config fields, over the file's (model_type, ...)
    weights: Optional[str] = None  # a local folder of *.safetensors to start from; null: seeded initialisation
    seq_len: int = MISSING  # tokens per training sequence
    recompute: str = "none"  # activation recomputation: none | full | selective (pipeflow.models.recompute)
    attention: str = "sdpa"  # sdpa (the fused kernel) | eager (scores kept): pipeflow.models.attention
    # read from the HF config before any rank starts (pipeflow.hf.resolve); leave them unset
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    n_inner: Optional[int] = None
    vocab_size: Optional[int] = None
    n_positions: Optional[int] = None
    n_kv_head: Optional[int] = None  # grouped-query attention: key/value heads
    head_dim: Optional[int] = None
    mlp: Optional[str] = None  # gated (gate, up, down: SwiGLU) | gelu (two matrices)
    norm: Optional[str] = None  # rmsnorm | layernorm
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    mlp_bias: Optional[bool] = None
    tied: Optional[bool] = None  # the LM head shares the token embedding
    positions: Optional[str] = None  # rotary | learned
    dropout: Optional[float] = None  # the HF config's largest dropout probability

def resolve_model(cfg: DictConfig) -> None:
    """model.family=hf_causal: read the Hugging Face config (model.config, model.hf) and
    fill the model group's shape keys from it (pipeflow.hf), so every later check, the
    cost model and the planner read a Llama as they read a GPT. Other families: nothing."""
    if cfg.get("model") is None or cfg.model.get("family") != "hf_causal":
        return
    from pipeflow.hf import resolve

    try:
        keys = resolve(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for key, value in keys.items():
        cfg.model[key] = value

def check_recompute(model: DictConfig) -> None:
    """model.recompute and model.attention: how a layer keeps what its backward needs."""
    mode = model.get("recompute") or "none"
    if mode not in RECOMPUTE:
        raise ConfigError(f"model.recompute={mode}: unknown recomputation; allowed values: {', '.join(RECOMPUTE)}")
    attention = model.get("attention") or "sdpa"
    if attention not in ATTENTION:
        raise ConfigError(f"model.attention={attention}: allowed values: {', '.join(ATTENTION)} (sdpa: the fused "
                          f"scaled-dot-product kernel; eager: scores computed and kept)")


STATE_BYTES = 16  # a parameter's fp32 weight, gradient and AdamW's two moments (fp32 at every precision)
TABLE_BYTES = 8  # a vocabulary table's fp32 weights and gradient: whole on its rank for its product, sharded or not


def check_vocab_memory(cfg: DictConfig, spec: TransformerSpec | None, tensor: int = 1) -> None:
    """model.vocab_multiple, where its padding takes the model past the ranks' memory
    (:func:`.runtime.rank_memory`): CPU ranks sharing the host must hold the whole model state,
    elsewhere the token table's rank its weights and gradient (split by ``tensor``). A lower
    bound: a value passed may still not fit."""
    multiple = cfg.model.get("vocab_multiple")
    if spec is None or spec.loss_vocab is None or not multiple:
        return
    memory = rank_memory(cfg.runtime)
    if memory is None:
        return
    size, where, shared = memory
    plain = dataclasses.replace(spec, vocab_size=spec.loss_vocab, loss_vocab=None)
    if shared:
        need, unpadded = (total_params(s) * STATE_BYTES for s in (spec, plain))
        what = f"the model's state ({STATE_BYTES} bytes a parameter: fp32 weights, gradients, AdamW's two moments)"
    else:
        need, unpadded = (s.vocab_size * s.n_embd * TABLE_BYTES / tensor for s in (spec, plain))
        what = "the token table's fp32 weights and gradient on the rank that holds it"
    if need > size and (unpadded <= size or need - unpadded > size):
        raise ConfigError(f"model.vocab_multiple={multiple}: pads the {spec.loss_vocab:,} words to "
                          f"{spec.vocab_size:,} rows, and {what} then needs at least {_bytes(need)}, more than "
                          f"{where} ({_bytes(size)}); use a multiple near the kernels' tile, e.g. 64 (GPT-2's 50,257 "
                          f"words: 50,304 rows), or 1: unpadded")


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.3g} {unit}" if n < 1000 * size or unit != "TiB" else f"{n / size:,.0f} TiB"
    return f"{n:,.0f} B"
