"""BERT split into stages: split-independent initialisation, chained stages equal the
whole model (logits and gradients by name, tied copies summed), bidirectional
attention, agreement with transformers' own BertForMaskedLM, and the MLM loss scaling
the runtime relies on."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pipeflow.models.bert import BertStage, bert_config, build_model, build_stage, mlm_loss
from pipeflow.models.gpt import hidden_shape

CONF = Path(__file__).resolve().parent.parent / "conf"
TINY = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(CONF / "model" / "bert_tiny.yaml")).items() if k != "defaults"}
SPLITS = [[4], [2, 2], [1, 1, 1, 1], [1, 3], [3, 1]]
SEED = 1234
WORD = "embeddings.word_embeddings.weight"
COPY = "cls.decoder.weight"


def _batch(b=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY["vocab_size"], (b, T), generator=g)
    labels = torch.randint(0, TINY["vocab_size"], (b, T), generator=g)
    labels[torch.rand((b, T), generator=g) > 0.3] = -100  # only some positions scored
    return x, labels


def _stages(split, seed=SEED):
    return [build_stage(TINY, split, s, seed) for s in range(len(split))]


def _chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


def test_full_model_has_bert_names_and_count():
    model = build_model(TINY, SEED)
    names = dict(model.named_parameters())
    assert {WORD, "embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight",
            "embeddings.LayerNorm.weight", "layer.0.attention.self.query.weight", "layer.3.output.dense.bias",
            "cls.transform.dense.weight", "cls.transform.LayerNorm.bias", "cls.bias"} <= set(names)
    assert COPY not in names  # the decoder is the word embedding itself
    H, V, P, L = TINY["n_embd"], TINY["vocab_size"], TINY["n_positions"], TINY["n_layer"]
    per_layer = 12 * H * H + 13 * H  # attention 4H^2+4H, FFN 8H^2+5H, two LayerNorms 4H
    embeddings = V * H + P * H + 2 * H + 2 * H
    head = H * H + H + 2 * H + V
    assert sum(p.numel() for p in model.parameters()) == L * per_layer + embeddings + head
    assert model.tied_parameters() == [model.embeddings.word_embeddings.weight]


def test_init_follows_bert():
    model = build_model(TINY, SEED)
    p = dict(model.named_parameters())
    assert torch.equal(p["layer.1.attention.output.LayerNorm.weight"], torch.ones(TINY["n_embd"]))
    assert torch.equal(p["embeddings.LayerNorm.weight"], torch.ones(TINY["n_embd"]))
    assert not p["layer.1.attention.self.key.bias"].any() and not p["cls.bias"].any()
    assert not p["cls.transform.LayerNorm.bias"].any()
    for name in ("layer.0.intermediate.dense.weight", "layer.2.output.dense.weight", WORD):
        assert abs(p[name].std().item() - 0.02) < 0.002, name
    assert not torch.equal(p["layer.0.attention.self.query.weight"], p["layer.1.attention.self.query.weight"])
    other = dict(build_model(TINY, SEED + 1).named_parameters())
    assert not torch.equal(p[WORD], other[WORD])


@pytest.mark.parametrize("split", SPLITS)
def test_stage_parameters_equal_the_whole_model(split):
    full = dict(build_model(TINY, SEED).named_parameters())
    seen = {}
    for stage in _stages(split):
        for name, param in stage.named_parameters():
            assert name not in seen, f"{name} on two stages"
            seen[name] = param
    if len(split) > 1:
        assert torch.equal(seen.pop(COPY), full[WORD])  # the copy starts equal
    assert set(seen) == set(full)
    for name, param in full.items():
        assert torch.equal(seen[name], param), name


@pytest.mark.parametrize("split", SPLITS[1:])
def test_tied_parameters_per_stage(split):
    stages = _stages(split)
    assert stages[0].tied_parameters() == [stages[0].embeddings.word_embeddings.weight]
    assert stages[-1].tied_parameters() == [stages[-1].cls.decoder.weight]
    for middle in stages[1:-1]:
        assert middle.tied_parameters() == []


@pytest.mark.parametrize("split", SPLITS[1:])
def test_chained_stages_equal_the_whole_model(split):
    x, labels = _batch()
    full = build_model(TINY, SEED)
    stages = _stages(split)
    h = stages[0](x)
    assert tuple(h.shape) == hidden_shape(TINY, x.size(0), x.size(1))  # what the runtime allocates
    ref_logits = full(x)
    logits = _chain(stages, x)
    assert logits.shape == (*x.shape, TINY["vocab_size"])
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)

    n_masked = int((labels != -100).sum())
    mlm_loss(ref_logits, labels, n_masked).backward()
    mlm_loss(logits, labels, n_masked).backward()
    ref_grads = {n: p.grad for n, p in full.named_parameters()}
    grads = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            # the tied copies' gradients add up to the tied matrix's gradient
            key = WORD if name == COPY else name
            grads[key] = grads[key] + p.grad if key in grads else p.grad.clone()
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-7, msg=name)
    # each copy alone is not the whole gradient: the embedding and the decoder both contribute
    assert not torch.allclose(stages[0].embeddings.word_embeddings.weight.grad, ref_grads[WORD], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_matches_transformers_bert_for_masked_lm(attention):
    """pipeflow's fused and eager attention both compute what transformers' own eager
    BertForMaskedLM computes with the same weights."""
    from transformers import BertForMaskedLM

    model = build_model({**TINY, "attention": attention}, SEED).eval()
    config = bert_config(TINY)
    config._attn_implementation = "eager"  # transformers' own attention, the independent reference
    ref = BertForMaskedLM(config).eval()
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("embeddings."):
            state[f"bert.{k}"] = v
        elif k.startswith("layer."):
            state[f"bert.encoder.{k}"] = v
        elif k == "cls.bias":
            state["cls.predictions.bias"] = v
            state["cls.predictions.decoder.bias"] = v  # transformers ties these two
        elif k.startswith("cls.transform."):
            state[k.replace("cls.", "cls.predictions.", 1)] = v
    state["cls.predictions.decoder.weight"] = model.embeddings.word_embeddings.weight
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k and "token_type_ids" not in k]
    x, _ = _batch(T=32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [[4], [2, 2]])
def test_bidirectional(split):
    stages = _stages(split)
    x, _ = _batch(b=1, T=20)
    changed = x.clone()
    changed[0, 12] = (x[0, 12] + 1) % TINY["vocab_size"]
    with torch.no_grad():
        a, b = _chain(stages, x), _chain(stages, changed)
    # unlike GPT, positions before 12 see it too: every position changes
    assert not torch.isclose(a, b).all(dim=-1).any()


def test_microbatch_losses_add_up_to_the_global_masked_mean():
    model = build_model(TINY, SEED)
    x, labels = _batch(b=4, T=16)
    n_masked = int((labels != -100).sum())
    with torch.no_grad():
        logits = model(x)
        mean = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        parts = sum(mlm_loss(model(x[i : i + 1]), labels[i : i + 1], n_masked) for i in range(4))
    torch.testing.assert_close(parts, mean, rtol=1e-5, atol=0)
    # unscored positions do not count: changing their labels' logits changes nothing
    only = labels.clone()
    only[only == -100] = 0
    assert not torch.isclose(mlm_loss(logits, only, n_masked), mlm_loss(logits, labels, n_masked))


def test_dropout_and_errors():
    cfg = bert_config({**TINY, "dropout": 0.1})
    assert cfg.hidden_dropout_prob == cfg.attention_probs_dropout_prob == 0.1
    plain = bert_config(TINY)
    assert plain.hidden_dropout_prob == 0.0 and plain.intermediate_size == 4 * TINY["n_embd"]
    assert plain.num_hidden_layers == TINY["n_layer"] and plain.num_attention_heads == TINY["n_head"]
    assert plain.pad_token_id is None  # byte 0 (end of document) is an ordinary token
    with pytest.raises(ValueError, match=r"model\.dropout=1\.5"):
        bert_config({**TINY, "dropout": 1.5})
    with pytest.raises(ValueError, match=r"model\.family=gpt.*allowed values: bert"):
        bert_config({**TINY, "family": "gpt"})
    with pytest.raises(ValueError, match=r"model\.n_layer=4"):
        build_stage(TINY, [2, 1], 0, SEED)
    with pytest.raises(ValueError, match=r"stage=2"):
        build_stage(TINY, [2, 2], 2, SEED)
    with pytest.raises(ValueError, match=r"model\.n_positions=256"):
        build_model(TINY, SEED)(torch.zeros((1, 300), dtype=torch.long))
    assert isinstance(build_stage(TINY, [2, 2], 1, SEED), BertStage)
