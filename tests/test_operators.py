"""A stage's work as operators (pipeflow.planning.operators) and a device profile that
prices them as measured (pipeflow.planning.device_profile): the operators' FLOPs are the
analytic cost's, a measured row is priced as measured, the host's launches cost a stream
of small kernels, and the shipped H200 profile predicts the measured GPT-2 medium step."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pipeflow.config import ConfigError, compose, prepare_simulation
from pipeflow.planning.device_profile import ProfileError
from pipeflow.planning.from_sweep import from_sweep, load_profile
from pipeflow.planning.layer_operators import block_forward, block_tensors, has_weight
from pipeflow.planning.operators import POINTWISE_KINDS, Attention, Pointwise, PointwiseKind, Product, Shape, kernels
from pipeflow.planning.products import weight_products
from pipeflow.planning.stage_operators import StageOperators
from pipeflow.planning.transformer import (TransformerSpec, attention_score_flops, head_forward_flops,
                                           layer_linear_flops)
from pipeflow.topology.presets import DEVICES, PROFILES

H200 = PROFILES / "h200.json"
# pipeflow-train model=gpt_medium pipeline.stages=1 precision=bf16 pipeline.microbatch_size=8
# pipeline.microbatches=4 runtime.device=cuda on one H200 (shared/measurements/h200-2026-11-28)
MEASURED_GPT_MEDIUM_STEP_S = 0.319

GPT = TransformerSpec("gpt", 4, 4, 128, 256, 128, weights_in_out=True)
BERT = TransformerSpec("bert", 4, 4, 128, 256, 128, causal=False, post_norm=True, qkv_inputs=3)
LLAMA = TransformerSpec("llama", 4, 8, 256, 320, 256, n_kv_head=2, mlp="gated", norm="rmsnorm", qkv_bias=False,
                        o_bias=False, mlp_bias=False, tied=False, position_embedding="rotary", qkv_inputs=3)


def _flops(ops, cls) -> float:
    return sum(o.flops for o in ops if isinstance(o, cls))


def test_the_memory_model_reads_what_the_operators_keep():
    """A block's saved bytes are its forward operators' tensors, each once: at fp32 Llama's
    Q, K and V products and its gate and up read (and keep) one input each, at 16 bits
    each product its own cast (3 + 2 tensors of x*b*H*2 bytes for 2 + 1); and the cost
    model's activation bytes on a middle stage are the layers' and the rotary tables'."""
    from pipeflow.planning.cost import AnalyticCost
    from pipeflow.planning.layer_operators import block_forward
    from pipeflow.planning.saved_tensors import block_saved, kept
    from pipeflow.planning.transformer import stage_shared_saved

    b, x, H = 2, 64, LLAMA.n_embd
    fp32, bf16 = (kept(block_forward(Shape(LLAMA, b, x, x, c))) for c in (4, 2))
    assert {"attn.in", "mlp.in"} <= set(fp32) and not {"q.in", "gate.in"} & set(fp32)
    assert {"q.in", "k.in", "v.in", "gate.in", "up.in"} <= set(bf16) and not {"attn.in", "mlp.in"} & set(bf16)
    inputs = {name: t.nbytes for name, t in bf16.items() if name[:-3] in {"q", "k", "v", "gate", "up"}}
    assert len(inputs) == 5 and set(inputs.values()) == {x * b * H * 2}
    # at fp32 the products name 3 + 2 inputs, of which 2 + 1 are one tensor counted again
    ops = block_forward(Shape(LLAMA, b, x, x, 4))
    named = sum(t.nbytes for o in ops if isinstance(o, Product) for t in o.saves)
    assert named - sum(t.nbytes for t in kept(o for o in ops if isinstance(o, Product)).values()) == 3 * x * b * H * 4
    cost = AnalyticCost(dataclasses.replace(LLAMA, n_layer=6), 3, microbatch_size=b, dtype_bytes=2)
    per_stage = 2 * block_saved(Shape(LLAMA, b, LLAMA.seq_len, LLAMA.seq_len, 2))[0]
    assert cost.activation_bytes(1, 0) == per_stage + stage_shared_saved(LLAMA, LLAMA.seq_len)


@pytest.mark.parametrize("spec", [GPT, BERT, LLAMA], ids=lambda s: s.name)
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("tokens,prefix", [(128, 128), (32, 96)])
def test_the_operators_flops_are_the_analytic_costs(spec, recompute, tokens, prefix):
    if prefix != tokens and not spec.causal:
        pytest.skip("segments need causal attention")
    spec = dataclasses.replace(spec, recompute=recompute)
    b, layers = 2, 3
    stage = StageOperators(Shape(spec, b, tokens, prefix, 2), layers, first=True, last=True)
    f, back = stage.action("F"), stage.action("B")
    per_pair = spec.n_head * 3  # the analytic count's softmax: 3 FLOPs a pair, no product
    scores = attention_score_flops(spec, tokens, prefix)
    pairs = scores / (spec.n_head * (4 * spec.head_dim + 3))
    # (BERT's head has its dense transform before the decoder, which the analytic count leaves out)
    transform = 2 * tokens * spec.n_embd ** 2 if spec.post_norm else 0
    assert _flops(f, Product) == pytest.approx(b * (layers * layer_linear_flops(spec, tokens)
                                                    + head_forward_flops(spec, tokens) + transform) + (
        b * layers * (scores - per_pair * pairs) if spec.attention == "eager" else 0), rel=1e-12)
    assert _flops(f, Attention) == pytest.approx(b * layers * (scores - per_pair * pairs), rel=1e-12)
    rerun = {"none": 0.0, "full": 1.0}.get(recompute)
    block_products = b * layers * layer_linear_flops(spec, tokens)
    if recompute == "selective":
        q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
        rerun_products = b * layers * 2 * tokens * spec.n_embd * (2 * q + 2 * kv)
    else:
        rerun_products = rerun * block_products
    # each forward product's input and weight gradients, plus what recomputation reruns
    assert _flops(back, Product) == pytest.approx(2 * _flops(f, Product) + rerun_products, rel=1e-12)
    # the zero-bubble split: I and W hold B's operators between them (the first stage's I is empty)
    middle = StageOperators(Shape(spec, b, tokens, prefix, 2), layers, first=False, last=False)
    assert sorted(map(repr, middle.action("I") + middle.action("W"))) == sorted(map(repr, middle.action("B")))
    assert stage.action("I") == [] and stage.action("W") == stage.action("B")


def test_a_measured_row_is_priced_as_measured_and_odd_widths_by_their_own_rows():
    prof = load_profile(H200)
    sweep = json.loads(H200.read_text())
    row = next(r for r in sweep["sections"]["gemm_bf16"]["rows"] if r["shape"] == "gpt_medium fc1" and r["m"] == 8192)
    for phase in ("fwd", "dgrad", "wgrad"):
        assert prof.time(Product(phase, row["m"], row["k"], row["n"], 2)) == pytest.approx(row[f"{phase}_s"], rel=1e-9)
    # GPT-2's vocabulary of 50,257 is priced by the odd-width rows (several times slower
    # than 50,304 on the H200), whatever the width of its input
    odd, even = (prof.time(Product("fwd", 8192, 1600, n, 2)) for n in (50257, 50304))
    assert odd > 3 * even
    a = next(r for r in sweep["sections"]["sdpa_bf16"]["rows"] if r["s"] == 2048 and r["h"] == 16)
    op = Attention("fwd", a["b"] * a["h"], a["s"], a["s"], a["d"], True, 2, heads=a["h"])
    assert prof.time(op) == pytest.approx(a["fwd_s"], rel=1e-9)
    assert prof.time(dataclasses.replace(op, phase="bwd")) == pytest.approx(a["fwd_bwd_s"] - a["fwd_s"], rel=1e-9)
    errors = prof.fit_errors()
    assert {k.split()[0] for k in errors} >= {"product", "attention", "layernorm", "add", "cross-entropy", "adamw"}
    # the fitted lines hold on the rows they were fitted to within a quarter
    assert max(v for k, v in errors.items() if not k.startswith(("product", "attention"))) < 0.25


def test_a_stream_of_small_kernels_costs_its_launches_and_large_ones_their_bytes():
    prof = load_profile(H200)
    small = Pointwise("add", "fwd", 1024, 4, count=1000)
    large = Pointwise("add", "fwd", 1 << 28, 4, count=10)
    t_small, split = prof.action([small])
    assert t_small == pytest.approx(1000 * prof.launch_s + prof.time(small) / 1000)
    assert split["host"] > 0.8 * t_small
    t_large, split = prof.action([large])
    assert t_large == pytest.approx(prof.launch_s + prof.time(large))
    assert split["host"] == pytest.approx(prof.launch_s)
    # a backward pass pays its start on the host before its first kernel
    assert prof.action([large], backward=True)[0] == pytest.approx(t_large + prof.backward_call_s)


def test_the_h200_profile_predicts_the_measured_gpt2_medium_step_and_prints_its_operators(tmp_path, capsys):
    from pipeflow.simulate import format_report, run_simulation

    # (the measured run's head was GPT-2's 50,257 words wide: model.vocab_multiple=1)
    over = ["model=gpt_medium", "precision=bf16", "pipeline.stages=1", "pipeline.microbatch_size=8",
            "pipeline.microbatches=4", "topology=cluster", "topology.nodes=1", "topology.gpus_per_node=1",
            "topology.device=h200", "draw=false"]
    cfg = compose("simulate", [*over, "model.vocab_multiple=1"])
    summary = run_simulation(cfg, tmp_path)
    assert summary["makespan"] == pytest.approx(MEASURED_GPT_MEDIUM_STEP_S, rel=0.10)
    # the preset's head padded to 50,304 rows: its products priced by the sweep's rows at that
    # width (630-790 TFLOP/s there, 90-140 at 50,257), the loss over the same 50,257 words
    padded = run_simulation(compose("simulate", over), tmp_path / "padded")["operator_seconds"][0]
    unpadded = summary["operator_seconds"][0]
    assert padded["loss"] == pytest.approx(unpadded["loss"], rel=1e-9)
    prof, tokens = load_profile(H200), 8 * 1024
    head = {v: 4 * sum(prof.time(Product(phase, tokens, 1024, v, 2)) for phase in ("fwd", "dgrad", "wgrad"))
            for v in (50257, 50304)}
    assert unpadded["product"] - padded["product"] == pytest.approx(head[50257] - head[50304], rel=1e-6)
    assert head[50257] - head[50304] > 0.06  # (72 ms of the 0.32 s step)
    split = summary["operator_seconds"][0]
    assert sum(split.values()) == pytest.approx(summary["makespan"], rel=1e-9)
    assert split["product"] > split["attention"] > 0 and split["loss"] > 0 and split["optimizer"] > 0
    report = format_report(summary)
    assert "compute by operator class" in report and "attention" in report
    # the same model on an H100 is still FLOPs at the peak and cost.efficiency: no breakdown
    cfg.topology.device = "h100-80g"
    assert run_simulation(cfg, tmp_path / "h100")["operator_seconds"] is None


def test_a_device_profile_that_is_missing_or_not_a_sweep_is_refused_naming_the_key(tmp_path):
    with pytest.raises((ConfigError, ValueError), match="topology.device_profile"):
        prepare_simulation(compose("simulate", ["topology=cluster", f"topology.device_profile={tmp_path}/none.json"]))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ProfileError, match="not an operator sweep"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="adamw"):
        sweep = json.loads(H200.read_text())
        del sweep["sections"]["adamw"]
        from_sweep(sweep, "cut")


def test_the_h200_preset_is_the_datasheets_device():
    d = DEVICES["h200"]
    assert (d.peak_flops, d.memory_bytes, d.memory_bandwidth) == (989e12, 141e9, 4.8e12)
    assert d.profile and math.isfinite(load_profile(d.profile).launch_s)


def test_a_sweep_that_times_the_gradient_norm_prices_the_clip_by_it():
    from pipeflow.planning.operators import GradNorm

    sweep = json.loads(H200.read_text())
    assert from_sweep(sweep, "no norm rows").grad_norm is None  # (the sweep of 2026-12-04 predates the section)
    rows = [{"params": p, "tensors": n, "s": 1e-4 + 2e-11 * p + 3e-6 * n, "scale_s": 1e-11 * p}
            for p, n in ((10**6, 4), (10**7, 64), (10**8, 256), (4 * 10**8, 512))]
    sweep["sections"]["grad_norm"] = {"status": "ok", "rows": rows}
    prof = from_sweep(sweep, "with norm rows")
    assert prof.time(GradNorm(2 * 10**8, 300)) == pytest.approx(1e-4 + 3e-11 * 2e8 + 3e-6 * 300, rel=1e-6)
    assert "gradient norm and clip" in prof.fit_errors()


def test_cpu_ranks_with_a_profile_are_priced_operator_by_operator_one_after_another(tmp_path):
    from pipeflow.simulate import run_simulation

    sweep = json.loads(H200.read_text())
    sweep["device"] = "cpu"  # one thread issues and runs: no launch runs ahead of its kernel
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(sweep))
    prof = load_profile(path)
    assert prof.kernel_s is None
    ops = [Pointwise("add", "fwd", 1024, 4, count=10), Product("fwd", 512, 128, 384, 4)]
    assert prof.action(ops)[0] == pytest.approx(sum(prof.time(o) for o in ops))
    cfg = compose("simulate", ["model=gpt_tiny", "pipeline.stages=2", "pipeline.microbatches=4", "cost=analytic",
                               "topology=local_cpu", f"topology.device_profile={path}", "draw=false"])
    summary = run_simulation(cfg, tmp_path / "run")
    assert all(d["busy"] == pytest.approx(sum(split.values()), rel=1e-9)
               for d, split in zip(summary["per_device"], summary["operator_seconds"]))


def test_an_operator_of_no_known_kind_or_phase_is_refused_where_it_is_made():
    with pytest.raises(ValueError, match="phase"):
        Product("forward", 8, 8, 8, 2)
    with pytest.raises(ValueError, match="pointwise"):
        Pointwise("layer_norm", "fwd", 8, 4)


def test_a_pointwise_kind_is_one_record_that_prices_launches_and_classes_it(monkeypatch):
    """A kind declared in POINTWISE_KINDS alone is priced by its swept kernel, launches its kernels and
    falls in its class; one naming a class or a kernel there is none of is refused where it is declared."""
    prof = load_profile(H200)
    monkeypatch.setitem(POINTWISE_KINDS, "relu2", PointwiseKind("pointwise", "gelu_tanh", passes=2.0, backward=True,
                                                                kernels=(2, 3)))
    for phase in ("fwd", "bwd"):
        op = Pointwise("relu2", phase, 1 << 20, 2)
        assert prof.time(op) == prof.time(Pointwise("gelu", phase, 1 << 21, 2))
        assert (kernels(op), op.cls) == ((2, 3)[phase == "bwd"], "pointwise")
    with pytest.raises(ValueError, match="class"):
        PointwiseKind("activation", "gelu_tanh")
    with pytest.raises(ValueError, match="kernel"):
        PointwiseKind("pointwise", "relu2")


@pytest.mark.parametrize("spec", [GPT, BERT, LLAMA], ids=["gpt", "bert", "llama"])
def test_the_memory_models_weight_products_are_the_blocks_own(spec):
    sh = Shape(spec, 1, 64, 64, 2)
    ops = block_forward(sh)
    assert weight_products(spec, 1, False, 64) == [(o.n, o.k, 64) for o in reversed(ops) if has_weight(o)]
    assert block_tensors(spec) == len([o for o in ops if has_weight(o)]) + len(
        [o for o in ops if isinstance(o, Pointwise) and o.kind == "bias"]) + (2 if spec.norm == "rmsnorm" else 4)


def test_a_device_profile_under_a_cost_model_that_does_not_read_it_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"topology.device_profile=.*cost=unit"):
        prepare_simulation(compose("simulate", ["cost=unit", "topology=cluster", f"topology.device_profile={H200}"]))


def test_a_cpu_prices_memory_bound_operators_along_its_measured_rows():
    """A CPU's bandwidth falls with the size (caches, DRAM, pages mapped fresh): its
    memory-bound operators are priced along the rows, not by one line through them,
    which the largest (page-fault-bound) rows would set for every size."""
    from pipeflow.planning.profile_fits import fit_curve, fit_linear

    sizes = [2**12, 2**14, 2**16, 2**18, 2**20]
    seconds = [2e-6, 5e-6, 20e-6, 80e-6, 3000e-6]  # the last one faulted in page by page
    curve = fit_curve(sizes, seconds)
    assert [curve(x) for x in sizes] == pytest.approx(seconds, rel=1e-12)
    assert curve(3 * 2**14) == pytest.approx(5e-6 + (20e-6 - 5e-6) * (2 * 2**14) / (3 * 2**14), rel=1e-12)
    # under the smallest row: the line through the two smallest, its intercept a call's cost
    fixed = 2e-6 - (5e-6 - 2e-6) / (2**14 - 2**12) * 2**12
    assert curve.fixed == pytest.approx(fixed) and curve(2**11) == pytest.approx(fixed + (2e-6 - fixed) / 2)
    assert curve(2**21) == pytest.approx(3000e-6 + (3000e-6 - 80e-6) / (2**20 - 2**18) * 2**20)  # past: the last slope
    assert fit_linear(sizes, seconds)(2**16) > 8 * curve(2**16)  # what one line made of a 64 KiB add
    assert curve.error > 0  # leave-one-out over the inner rows


def test_a_biased_product_writes_its_bias_first_on_a_cpu_and_nothing_on_a_gpu(tmp_path):
    """torch's CPU addmm copies the bias into every output row before the product adds into
    them (a pass over the output); cuBLASLt adds it in the product's epilogue."""
    gpt, llama = (StageOperators(Shape(s, 2, 64, 64, 4), 1, False, False) for s in (GPT, LLAMA))
    f = gpt.action("F")
    biases = [o for o in f if isinstance(o, Pointwise) and o.kind == "bias"]
    products = [o for o in f if isinstance(o, Product) and o.name in ("qkv", "proj", "fc1", "fc2")]
    assert sorted(b.elements for b in biases) == sorted(p.m * p.n for p in products)
    # each just before its product, none in the backward (the bias's gradient is W's sum)
    assert all(isinstance(f[f.index(b) + 1], Product) for b in biases)
    assert not [o for o in gpt.action("B") if isinstance(o, Pointwise) and o.kind == "bias"]
    assert not [o for o in llama.action("F") if isinstance(o, Pointwise) and o.kind == "bias"]
    gpu = load_profile(H200)
    sweep = json.loads(H200.read_text())
    sweep["device"] = "cpu"
    cpu = from_sweep(sweep, "as a cpu")
    assert gpu.time(biases[0]) == 0.0 and cpu.time(biases[0]) == pytest.approx(
        cpu.time(Pointwise("add", "fwd", biases[0].elements, 4)))


def test_a_reference_pipeline_gives_each_action_kind_its_time_per_block_beyond_the_price():
    from pipeflow.planning.device_profile import in_step_rows

    times = {"F|0|0": 9e-3, "F|1|0": 10e-3, "B|0|0": 15e-3, "B|1|0": 16e-3, "I|1|0": 11e-3, "W|1|0": 6e-3}
    priced = {"F|0|0": 8e-3, "F|1|0": 9.4e-3, "B|0|0": 15.2e-3, "B|1|0": 15.6e-3, "I|1|0": 10e-3, "W|1|0": 5e-3}
    got = in_step_rows(times, priced, [2, 2])
    # the median over the stages of (measured - priced) per block; I and W were timed in
    # loops, outside a step: I takes B's, W none
    assert got["F"] == pytest.approx((0.5e-3 + 0.3e-3) / 2) and got["B"] == pytest.approx((-0.1e-3 + 0.2e-3) / 2)
    assert got["I"] == got["B"] and got["W"] == 0.0
    # a GPU's host overlaps its kernels: no block or step time is added there
    prof = load_profile(H200)
    assert prof.kernel_s is not None and prof.block_time("gpt", "F") == 0.0
