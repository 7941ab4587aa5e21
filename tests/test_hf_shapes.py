"""The analytic cost model and the planner read a Hugging Face decoder's shape exactly:
grouped-query attention, the gated MLP, RMSNorm, optional biases, rotary positions, an
untied head and dropout masks only when there is dropout. Parameter counts are checked
against transformers' own models (built on the meta device, no memory), FLOPs and
activation bytes against hand-computed closed forms, and GPT/BERT against the closed
forms they had before these shapes existed."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from pipeflow.config import compose
from pipeflow.config import resolve_model
from pipeflow.planning.cost import AnalyticCost
from pipeflow.planning.placement_plan import StageModel
from pipeflow.planning.transformer import (
    TransformerSpec,
    attention_score_flops,
    embedding_params,
    head_params,
    layer_forward_flops,
    layer_linear_flops,
    layer_params,
    total_params,
)
from pipeflow.topology import Device
from pipeflow.topology.presets import get_topology

DEV = Device("test", peak_flops=1e14, memory_bytes=8e10, memory_bandwidth=1e12)
PRESETS = ["llama_tiny", "qwen2_tiny", "llama3_8b", "llama3_70b", "qwen2_7b", "mistral_7b"]
# HF configs given as the whole model.hf dict (a Hydra dict override merges into the
# preset's dict, so the test replaces it after composing)
NEOX = {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 256, "max_position_embeddings": 128}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 200, "vocab_size": 256,
        "n_positions": 128}


def _model_cfg(preset: str, hf: dict | None = None, overrides: tuple[str, ...] = ()):
    cfg = compose("simulate", [f"model={preset}", *overrides])
    if hf is not None:
        cfg.model.hf = hf
    resolve_model(cfg)  # fills the shape keys from the HF config, as prepare_simulation does
    return cfg.model


def _spec(preset: str, hf: dict | None = None, overrides: tuple[str, ...] = ()) -> TransformerSpec:
    return TransformerSpec.from_config(_model_cfg(preset, hf, overrides))


def _hf_count(model_cfg) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pipeflow.hf import load_hf_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(load_hf_config(model_cfg))
    return model.num_parameters()


CASES = [(p, None) for p in PRESETS] + [("llama_tiny", NEOX), ("llama_tiny", GPT2)]
IDS = PRESETS + ["gpt_neox", "gpt2"]


# --------------------------------------------------------------- parameters


@pytest.mark.parametrize("preset,hf", CASES, ids=IDS)
def test_total_params_equal_transformers_count(preset, hf):
    model_cfg = _model_cfg(preset, hf, () if hf is None else ("model.seq_len=64",))
    spec = TransformerSpec.from_config(model_cfg)
    assert total_params(spec) == _hf_count(model_cfg)


def test_llama3_8b_has_its_published_size():
    spec = _spec("llama3_8b")
    assert (spec.kv_heads, spec.head_dim, spec.mlp, spec.norm, spec.tied) == (8, 128, "gated", "rmsnorm", False)
    assert round(total_params(spec) / 1e9, 2) == 8.03
    assert total_params(spec) == 8_030_261_248


@pytest.mark.parametrize("preset,hf", CASES, ids=IDS)
@pytest.mark.parametrize("stages", [1, 2])
def test_stage_params_cover_the_model(preset, hf, stages):
    """Untied: the stages hold the model once. Tied: the last stage keeps a copy of the
    embedding matrix when it is not the first stage."""
    spec = _spec(preset, hf, () if hf is None else ("model.seq_len=64",))
    cost = AnalyticCost(spec, stages)
    copy = spec.vocab_size * spec.n_embd if spec.tied and stages > 1 else 0
    assert sum(cost.stage_params(s) for s in range(stages)) == total_params(spec) + copy
    if stages > 1:
        assert cost.stage_params(stages - 1) - cost.stage_params(0) == head_params(spec) - embedding_params(spec)


def test_layer_params_by_hand():
    """llama_tiny: H=128, h=4, kv=2, d=32, I=344; no biases; RMSNorm; rotary; untied.
    qwen2_tiny: biases on Q, K, V; I=320; tied."""
    llama, qwen = _spec("llama_tiny"), _spec("qwen2_tiny")
    assert layer_params(llama) == 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 344 + 2 * 128
    assert embedding_params(llama) == 256 * 128  # no position table
    assert total_params(llama) == 4 * layer_params(llama) + 256 * 128 + 128 + 256 * 128
    assert layer_params(qwen) == (128 * 128 + 2 * 128 * 64 + 128 * 128 + (128 + 2 * 64) + 3 * 128 * 320
                                  + 2 * 128)
    assert total_params(qwen) == 4 * layer_params(qwen) + 256 * 128 + 128  # head shares the embedding


def test_head_dim_and_biases_change_the_count_as_written():
    base = TransformerSpec("t", 2, 4, 64, 100, 16, n_kv_head=2, head_dim_override=24, mlp="gated", norm="rmsnorm",
                           qkv_bias=False, o_bias=False, mlp_bias=False, tied=False, position_embedding="rotary")
    H, q, kv, I = 64, 4 * 24, 2 * 24, 256
    assert layer_params(base) == H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H
    biased = dataclasses.replace(base, qkv_bias=True, o_bias=True, mlp_bias=True, norm="layernorm")
    assert layer_params(biased) - layer_params(base) == (q + 2 * kv) + H + (2 * I + H) + 2 * H
    gelu = dataclasses.replace(biased, mlp="gelu")
    assert layer_params(biased) - layer_params(gelu) == H * I + I


# --------------------------------------------------------------- FLOPs


def test_llama_layer_flops_by_hand():
    spec = _spec("llama_tiny")  # H=128, h=4, kv=2, d=32, I=344
    x, P = 48, 128
    linear = 2 * x * (128 * 128 + 2 * 128 * 64 + 128 * 128) + 2 * x * 3 * 128 * 344
    assert layer_linear_flops(spec, x) == linear
    per_pair = 4 * (4 * 32 + 3)  # per query head, not per key/value head
    assert attention_score_flops(spec, x, P) == x * P * per_pair - x * x * per_pair / 2
    assert layer_forward_flops(spec, x, P) == linear + x * P * per_pair - x * x * per_pair / 2


@pytest.mark.parametrize("preset", ["gpt_small", "gpt_7b", "bert_large"])
def test_gpt_and_bert_presets_keep_their_closed_forms(preset):
    """GPT/BERT read through the generalised formulas: kv = h, d = H/h, two MLP matrices,
    LayerNorm, every bias, tied head, learned positions; with eager attention and
    dropout, Korthikanti et al.'s 34sbh + 5as^2b with fp32 norms (4H + 8 bytes each)."""
    cfg = _model_cfg(preset)
    spec = TransformerSpec.from_config(cfg)
    L, h, H, V, S, Pn = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.seq_len, cfg.n_positions
    multiple = cfg.get("vocab_multiple") or 1  # (the head's products run at the padded rows)
    V = -(-V // multiple) * multiple
    assert (spec.vocab_size, spec.scored_vocab) == (V, cfg.vocab_size)
    Fw = cfg.n_inner or 4 * H
    assert Fw == 4 * H
    d, b = H // h, 2
    c = AnalyticCost(spec, 4, microbatch_size=b)
    n = L // 4
    attn = h * (4 * d + 3) * S * S * (0.5 if spec.causal else 1.0)
    layer = 8 * S * H * h * d + 4 * S * H * Fw + attn
    assert c.flops("F", 1, 0) == pytest.approx(b * n * layer, rel=1e-12)
    assert c.flops("F", 3, 0) == pytest.approx(b * (n * layer + 2 * S * H * V), rel=1e-12)
    assert c.flops("W", 1, 0) == pytest.approx(b * n * 24 * S * H * H, rel=1e-12)
    eager = AnalyticCost(dataclasses.replace(spec, attention="eager", dropout_masks=True), 4, microbatch_size=b)
    korthikanti = 34 * S * b * H + 5 * h * S * S * b + 2 * (2 * H + 8) * S * b
    # Korthikanti et al. count one input for Q, K and V (GPT's fused projection); BERT's
    # three separate projections keep an autocast copy each at 16 bits: 2 more, of 2 bytes
    separate = (2 * 2 * S * b * H) if cfg.family == "bert" else 0
    korthikanti += separate
    # and a post-norm stage after the first keeps its input restored to fp32 (what
    # arrives in 16 bits; a pre-norm block's first norm saves that very tensor)
    arrived = 4 * S * b * H if cfg.family == "bert" else 0
    assert eager.activation_bytes(1, 0) == n * korthikanti + arrived
    ids = 8 * S * b + 8 * S  # token ids, position ids (int64)
    embedding = S * b * H + (S * b * (4 * H + 8) if cfg.family == "bert" else 0)  # its dropout mask, BERT's LayerNorm
    assert eager.activation_bytes(0, 0) == n * korthikanti + ids + embedding
    assert c.weight_residual_bytes(1, 0) == n * (32 * b * S * H + separate)  # W keeps each copy too
    per_layer = 4 * H * H + 2 * H * Fw + 9 * H + Fw
    assert c.stage_params(1) == n * per_layer
    bert = cfg.family == "bert"
    # BERT: two token-type rows and the embedding's LayerNorm; its MLM head's dense
    # transform (H*H + H) and the decoder's bias (V) beside the norm and the decoder
    embed_extra, head_extra = (4 * H, H * H + H + V) if bert else (0, 0)
    assert c.stage_params(0) == n * per_layer + V * H + Pn * H + embed_extra
    assert c.stage_params(3) == n * per_layer + 2 * H + V * H + head_extra
    assert total_params(spec) == L * per_layer + V * H + Pn * H + 2 * H + embed_extra + head_extra


# ------------------------------------------------------- activation bytes


def test_llama_activation_bytes_by_hand():
    """llama_tiny, 4 stages of one layer, b = 2, 16-bit, no dropout, fused attention: per
    token two RMSNorms (fp32 input and normalised input, 2*4H, and a fp32 root, 4 bytes,
    each), the inputs of the Q, K and V projections and of the gate and up projections,
    an autocast copy per product at 16 bits, 5H, Q 128, K, V 2*64, the kernel's output
    128 and log-sum-exp 4h, the gate output, its SiLU, the up projection and their
    product 4*344 elements; the rotary cos and sin once per stage; no score. Eager keeps
    K and V at every query head and the softmax output per pair instead of the output
    and its log-sum-exp."""
    spec = _spec("llama_tiny")
    assert spec.dropout_masks is False and spec.attention == "sdpa"
    b, S, H, V, dt, d = 2, 128, 128, 256, 2, 32
    norms = 2 * (2 * H * 4 + 4)
    per_token = norms + (5 * H + 128 + 2 * 64 + 128 + 4 * 344) * dt + 4 * 4
    rotary = 2 * S * d * 4
    layer = S * b * per_token
    c = AnalyticCost(spec, 4, microbatch_size=b)
    assert c.activation_bytes(1, 0) == layer + rotary
    assert c.activation_bytes(0, 0) == layer + rotary + 8 * S * b  # the token ids; no dropout mask
    # the last: the final norm, the head's input, the loss's 16-bit logits, log-sum-exp and target
    assert c.activation_bytes(3, 0) == layer + rotary + S * b * (2 * H * 4 + 4 + H * dt + V * dt + 4 + 8)
    eager = AnalyticCost(dataclasses.replace(spec, attention="eager"), 4, microbatch_size=b)
    per_token_eager = per_token - 2 * 64 * dt - 4 * 4 + 2 * 128 * dt  # K, V at 4 heads, no log-sum-exp
    assert eager.activation_bytes(1, 0) == S * b * per_token_eager + S * S * b * 4 * dt + rotary
    # zero-bubble residual: matmul inputs (5H + 128 + 344: a copy per product) and output
    # gradients (128 + 128 + H + 2*344 + H)
    assert c.weight_residual_bytes(1, 0) == ((5 * H + 128 + 344) + (128 + 128 + H + 2 * 344 + H)) * S * b * dt
    fp32 = AnalyticCost(spec, 4, microbatch_size=b, dtype_bytes=4)  # one input each, shared by the products
    assert fp32.weight_residual_bytes(1, 0) == ((2 * H + 128 + 344) + (128 + 128 + H + 2 * 344 + H)) * S * b * 4
    assert c.weight_residual_bytes(0, 0) == c.activation_bytes(0, 0)  # the first stage's W is its whole backward
    assert c.message_bytes(1, 2, 0) == b * S * H * dt


def test_llama_recomputation_by_hand():
    spec = _spec("llama_tiny")
    b, S, H, dt = 2, 128, 128, 2
    plain, full, sel = (AnalyticCost(dataclasses.replace(spec, recompute=r), 4, microbatch_size=b)
                        for r in ("none", "full", "selective"))
    rotary = 2 * S * 32 * 4  # cos and sin, saved by the rotation or held by a recomputed region
    layer = plain.activation_bytes(1, 0) - rotary
    # the attention sub-layer: its input's casts (one per Q, K, V projection), Q, K, V, the
    # kernel's output and log-sum-exp
    dropped = S * b * ((3 * H + 128 + 2 * 64 + 128) * dt + 4 * 4)
    assert full.activation_bytes(1, 0) == S * b * H * 4 + rotary  # the layer's fp32 input
    # the rebuilt layer (or sub-layer) holds the 16-bit casts its rerun makes of its weights
    matrices = 128 * 128 + 2 * 128 * 64 + 128 * 128  # Q, K, V, O (2 key/value heads of 32)
    # (less the layer's input, which the rerun reads where the first norm saved it)
    assert full.rebuilt_layer_bytes(1, 0) == layer - S * b * H * 4 + dt * (matrices + 3 * 128 * 344)
    assert sel.activation_bytes(1, 0) == layer - dropped + S * b * H * 4 + rotary  # and the sub-layer's fp32 input
    assert sel.rebuilt_layer_bytes(1, 0) == dropped + dt * matrices
    attention = 2 * S * (128 * 128 + 2 * 128 * 64 + 128 * 128) + 4 * (4 * 32 + 3) * S * S / 2
    assert sel.flops("B", 1, 0) == pytest.approx(2 * plain.flops("F", 1, 0) + b * attention, rel=1e-12)
    assert full.flops("B", 1, 0) == pytest.approx(3 * plain.flops("F", 1, 0), rel=1e-12)


def test_segments_keep_the_keys_of_the_kv_heads():
    """Segments hold keys and values, and their gradients, of the key/value heads (2 x 32
    wide), not H: the later segment's prefix (64 keys more than its own) and its own. At
    16 bits the rotated keys a segment hands on are fp32 (the rotation's output: its cos
    and sin are the fp32 stream's dtype), so the first segment holds them too, beside the
    16-bit cast the fused kernel keeps."""
    spec = _spec("llama_tiny")
    whole, split = AnalyticCost(spec, 4), AnalyticCost(spec, 4, segment_lengths=[64, 64])
    dt, kv = 2, 2 * 32
    diff = sum(split.activation_bytes(1, i) for i in range(2)) - whole.activation_bytes(1, 0)
    # (the rotary tables split with the tokens: two of 64 rows cost one of 128)
    assert diff == 2 * kv * dt * 64 + 64 * kv * 4 + 64 * kv * (4 + dt)
    assert [split.kv_gradient_bytes(1, i) for i in range(2)] == [64 * kv * (4 + dt)] * 2


def test_dropout_keeps_its_masks():
    quiet = _spec("llama_tiny")
    noisy = _spec("llama_tiny", overrides=("+model.hf.attention_dropout=0.1",))
    assert (quiet.dropout_masks, noisy.dropout_masks) == (False, True)
    b, S, H, h, dt = 1, 128, 128, 4, 2
    a0, a1 = AnalyticCost(quiet, 4), AnalyticCost(noisy, 4)
    per_layer = S * b * 2 * H  # residual-dropout masks (the fused kernel keeps none of its own)
    assert a1.activation_bytes(1, 0) - a0.activation_bytes(1, 0) == per_layer
    assert a1.activation_bytes(0, 0) - a0.activation_bytes(0, 0) == per_layer + S * b * H
    e0, e1 = (AnalyticCost(dataclasses.replace(s, attention="eager"), 4) for s in (quiet, noisy))
    # eager: also the scores' dropout mask and output, per query head and pair
    assert e1.activation_bytes(1, 0) - e0.activation_bytes(1, 0) == per_layer + h * S * S * b * (dt + 1)
    assert a1.flops("F", 1, 0) == a0.flops("F", 1, 0)


# ------------------------------------------------------------- the spec


def test_spec_reads_the_shape_keys():
    cfg = _model_cfg("qwen2_tiny")
    spec = TransformerSpec.from_config(cfg)
    assert (spec.n_kv_head, spec.head_dim, spec.mlp, spec.norm) == (2, 32, "gated", "rmsnorm")
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.tied, spec.position_embedding) == (
        True, False, False, True, "rotary")
    gpt = TransformerSpec.from_config(_model_cfg("gpt_small"))
    # GPT-2's Conv1D stores its weights [in, out] (the others' nn.Linear: [out, in])
    # (its embedding and head padded to a multiple of 64 rows: model.vocab_multiple; the loss scores 50,257)
    assert gpt == TransformerSpec("gpt_small", 12, 12, 768, 50304, 1024, n_positions=1024, weights_in_out=True,
                                  loss_vocab=50257)
    assert spec.weights_in_out is False
    assert (gpt.kv_heads, gpt.head_dim, gpt.mlp, gpt.tied, gpt.dropout_masks) == (12, 64, "gelu", True, False)
    assert gpt.attention == "sdpa"
    assert TransformerSpec.from_config({**_model_cfg("gpt_small"), "dropout": 0.1}).dropout_masks is True
    assert TransformerSpec.from_config({**_model_cfg("gpt_small"), "attention": "eager"}).attention == "eager"


def test_spec_validation_names_the_key():
    base = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 50, "seq_len": 32}
    with pytest.raises(ValueError, match=r"model.mlp=foo: allowed values: gelu, gated"):
        TransformerSpec.from_config({**base, "mlp": "foo"})
    with pytest.raises(ValueError, match=r"model.norm=batchnorm: allowed values: layernorm, rmsnorm"):
        TransformerSpec.from_config({**base, "norm": "batchnorm"})
    with pytest.raises(ValueError, match=r"model.positions=alibi: allowed values: learned, rotary"):
        TransformerSpec.from_config({**base, "positions": "alibi"})
    with pytest.raises(ValueError, match=r"model.tied='yes': allowed values: true, false"):
        TransformerSpec.from_config({**base, "tied": "yes"})
    with pytest.raises(ValueError, match=r"model.n_kv_head=3: must divide model.n_head=4"):
        TransformerSpec.from_config({**base, "n_kv_head": 3})
    with pytest.raises(ValueError, match=r"model.head_dim=0"):
        TransformerSpec.from_config({**base, "head_dim": 0})
    # an explicit head_dim lifts the n_embd % n_head rule
    with pytest.raises(ValueError, match=r"model.n_embd=62: must be a multiple of model.n_head=4"):
        TransformerSpec.from_config({**base, "n_embd": 62})
    spec = TransformerSpec.from_config(OmegaConf.create({**base, "n_embd": 62, "head_dim": 16, "n_kv_head": None}))
    assert spec.head_dim == 16 and spec.kv_heads == 4


# ------------------------------------------------------------- the planner


@pytest.mark.parametrize("preset", ["llama_tiny", "qwen2_tiny"])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_stage_model_matches_analytic_cost(preset, recompute):
    """The planner's closed form prices a stage as the cost model does: untied or tied head,
    no dropout masks, and recomputation's extra FLOPs and rebuilt layer."""
    spec = dataclasses.replace(_spec(preset), recompute=recompute)
    for layers in ([4], [2, 1, 1]):
        p = len(layers)
        cost = AnalyticCost(spec, p, microbatch_size=2, layers_per_stage=layers)
        model = StageModel(spec, microbatch_size=2)
        for s, n in enumerate(layers):
            first, last = s == 0, s == p - 1
            fb = cost.compute_time("F", s, 0, DEV) + cost.compute_time("B", s, 0, DEV)
            assert model.fb_time(n, last, DEV) == pytest.approx(fb, rel=1e-12)
            assert model.params(n, first, last) == cost.stage_params(s)
            assert model.memory(n, first, last, 3) == pytest.approx(
                3 * cost.activation_bytes(s, 0) + cost.rebuilt_layer_bytes(s, 0) + cost.model_state_bytes(s), rel=1e-12)


def test_planner_plans_a_llama():
    from pipeflow.planning.planner import plan

    spec = _spec("llama_tiny")
    best = plan(spec, get_topology("pcie_8", 4), 8, replicas=1)
    assert sum(best.layers_per_stage) == spec.n_layer
    assert best.predicted_iteration_time > 0


@pytest.mark.parametrize("model", ["gpt_tiny", "bert_tiny", "llama_tiny"])
def test_the_cost_counts_each_stages_parameters(model):
    """Per stage, the cost's parameters are the built stage's, to the parameter (BERT's
    token types, embedding norm and MLM head included): the weights, gradients and
    optimizer state the simulator's memory holds."""
    import torch

    from pipeflow.families import family_of

    c = compose("train", [f"model={model}"])
    resolve_model(c)
    cfg = OmegaConf.to_container(c.model, resolve=True)
    layers = [cfg["n_layer"] // 2, cfg["n_layer"] - cfg["n_layer"] // 2]
    adapter = family_of(cfg).load_adapter()(cfg, layers, 2, cfg["seq_len"], 0, torch.device("cpu"))
    cost = AnalyticCost(TransformerSpec.from_config(c.model), 2, layers_per_stage=layers)
    for s in range(2):
        assert cost.stage_params(s) == sum(p.numel() for p in adapter.build_stage(s).parameters()), s
