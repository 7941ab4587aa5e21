"""GPT-2 split into stages: split-independent initialisation, chained stages equal the
whole model (logits and gradients by name, tied copies summed), causality, agreement
with transformers' own GPT2LMHeadModel, and the loss scaling the runtime relies on."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pipeflow.models import GPTStage, build_model, build_stage, gpt2_config, hidden_shape, lm_loss

CONF = Path(__file__).resolve().parent.parent / "conf"
# gpt_tiny's shape with a short sequence: the tests stay fast
TINY = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(CONF / "model" / "gpt_tiny.yaml")).items() if k != "defaults"}
SPLITS = [[4], [2, 2], [1, 1, 1, 1], [1, 3], [3, 1]]
SEED = 1234


def _batch(b=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY["vocab_size"], (b, T), generator=g)
    y = torch.randint(0, TINY["vocab_size"], (b, T), generator=g)
    return x, y


def _stages(split, seed=SEED):
    return [build_stage(TINY, split, s, seed) for s in range(len(split))]


def _chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


def test_full_model_has_gpt2_names_and_count():
    model = build_model(TINY, SEED)
    names = dict(model.named_parameters())
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "h.0.attn.c_attn.weight", "h.3.mlp.c_proj.bias"} <= set(names)
    assert "lm_head.weight" not in names  # the head is wte itself
    H, V, P, L = TINY["n_embd"], TINY["vocab_size"], TINY["n_positions"], TINY["n_layer"]
    per_layer = 12 * H * H + 13 * H  # GPT-2 block with n_inner = 4H
    assert sum(p.numel() for p in model.parameters()) == L * per_layer + V * H + P * H + 2 * H
    assert model.tied_parameters() == [model.wte.weight]


def test_init_follows_gpt2():
    model = build_model(TINY, SEED)
    p = dict(model.named_parameters())
    assert torch.equal(p["h.1.ln_1.weight"], torch.ones_like(p["h.1.ln_1.weight"]))
    assert not p["h.1.attn.c_attn.bias"].any() and not p["ln_f.bias"].any()
    assert abs(p["h.0.mlp.c_fc.weight"].std().item() - 0.02) < 0.002
    residual = 0.02 / (2 * TINY["n_layer"]) ** 0.5
    assert abs(p["h.2.attn.c_proj.weight"].std().item() - residual) < 0.1 * residual
    # every matrix its own draw
    assert not torch.equal(p["h.0.attn.c_attn.weight"], p["h.1.attn.c_attn.weight"])
    other = dict(build_model(TINY, SEED + 1).named_parameters())
    assert not torch.equal(p["wte.weight"], other["wte.weight"])


@pytest.mark.parametrize("split", SPLITS)
def test_stage_parameters_equal_the_whole_model(split):
    full = dict(build_model(TINY, SEED).named_parameters())
    seen = {}
    for stage in _stages(split):
        for name, param in stage.named_parameters():
            assert name not in seen, f"{name} on two stages"
            seen[name] = param
    if len(split) > 1:
        assert torch.equal(seen.pop("lm_head.weight"), full["wte.weight"])
    assert set(seen) == set(full)
    for name, param in full.items():
        assert torch.equal(seen[name], param), name


@pytest.mark.parametrize("split", SPLITS[1:])
def test_tied_parameters_per_stage(split):
    stages = _stages(split)
    assert stages[0].tied_parameters() == [stages[0].wte.weight]
    assert stages[-1].tied_parameters() == [stages[-1].lm_head.weight]
    for middle in stages[1:-1]:
        assert middle.tied_parameters() == []


@pytest.mark.parametrize("split", SPLITS[1:])
def test_chained_stages_equal_the_whole_model(split):
    x, y = _batch()
    full = build_model(TINY, SEED)
    stages = _stages(split)
    # hidden states between stages have the shape the runtime allocates for them
    h = stages[0](x)
    assert tuple(h.shape) == hidden_shape(TINY, x.size(0), x.size(1))
    ref_logits = full(x)
    logits = _chain(stages, x)
    assert logits.shape == (*x.shape, TINY["vocab_size"])
    assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)

    n_tokens = y.numel()
    lm_loss(ref_logits, y, n_tokens).backward()
    lm_loss(logits, y, n_tokens).backward()
    ref_grads = {n: p.grad for n, p in full.named_parameters()}
    grads = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            # the tied copies' gradients add up to the tied matrix's gradient
            key = "wte.weight" if name == "lm_head.weight" else name
            grads[key] = grads[key] + p.grad if key in grads else p.grad.clone()
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-7), name
    # and each copy alone is not the whole gradient: the embedding and the head both contribute
    assert not torch.allclose(stages[0].wte.weight.grad, ref_grads["wte.weight"], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_matches_transformers_gpt2_lm_head_model(attention):
    """pipeflow's fused and eager attention both compute what transformers' own eager
    GPT2LMHeadModel computes with the same weights."""
    from transformers import GPT2LMHeadModel

    model = build_model({**TINY, "attention": attention}, SEED).eval()
    config = gpt2_config(TINY)
    config._attn_implementation = "eager"  # transformers' own attention, the independent reference
    ref = GPT2LMHeadModel(config).eval()
    state = {f"transformer.{k}": v for k, v in model.state_dict().items()}
    state["lm_head.weight"] = model.wte.weight
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith(".attn.bias")]
    x, _ = _batch(T=32)
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [[4], [2, 2]])
def test_causal(split):
    stages = _stages(split)
    x, _ = _batch(b=1, T=20)
    changed = x.clone()
    changed[0, 12] = (x[0, 12] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, b = _chain(stages, x), _chain(stages, changed)
    assert torch.equal(a[:, :12], b[:, :12])  # earlier positions cannot see token 12
    assert not torch.allclose(a[:, 12:], b[:, 12:])  # it and later ones do


def test_microbatch_losses_add_up_to_the_global_mean():
    model = build_model(TINY, SEED)
    x, y = _batch(b=4, T=16)
    with torch.no_grad():
        logits = model(x)
        mean = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        parts = sum(lm_loss(model(x[i : i + 1]), y[i : i + 1], y.numel()) for i in range(4))
    assert torch.allclose(parts, mean, rtol=1e-5)


def test_dropout_and_errors():
    cfg = gpt2_config({**TINY, "dropout": 0.1})
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.1
    assert gpt2_config(TINY).resid_pdrop == 0.0 and gpt2_config(TINY).n_inner == 4 * TINY["n_embd"]
    with pytest.raises(ValueError, match=r"model\.dropout=1\.5"):
        gpt2_config({**TINY, "dropout": 1.5})
    with pytest.raises(ValueError, match=r"model\.family=bert.*allowed values: gpt"):
        gpt2_config({**TINY, "family": "bert"})
    with pytest.raises(ValueError, match=r"model\.n_layer=4"):
        build_stage(TINY, [2, 1], 0, SEED)
    with pytest.raises(ValueError, match=r"stage=2"):
        build_stage(TINY, [2, 2], 2, SEED)
    assert isinstance(build_stage(TINY, [2, 2], 1, SEED), GPTStage)


def test_the_gradient_comparison_of_the_runtime_tests_can_fail():
    """pipeline_runs.assert_same_grads, which every runtime test compares gradients with,
    refuses an empty reference, names on one side only, a missing copy, and a wrong value."""
    import pipeline_runs

    g = {"w": [torch.ones(3)], "b": [torch.zeros(2) + 1]}
    assert pipeline_runs.assert_same_grads({"w": [torch.ones(3)] * 2, "b": [torch.ones(2)]}, g) == 3
    for got, want, why in (({}, {}, "dumped no gradient"), ({"w": [torch.ones(3)]}, g, "one side only"),
                           ({"w": [torch.ones(3)], "b": []}, g, "no gradient of b"),
                           ({"w": [torch.ones(3)], "b": [torch.ones(2) * 2]}, g, "b")):
        with pytest.raises(AssertionError, match=why):
            pipeline_runs.assert_same_grads(got, want)
