"""Cost models: UnitCost's mapping and checks; AnalyticCost's FLOPs against Megatron's
count, segment additivity, per-stage sums, the head on the last stage, memory against
Korthikanti et al. and the zero-bubble paper, and the config front door."""

import pytest
from omegaconf import OmegaConf

from pipeflow.planning import (
    AnalyticCost,
    TransformerSpec,
    UnitCost,
    build_cost_model,
    embedding_params,
    head_forward_flops,
    layer_forward_flops,
    layer_linear_flops,
    layer_params,
    total_params,
)
from pipeflow.planning.transformer import layer_matrix_params
from pipeflow.topology import Device

DEV = Device("test", peak_flops=1e14, memory_bytes=8e10, memory_bandwidth=1e12)
GPT = TransformerSpec("gpt_small", n_layer=8, n_head=4, n_embd=256, vocab_size=1000, seq_len=512)
BERT = TransformerSpec("bert_small", n_layer=8, n_head=4, n_embd=256, vocab_size=1000, seq_len=512, causal=False)


# ------------------------------------------------------------------ UnitCost


def test_unit_cost_maps_kinds():
    c = UnitCost(
        4, forward=1.5, backward=3.0, weight=1.25, step=0.5, activation=10, message=7, residual=0.25, params=99
    )
    assert [c.compute_time(k, 2, 0, DEV) for k in "FBWIS"] == [1.5, 3.0, 1.25, 3.0 - 1.25, 0.5]
    assert c.activation_bytes(0, 0) == 10 and c.weight_residual_bytes(3, 0) == 0.25 * 10
    assert c.message_bytes(0, 1, 0) == 7 and c.param_bytes(1) == 99
    assert c.describe()["backward"] == 3.0


def test_unit_cost_validation_names_keys():
    with pytest.raises(ValueError, match=r"cost.weight=3.*cost.backward=2"):
        UnitCost(2, backward=2, weight=3)
    with pytest.raises(ValueError, match=r"cost.forward=-1"):
        UnitCost(2, forward=-1)
    with pytest.raises(ValueError, match=r"cost.residual=2"):
        UnitCost(2, residual=2)
    with pytest.raises(ValueError, match=r"pipeline.stages=0"):
        UnitCost(0)
    with pytest.raises(ValueError, match=r"kind 'R'"):
        UnitCost(2).compute_time("R", 0, 0, DEV)


# --------------------------------------------------------------- FLOP model


@pytest.mark.parametrize("L,h,H,S", [(1, 12, 768, 1024), (1, 25, 1600, 2048), (1, 32, 4096, 4096), (1, 4, 64, 7)])
def test_non_causal_layer_is_megatron_count_plus_softmax(L, h, H, S):
    spec = TransformerSpec("t", L, h, H, 1000, S, causal=False)
    megatron = 24 * S * H**2 + 4 * S**2 * H
    softmax = 3 * S * S * h  # the "+3" per head and query-key pair
    assert layer_forward_flops(spec, S, S) - softmax == pytest.approx(megatron, rel=1e-12)
    assert layer_linear_flops(spec, S) == pytest.approx(24 * S * H**2, rel=1e-12)


@pytest.mark.parametrize("h,H,S", [(12, 768, 1024), (32, 4096, 2048)])
def test_causal_layer_halves_the_attention_term(h, H, S):
    causal = TransformerSpec("g", 1, h, H, 1000, S)
    full = TransformerSpec("b", 1, h, H, 1000, S, causal=False)
    attn_full = layer_forward_flops(full, S, S) - layer_linear_flops(full, S)
    attn_causal = layer_forward_flops(causal, S, S) - layer_linear_flops(causal, S)
    assert attn_causal == pytest.approx(attn_full / 2, rel=1e-12)


@pytest.mark.parametrize("split", [[512], [256, 256], [300, 112, 100], [1] * 8 + [504]])
def test_segment_flops_add_up_to_the_whole_sequence(split):
    whole = layer_forward_flops(GPT, 512, 512)
    P, total = 0, 0.0
    for x in split:
        P += x
        total += layer_forward_flops(GPT, x, P)
    assert total == pytest.approx(whole, rel=1e-12)


def test_equal_segments_get_more_expensive_along_the_sequence():
    c = AnalyticCost(GPT, 2, segment_lengths=[128] * 4)
    times = [c.compute_time("F", 1, i, DEV) for i in range(4)]
    assert all(a < b for a, b in zip(times, times[1:]))


def test_split_cost_model_adds_up_to_unsplit():
    whole = AnalyticCost(GPT, 4, microbatch_size=2)
    split = AnalyticCost(GPT, 4, microbatch_size=2, segment_lengths=[200, 180, 132])
    for s in range(4):
        for kind in "FBIW":
            parts = sum(split.compute_time(kind, s, i, DEV) for i in range(3))
            assert parts == pytest.approx(whole.compute_time(kind, s, 0, DEV), rel=1e-12)
        # messages are per segment, and add up too
        assert sum(split.message_bytes(s, s + 1, i) for i in range(3)) == whole.message_bytes(s, s + 1, 0)


# -------------------------------------------------------------- AnalyticCost


@pytest.mark.parametrize("layers", [None, [1, 3, 2, 2], [5, 1, 1, 1]])
def test_stage_flops_sum_to_the_model(layers):
    b = 3
    c = AnalyticCost(GPT, 4, microbatch_size=b, layers_per_stage=layers)
    S = GPT.seq_len
    model = b * (GPT.n_layer * layer_forward_flops(GPT, S, S) + head_forward_flops(GPT, S))
    assert sum(c.flops("F", s, 0) for s in range(4)) == pytest.approx(model, rel=1e-12)
    assert sum(c.layers_per_stage) == GPT.n_layer
    # time is FLOPs over achieved FLOP/s
    fast = Device("fast", 4e14, 1e10)
    assert c.compute_time("F", 1, 0, DEV) == pytest.approx(c.flops("F", 1, 0) / (DEV.peak_flops * c.efficiency))
    assert c.compute_time("F", 1, 0, fast) == pytest.approx(c.compute_time("F", 1, 0, DEV) / 4)


def test_backward_split_into_input_and_weight_parts():
    c = AnalyticCost(GPT, 4, microbatch_size=2, segment_lengths=[300, 212])
    for s in range(4):
        for seg in range(2):
            f, b, i, w = (c.compute_time(k, s, seg, DEV) for k in "FBIW")
            assert b == pytest.approx(2 * f)
            assert i + w == pytest.approx(b)
            assert 0 < w < b and i > 0
    x, b = 300, 2
    assert c.flops("W", 1, 0) == pytest.approx(b * c.layers_per_stage[1] * layer_linear_flops(GPT, x))


def test_last_stage_is_heavier_by_the_head():
    c = AnalyticCost(GPT, 4, microbatch_size=2)  # 2 layers per stage
    extra = c.compute_time("F", 3, 0, DEV) - c.compute_time("F", 0, 0, DEV)
    assert extra > 0
    assert extra == pytest.approx(2 * head_forward_flops(GPT, GPT.seq_len) / (DEV.peak_flops * c.efficiency))
    assert c.compute_time("F", 1, 0, DEV) == c.compute_time("F", 2, 0, DEV)


def test_too_many_stages_is_a_clear_error():
    tiny = TransformerSpec("gpt_tiny", 4, 2, 64, 100, 32)
    with pytest.raises(ValueError, match=r"pipeline.stages=64: model 'gpt_tiny' has 4 layers, so at most 4 stages"):
        AnalyticCost(tiny, 64)
    AnalyticCost(tiny, 4)  # the limit itself is fine


def test_bad_partition_and_segments_name_the_key():
    with pytest.raises(ValueError, match=r"cost.layers_per_stage=\[4, 3\].*model.n_layer=8"):
        AnalyticCost(GPT, 2, layers_per_stage=[4, 3])
    with pytest.raises(ValueError, match=r"cost.layers_per_stage"):
        AnalyticCost(GPT, 2, layers_per_stage=[8, 0])
    with pytest.raises(ValueError, match=r"cost.segment_lengths=\[100, 100\].*model.seq_len=512"):
        AnalyticCost(GPT, 2, segment_lengths=[100, 100])
    with pytest.raises(ValueError, match=r"not causal"):
        AnalyticCost(BERT, 2, segment_lengths=[256, 256])
    with pytest.raises(ValueError, match=r"cost.efficiency=1.5"):
        AnalyticCost(GPT, 2, efficiency=1.5)
    with pytest.raises(ValueError, match=r"segment 1 out of range"):
        AnalyticCost(GPT, 2).activation_bytes(0, 1)


def test_activation_memory_matches_korthikanti_and_zero_bubble():
    """Eager attention with dropout is Korthikanti et al.'s count (34sbh + 5as^2b at 16
    bits) with the norms' inputs and statistics in fp32, as the runtime keeps them (2sbh
    more per norm and 8 bytes a token); the fused kernel keeps no score, its output
    (sbh) and a fp32 log-sum-exp per query and head instead, and no dropout keeps no mask."""
    import dataclasses

    b, S, H, h = 2, GPT.seq_len, GPT.n_embd, GPT.n_head
    korthikanti = AnalyticCost(dataclasses.replace(GPT, attention="eager", dropout_masks=True), 4, microbatch_size=b)
    per_layer = 34 * S * b * H + 5 * h * S * S * b + (2 * 2 * H + 2 * 8) * S * b
    assert korthikanti.activation_bytes(1, 0) == pytest.approx(2 * per_layer)  # middle stages: 2 plain layers
    fused = AnalyticCost(GPT, 4, microbatch_size=b)  # sdpa, no dropout: the defaults
    # per token: two fp32 norms 2(4H + 8); the QKV input, Q, K, V and the kernel's output
    # 5H at 2 bytes and the log-sum-exp 4h; the MLP's input and its two 4H tensors 9H at 2 bytes
    assert fused.activation_bytes(1, 0) == pytest.approx(2 * (8 * H + 16 + 10 * H + 4 * h + 18 * H) * S * b)
    c = fused
    assert c.weight_residual_bytes(1, 0) == pytest.approx(2 * 32 * b * S * H)  # zero-bubble paper's W memory
    assert c.activation_bytes(3, 0) > c.activation_bytes(1, 0)  # logits on the last stage
    assert c.message_bytes(1, 2, 0) == b * S * H * 2
    for s in range(1, 4):
        assert 0 < c.weight_residual_bytes(s, 0) < c.activation_bytes(s, 0)
    # the first stage's input needs no gradient: its I is empty, its W the whole backward
    # (measured: tests/test_memory.py), so it keeps everything until W
    assert c.weight_residual_bytes(0, 0) == c.activation_bytes(0, 0)


def test_recomputation_trades_backward_flops_for_activation_memory():
    """model.recompute, priced: full keeps each layer's input (4sbh bytes: the residual
    stream is fp32) and its backward reruns the layers' forward; selective drops what the
    attention sub-layer keeps (its input's cast, Q, K, V, the kernel's output and
    log-sum-exp: 10sbh + 4sba at 16 bits) for its fp32 input (4sbh), and reruns its
    projections and scores."""
    import dataclasses

    b, S, H, h = 2, GPT.seq_len, GPT.n_embd, GPT.n_head
    plain, full, sel = (AnalyticCost(dataclasses.replace(GPT, recompute=r), 4, microbatch_size=b)
                        for r in ("none", "full", "selective"))
    assert full.activation_bytes(1, 0) == pytest.approx(2 * 4 * S * b * H)  # 2 layers, input only
    assert sel.activation_bytes(1, 0) == pytest.approx(plain.activation_bytes(1, 0) - 2 * (6 * H + 4 * h) * S * b)
    assert full.activation_bytes(1, 0) < sel.activation_bytes(1, 0) < plain.activation_bytes(1, 0)
    f = plain.flops("F", 1, 0)
    assert full.flops("F", 1, 0) == sel.flops("F", 1, 0) == f  # the forward is the forward
    assert full.flops("B", 1, 0) == pytest.approx(3 * f)  # B = 2F + the recomputed F
    assert plain.flops("B", 1, 0) < sel.flops("B", 1, 0) < full.flops("B", 1, 0)
    # the recomputation happens in I (the first to need the region's tensors), not in W
    assert full.flops("W", 1, 0) == plain.flops("W", 1, 0)
    assert full.flops("I", 1, 0) + full.flops("W", 1, 0) == pytest.approx(full.flops("B", 1, 0))
    # the head is not recomputed: the last stage adds the same head forward to each
    assert full.flops("B", 3, 0) - plain.flops("B", 3, 0) == pytest.approx(full.flops("F", 1, 0))
    # while a backward runs it holds the one layer (full) or attention sub-layer
    # (selective) it rebuilt: a layer's worth of what 'none' saves, or of what the sub-layer
    # keeps, and at 16 bits the casts of the weights it reran (the rerun casts them anew)
    assert plain.rebuilt_layer_bytes(1, 0) == 0
    # (the rerun reads the layer's kept input: the first norm's input is not rebuilt)
    assert full.rebuilt_layer_bytes(1, 0) == pytest.approx(plain.activation_bytes(1, 0) / 2 - 4 * S * b * H
                                                       + 2 * layer_matrix_params(GPT))
    assert sel.rebuilt_layer_bytes(1, 0) == pytest.approx((10 * H + 4 * h) * S * b + 2 * 4 * H * H)
    # ... and keeps no shared cast of them
    assert plain.state_bytes(1)["casts"] - full.state_bytes(1)["casts"] == 2 * 2 * layer_matrix_params(GPT)
    with pytest.raises(ValueError, match="model.recompute=some"):
        dataclasses.replace(GPT, recompute="some")
    with pytest.raises(ValueError, match="model.attention=flash"):
        dataclasses.replace(GPT, attention="flash")


def test_the_simulated_peak_holds_the_recomputed_layer_during_a_backward():
    """GPipe keeps every microbatch's saved activations until the first backward, which
    rebuilds one layer on top of them: peak = m x saved + one layer (full recomputation)."""
    import dataclasses

    from pipeflow.schedules.registry import build_schedule
    from pipeflow.sim.engine import simulate
    from pipeflow.topology.presets import get_topology

    m = 4
    sched, topo = build_schedule("gpipe", 4, m), get_topology("local_cpu", 4)
    for r in ("none", "full", "selective"):
        cost = AnalyticCost(dataclasses.replace(GPT, recompute=r), 4)
        peak = simulate(sched, cost, topo).per_device[1].peak_activation_bytes
        assert peak == pytest.approx(m * cost.activation_bytes(1, 0) + cost.rebuilt_layer_bytes(1, 0)), r


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_segments_keep_the_prefix_keys_and_their_own(attention):
    """Cutting a sequence into segments on a middle stage (2 layers, b = 1): the scores
    cover each segment's prefix only (x*P pairs instead of S*S, eager), the later
    segment's attention keeps the keys and values of its whole prefix, and every segment
    holds its own keys and values for the later ones; the gradient the later segment's
    backward sends to the earlier one's keys and values is held apart (kv_gradient_bytes)."""
    import dataclasses

    spec = dataclasses.replace(GPT, attention=attention)
    whole = AnalyticCost(spec, 4)
    split = AnalyticCost(spec, 4, segment_lengths=[256, 256])
    H, h, L, c = spec.n_embd, spec.n_head, 2, 2
    diff = sum(split.activation_bytes(1, i) for i in range(2)) - whole.activation_bytes(1, 0)
    if attention == "sdpa":
        # segment 1: its keys over the 512-token prefix (256 more than its own) and its own
        # keys and values held apart from that concatenation
        assert diff == pytest.approx(L * (2 * H * c * 256 + 2 * H * c * 256))
    else:
        # eager: the same, less the score pairs the split saves (as many K/V heads as
        # query heads: nothing is repeated, the first segment's own are what it keeps)
        pairs_saved = 512 * 512 - (256 * 256 + 256 * 512)
        assert diff == pytest.approx(L * (2 * H * c * 256 + 2 * H * c * 256 - h * c * pairs_saved))
    assert whole.kv_gradient_bytes(1, 0) == 0
    assert [split.kv_gradient_bytes(1, i) for i in range(2)] == [L * 2 * 256 * H * c] * 2


def test_params_per_stage_cover_the_model_once_plus_the_tied_head_copy():
    c1 = AnalyticCost(GPT, 1)
    c4 = AnalyticCost(GPT, 4)
    assert c1.stage_params(0) == total_params(GPT)
    assert sum(c4.stage_params(s) for s in range(4)) == total_params(GPT) + GPT.vocab_size * GPT.n_embd
    assert c4.stage_params(0) - c4.stage_params(1) == embedding_params(GPT)
    assert c4.param_bytes(2) == c4.stage_params(2) * 2
    assert c4.stage_params(1) == 2 * layer_params(GPT)


def test_gpt2_small_has_its_published_parameter_count():
    gpt2 = TransformerSpec("gpt2", n_layer=12, n_head=12, n_embd=768, vocab_size=50257, seq_len=1024)
    assert total_params(gpt2) == 124_439_808  # HuggingFace gpt2


def test_step_time_is_memory_bound_and_scales_with_params():
    c = AnalyticCost(GPT, 4)
    t0, t1 = c.compute_time("S", 0, 0, DEV), c.compute_time("S", 1, 0, DEV)
    assert t0 / t1 == pytest.approx(c.stage_params(0) / c.stage_params(1))
    assert c.compute_time("S", 0, 0, Device("x", 1e14, 1e10)) == 0  # unknown bandwidth
    # the runtime's state: fp32 weights, gradients and AdamW moments (16 B/param), and at
    # 16 bits one 16-bit cast of the layers' matrices (and the head's, on the last stage)
    p, layers = c.stage_params(1), c.layers_per_stage[1]
    state = c.state_bytes(1)
    assert (state["parameters"], state["gradients"], state["optimizer_state"]) == (4 * p, 4 * p, 8 * p)
    assert state["casts"] == 2 * layers * layer_matrix_params(GPT) and c.model_state_bytes(1) == 16 * p + state["casts"]
    last = c.state_bytes(3)["casts"]
    assert last == 2 * (c.layers_per_stage[3] * layer_matrix_params(GPT) + GPT.vocab_size * GPT.n_embd)
    assert AnalyticCost(GPT, 4, dtype_bytes=4).model_state_bytes(1) == 16 * p  # fp32: no casts


def test_a_parameter_costs_one_state_and_one_step_wherever_it_is_priced():
    """pipeflow.planning.model_state: 16 B of fp32 weight, gradient and moments and, at 16
    bits, a 2 B cast (Megatron's 18 B/param of mixed-precision Adam); AdamW's step reads
    and writes weight and moments, reads the gradient (28 B) and writes the 16-bit copy.
    The analytic cost and the planner's closed form price a stage by them."""
    from pipeflow.planning.model_state import cast_bytes, parameter_state, step_bytes, step_time
    from pipeflow.planning.placement_plan import StageModel

    assert parameter_state(10) == {"parameters": 40, "gradients": 40, "optimizer_state": 80}
    assert sum(parameter_state(10).values()) + cast_bytes(10, 2) == 180 and cast_bytes(10, 4) == 0.0
    assert (step_bytes(10, 2), step_bytes(10, 4)) == (300, 280)
    assert step_time(10, 2, 0.0) == 0.0 and step_time(10, 2, 150.0) == 2.0
    c, model = AnalyticCost(GPT, 4, layers_per_stage=[1, 3, 3, 1]), StageModel(GPT)
    for s, n in enumerate(c.layers_per_stage):
        p, ends = c.stage_params(s), (s == 0, s == 3)
        assert model.params(n, *ends) == p
        step = step_bytes(p, 2) / DEV.memory_bandwidth
        assert c.compute_time("S", s, 0, DEV) == model.step_time(n, *ends, DEV) == step


# ------------------------------------------------------------------- config


def test_spec_from_config():
    base = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 50, "seq_len": 32}
    cfg = OmegaConf.create(
        {**base, "name": "bert_tiny", "family": "bert", "n_positions": 64, "dropout": 0.1, "n_inner": None}
    )
    spec = TransformerSpec.from_config(cfg)
    assert spec.causal is False and spec.ffn_width == 128 and spec.positions == 64 and spec.name == "bert_tiny"
    assert TransformerSpec.from_config(base).causal is True
    no_seq = {k: v for k, v in base.items() if k != "seq_len"}
    assert TransformerSpec.from_config({**no_seq, "n_positions": 16}).seq_len == 16
    with pytest.raises(ValueError, match=r"model.n_embd is missing"):
        TransformerSpec.from_config({k: v for k, v in base.items() if k != "n_embd"})
    with pytest.raises(ValueError, match=r"model.n_embd=30: must be a multiple of model.n_head=4"):
        TransformerSpec.from_config({**base, "n_head": 4, "n_embd": 30})
    with pytest.raises(ValueError, match=r"model.family=t5.*allowed values: gpt, bert"):
        TransformerSpec.from_config({**base, "family": "t5"})
    with pytest.raises(ValueError, match=r"model.seq_len=128: longer than model.n_positions=64"):
        TransformerSpec.from_config({**base, "seq_len": 128, "n_positions": 64})
    with pytest.raises(ValueError, match=r"model.n_layer=0"):
        TransformerSpec.from_config({**base, "n_layer": 0})


def test_build_cost_model():
    unit = build_cost_model({"name": "unit", "backward": 3.0, "weight": None}, 4, None, 1)
    assert isinstance(unit, UnitCost) and unit.compute_time("I", 0, 0, DEV) == 3.0 - 1.0
    cfg = OmegaConf.create({"name": "analytic", "efficiency": 0.4, "layers_per_stage": [3, 1, 1, 3]})
    an = build_cost_model(cfg, 4, GPT, 2)
    assert isinstance(an, AnalyticCost) and an.layers_per_stage == (3, 1, 1, 3) and an.microbatch_size == 2
    with pytest.raises(ValueError, match=r"cost.name=foo: unknown cost model; allowed values: unit, analytic"):
        build_cost_model({"name": "foo"}, 4, GPT, 1)
    with pytest.raises(ValueError, match=r"cost.efficiency: unknown key for cost model 'unit'.*allowed keys: forward"):
        build_cost_model({"name": "unit", "efficiency": 0.5}, 4, GPT, 1)
    with pytest.raises(ValueError, match=r"cost.name=analytic needs the model"):
        build_cost_model({"name": "analytic"}, 4, None, 1)


def test_unit_comm_null_means_links_but_null_elsewhere_keeps_default():
    from pipeflow.planning.cost_models import build_cost_model

    free = build_cost_model({"name": "unit"}, 2, None, 1)
    assert free.message_time == 0.0
    links = build_cost_model({"name": "unit", "comm": None, "forward": None, "message": 8.0}, 2, None, 1)
    assert links.message_time is None and links.forward == 1.0 and links.message == 8.0
    fixed = build_cost_model({"name": "unit", "comm": 0.5}, 2, None, 1)
    assert fixed.message_time == 0.5


def test_a_device_computes_fp32_at_its_own_rate():
    from pipeflow.topology.presets import DEVICES

    a100 = DEVICES["a100-80g"]
    assert a100.flops(2) == 312e12 and a100.flops(4) == 156e12  # TF32 tensor cores: half the bf16 peak
    plain = Device("x", 1e12, 1e9)
    assert plain.flops(4) == plain.flops(2) == 1e12  # no fp32 rate given: the peak
    fp32, bf16 = (AnalyticCost(GPT, 4, dtype_bytes=b) for b in (4, 2))
    assert fp32.compute_time("F", 1, 0, a100) == pytest.approx(2 * bf16.compute_time("F", 1, 0, a100))
