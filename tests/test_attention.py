"""model.attention (issue 30): the fused scaled-dot-product kernel and the eager reference
compute the same stage outputs and gradients for every family and architecture, on whole
sequences and on Seq1F1B's segments; a segment's fused call keeps no mask; the
simulator's saved bytes are what the runtime's meter counts, for both kinds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import pipeline_runs

from pipeflow.config import compose, prepare_training
from pipeflow.models import attention as attn
from pipeflow.models import bert, cbm, gpt, hf_causal
from pipeflow.runtime.saved_bytes import SavedBytes

HF = pipeline_runs.SMALL_HF  # a small shape of each supported Hugging Face architecture


def _model(*overrides: str) -> dict:
    cfg = compose("train", ["logger=none", *overrides])
    return OmegaConf.to_container(prepare_training(cfg).config.model, resolve=True)


def _run(module, inputs, segments: bool):
    """Output and gradients of a whole-sequence forward, and (causal models) of the same
    sequence in two segments, the second attending over the first's keys and values."""
    module.zero_grad(set_to_none=True)
    out = module(*inputs)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    if not segments:
        return out.detach(), grads, None
    ids = inputs[0]
    x0, kv0 = module.forward_segment(ids[:, :12], 0, None)
    x1, _ = module.forward_segment(ids[:, 12:], 12, kv0)
    return out.detach(), grads, torch.cat([x0, x1], 1).detach()


def _same(family: str, build, inputs, segments: bool) -> None:
    (out_e, grads_e, seg_e), (out_f, grads_f, seg_f) = (_run(build(m), inputs, segments) for m in ("eager", "sdpa"))
    torch.testing.assert_close(out_f, out_e, rtol=0, atol=1e-5)
    assert grads_f.keys() == grads_e.keys() and grads_e, family
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-6, msg=f"{family} {name}")
    if segments:
        torch.testing.assert_close(seg_f, out_e, rtol=0, atol=1e-5)
        torch.testing.assert_close(seg_e, out_e, rtol=0, atol=1e-5)


IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", list(HF))
def test_hf_decoders_fused_equals_eager(arch):
    model = _model("model=llama_tiny", "model.seq_len=32", *HF[arch])
    _same(arch, lambda m: hf_causal.build_model({**model, "attention": m}, seed=3), (IDS,), segments=True)


def test_gpt_and_bert_fused_equals_eager():
    model = _model("model=gpt_tiny", "model.seq_len=32")
    _same("gpt", lambda m: gpt.build_model({**model, "attention": m}, seed=3), (IDS,), segments=True)
    model = _model("model=bert_tiny", "data=mlm_corpus", "model.seq_len=32")
    _same("bert", lambda m: bert.build_model({**model, "attention": m}, seed=3), (IDS,), segments=False)


def test_concurrent_branch_model_fused_equals_eager():
    model = _model("model=cbm_tiny", "data=image_text")
    image, ids = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)), IDS
    _same("cbm", lambda m: cbm.build_cbm_model({**model, "attention": m}, seed=3), (image, ids), segments=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_eager_in_half_precision(dtype):
    """Under autocast, whole sequences and segments over a sliding window (the masked
    fused path), outputs and a weight's gradient."""
    model = _model("model=llama_tiny", "model.seq_len=32", *HF["mistral"])
    got = {}
    for mode in ("eager", "sdpa"):
        stage = hf_causal.build_model({**model, "attention": mode}, seed=3)
        with torch.autocast("cpu", dtype=dtype):
            whole = stage(IDS).float()
            x0, kv0 = stage.forward_segment(IDS[:, :12], 0, None)
            split = torch.cat([x0, stage.forward_segment(IDS[:, 12:], 12, kv0)[0]], 1).float()
        split.square().mean().backward()
        got[mode] = (whole, split, stage.model.layers["0"].self_attn.q_proj.weight.grad)
    for a, b in zip(got["sdpa"], got["eager"]):  # relative to the whole tensor: half-precision rounding
        assert float((a - b).norm() / b.norm()) < 0.02


@pytest.mark.parametrize("window", [None, 5])
def test_a_segments_fused_call_keeps_no_mask_and_matches_the_masked_kernel(window):
    """Queries 16..31 over 32 keys (grouped-query: 4 heads over 2): the same output and
    gradients as torch's kernel given the materialised lower-right mask, and only what
    the kernel needs is kept (q, k, v, output, log-sum-exp: no 16 x 32 mask)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 16, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 8, generator=gen, requires_grad=True) for _ in range(2))
    meter = SavedBytes()
    with meter.hooks():
        out = attn.attention(q, k, v, attn.Pattern("sdpa", causal=True, offset=16), window=window)
    kept = meter.current
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), g)
    mask = attn.allowed(16, 32, 16, window, "cpu")
    want_out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    want = torch.autograd.grad(want_out, (q, k, v), g)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kept == (q.numel() + k.numel() + v.numel() + out.numel() + 2 * 4 * 16) * 4
    eager = attn.attention(q, k, v, attn.Pattern("eager", causal=True, offset=16), window=window)
    torch.testing.assert_close(eager, out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("queries,keys,causal", [(32, 32, True), (32, 32, False), (16, 48, True)],
                         ids=["whole", "bidirectional", "segment"])
def test_what_the_host_measures_of_the_backward_is_what_the_models_call_allocates(queries, keys, causal, dtype):
    """The simulator prices the fused attention's backward by
    :func:`pipeflow.topology.kernel_scratch.attention_scratch`, which calls torch's kernels as
    :func:`pipeflow.models.attention.attention` does (config may not import the models):
    the same bytes as a backward through the models' own call, beyond dQ, dK and dV, and
    more than nothing (a segment's backward: its rebuilt mask at least)."""
    from pipeflow.topology.kernel_scratch import attention_scratch, most_live, profile_allocations

    dt = getattr(torch, dtype)
    b, heads, kv_heads, d = 2, 4, 2, 16
    q = torch.randn(b, queries, heads, d).to(dt).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(b, keys, kv_heads, d).to(dt).transpose(1, 2) for _ in range(2))
    if keys != queries:  # a later segment's keys: the prefix's concatenation
        k, v = k.contiguous(), v.contiguous()
    k.requires_grad_(), v.requires_grad_()
    out = attn.attention(q, k, v, attn.Pattern("sdpa", causal=causal, offset=keys - queries))
    g = torch.randn(b, queries, heads, d).to(dt).transpose(1, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a rank's (runtime.threads_per_rank): the kernel's blocks are per thread
    try:
        with profile_allocations() as sizes:
            grads = torch.autograd.grad(out, (q, k, v), g)
    finally:
        torch.set_num_threads(threads)
    want = most_live(sizes) - sum(t.numel() * t.element_size() for t in grads)
    assert attention_scratch(b, heads, kv_heads, queries, keys, d, causal, dtype) == want > 0
    if keys != queries:
        assert want >= queries * keys * dt.itemsize


def test_the_attention_modes_and_the_pattern_are_checked():
    with pytest.raises(ValueError, match=r"model.attention=flash: allowed values: sdpa, eager"):
        attn.Pattern("flash")
    with pytest.raises(ValueError, match=r"model.attention=flash: allowed values: sdpa, eager"):
        attn.check_mode("flash")
    stage = gpt.build_model(_model("model=gpt_tiny", "model.seq_len=32"), seed=1)
    block = next(iter(stage.h.values()))
    with pytest.raises(TypeError, match="takes a Pattern as attention_mask"):
        block(torch.randn(1, 8, 128), attention_mask=torch.zeros(1, 1, 8, 8))
    from pipeflow.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.attention=flash: allowed values: sdpa, eager"):
        prepare_training(compose("train", ["logger=none", "model.attention=flash"]))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_simulated_bytes_are_what_the_meter_counts(family, attention, recompute):
    """fp32, every stage position (the embedding, plain layers, the head and loss): the
    analytic cost's saved bytes per microbatch are the runtime meter's count (within
    1%: BERT's embedding keeps a (2, 32) token-type id view, 256 bytes, it does not count)."""
    from pipeflow.planning.cost import AnalyticCost
    from pipeflow.planning.transformer import TransformerSpec

    over = {"gpt": ["model=gpt_tiny"], "llama": ["model=llama_tiny"], "bert": ["model=bert_tiny", "data=mlm_corpus"]}
    module = {"gpt": gpt, "llama": hf_causal, "bert": bert}[family]
    model = {**_model(*over[family], "model.seq_len=32"), "attention": attention, "recompute": recompute}
    split = [1, 2, 1]
    cost = AnalyticCost(TransformerSpec.from_config(model), 3, microbatch_size=2, dtype_bytes=4,
                        layers_per_stage=split)
    loss = bert.mlm_loss if family == "bert" else gpt.lm_loss
    for stage in range(3):
        st = module.build_stage(model, split, stage, seed=0)
        x = IDS if stage == 0 else torch.randn(2, 32, model["n_embd"], requires_grad=True)
        meter = SavedBytes({t.untyped_storage().data_ptr() for t in (*st.parameters(), *st.buffers())})
        with meter.hooks():
            y = st(x)
            if stage == 2:
                y = loss(y, IDS, 1.0)  # kept: its log-softmax is saved
        assert cost.activation_bytes(stage, 0) == pytest.approx(meter.current, rel=0.01, abs=0), stage


@pytest.mark.slow  # starts 2 ranks
def test_the_long_context_experiment_trains_and_is_simulated_to_its_peak(tmp_path):
    """experiment=long_context (Seq1F1B, 2 ranks, a small Llama), its sequences cut to
    1,024 tokens for CI: the loss falls, every rank's measured saved-activation peak is
    reported, and pipeflow-simulate of the same configuration predicts each within 2%
    (issue 30 asks 10%; byte counts, not times). The fused attention keeps a fraction of
    what eager keeps for the same run."""
    from pipeflow.simulate import run_simulation

    short = ["model.seq_len=1024", "trainer.steps=2", "trainer.val_every=0", "trainer.timeline_step=null",
             "logger=none"]
    runs = {m: pipeline_runs.train(tmp_path / m, ["experiment=long_context", *short, f"model.attention={m}"])
            for m in ("sdpa", "eager")}
    losses = runs["sdpa"]["losses"]
    assert len(losses) == 2 and losses[-1] < losses[0]
    assert runs["eager"]["losses"] == pytest.approx(losses, rel=1e-5)
    for mode, run in runs.items():
        measured = run["summary"]["peak_saved_bytes"]
        assert len(measured) == 2 and run["summary"]["attention"] == mode
        sim = run_simulation(compose("simulate", [
            "model=llama_long", "schedule=seq1f1b", "pipeline.stages=2", "pipeline.segments=4",
            "pipeline.microbatches=4", "pipeline.microbatch_size=1", "precision=fp32", "model.seq_len=1024",
            f"model.attention={mode}", "draw=false"]), tmp_path / f"sim_{mode}")
        predicted = [d["peak_activation_bytes"] for d in sim["per_device"]]
        for rank, (p, m) in enumerate(zip(predicted, measured)):
            assert p == pytest.approx(m, rel=0.02), (mode, rank, p, m)
    # the scores of every layer of every segment in flight: 1.8x at 1,024 tokens, 7.2x at 8,192
    assert max(runs["eager"]["summary"]["peak_saved_bytes"]) > 1.5 * max(runs["sdpa"]["summary"]["peak_saved_bytes"])


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", ["gpt_tiny", "llama_tiny", "llama_long"])
def test_a_segments_saved_bytes_are_what_the_meter_counts(preset, attention, b):
    """Four segments of 16 tokens through a middle stage of one layer, each attending over
    the earlier ones' keys and values as the runtime hands them over (one leaf per earlier
    segment; the stage's own keys and values held): per segment, the analytic layer's
    bytes and the rotary tables are the meter's count, for grouped (llama_tiny: 2 of 4),
    single (llama_long) and per-head (gpt_tiny) key/value heads, and one and two
    sequences a microbatch. Exact, but for eager attention over a fused Q/K/V projection
    (GPT) with two sequences: its batched products copy Q, K and V and the held keys and
    values keep the projection's whole output (3H a token, counted as 2H)."""
    from pipeflow.planning.cost import layer_cost
    from pipeflow.planning.transformer import TransformerSpec, stage_shared_saved

    model = {**_model(f"model={preset}", "model.seq_len=64"), "attention": attention}
    module = gpt if preset.startswith("gpt") else hf_causal
    stage = module.build_stage(model, [1, 1, model["n_layer"] - 2], 1, seed=0)
    spec = TransformerSpec.from_config(model)
    weights = {t.untyped_storage().data_ptr() for t in (*stage.parameters(), *stage.buffers())}
    prefix, x = None, 16
    for j in range(4):
        meter = SavedBytes(weights)
        with meter.hooks():
            _, own = stage.forward_segment(torch.randn(b, x, model["n_embd"], requires_grad=True), j * x, prefix)
        holds = [meter.hold(t) for kv in own for t in kv]  # noqa: F841 - held as the runtime holds them
        want = layer_cost(spec, x, (j + 1) * x, b, 4, segmented=True).saved + stage_shared_saved(spec, x)
        fused_qkv_copies = preset == "gpt_tiny" and attention == "eager" and b == 2
        assert meter.current == (pytest.approx(want, rel=0.06) if fused_qkv_copies else want), (j, meter.current, want)
        leaves = [tuple((t.detach().requires_grad_(True),) for t in kv) for kv in own]
        prefix = leaves if prefix is None else [(pk + k, pv + v) for (pk, pv), (k, v) in zip(prefix, leaves)]
