"""model.family=hf_causal (issue 19): Hugging Face decoders from a config, cut into stages.

In process: each supported architecture's stages compute what transformers' own model
computes with the same weights; a split and Seq1F1B's segments compute what the whole
model does; config errors name their key. On ranks: llama_tiny trains under every
runtime schedule like one device, and a config.json a test writes trains with no other
file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation, prepare_training
from pipeflow.hf import ARCHITECTURES, load_hf_config

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out

SMALL_HF = pipeline_runs.SMALL_HF  # a small shape of each supported architecture


def resolved(*overrides: str) -> dict:
    cfg = compose("train", ["model=llama_tiny", "logger=none", "model.seq_len=32", *overrides])
    return OmegaConf.to_container(prepare_training(cfg).config.model, resolve=True)


def test_every_architecture_is_covered():
    assert set(SMALL_HF) == set(ARCHITECTURES)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", list(SMALL_HF))
def test_a_stage_computes_what_transformers_computes(arch, attention):
    """The whole model as one stage, against transformers' own eager *ForCausalLM holding
    the same weights (loaded by name); two stages and two sequence segments, against it;
    with pipeflow's fused attention and its eager one."""
    from transformers import AutoModelForCausalLM

    from pipeflow.models import hf_causal

    model = resolved(*SMALL_HF[arch], f"model.attention={attention}")
    assert model["hf"]["model_type"] == arch
    whole = hf_causal.build_model(model, seed=3).eval()
    config = load_hf_config(model)
    config._attn_implementation = "eager"  # transformers' own attention, the independent reference
    ref = AutoModelForCausalLM.from_config(config).eval()
    result = ref.load_state_dict(whole.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if model["tied"] else set())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    want = ref(ids).logits
    torch.testing.assert_close(whole(ids), want, rtol=0, atol=1e-5)
    n = model["n_layer"]
    first = hf_causal.build_stage(model, [1, n - 1], 0, seed=3).eval()
    last = hf_causal.build_stage(model, [1, n - 1], 1, seed=3).eval()
    torch.testing.assert_close(last(first(ids)), want, rtol=0, atol=1e-5)
    x0, kv0 = whole.forward_segment(ids[:, :12], 0, None)
    x1, _ = whole.forward_segment(ids[:, 12:], 12, kv0)
    torch.testing.assert_close(torch.cat([x0, x1], 1), want, rtol=0, atol=1e-5)
    # a tied head is one matrix on one stage, and a copy equal to it on a split's last stage
    if model["tied"]:
        assert [p.shape for p in first.tied_parameters()] == [p.shape for p in last.tied_parameters()]
        torch.testing.assert_close(first.tied_parameters()[0], last.tied_parameters()[0])
    else:
        assert first.tied_parameters() == [] == last.tied_parameters()


def test_a_sliding_window_is_masked_across_segments():
    """Mistral's window: with a window of 4 over 4 layers a token sees 12 positions back
    at most, so changing token 0 leaves the logits from position 13 on alone, in one pass
    and in segments (whose prefix holds keys the window must still mask)."""
    from pipeflow.models import hf_causal

    model = resolved("model.hf.model_type=mistral", "+model.hf.sliding_window=4")
    whole = hf_causal.build_model(model, seed=1).eval()
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % 256

    def segmented(t):
        x0, kv0 = whole.forward_segment(t[:, :16], 0, None)
        return torch.cat([x0, whole.forward_segment(t[:, 16:], 16, kv0)[0]], 1)

    for run in (whole, segmented):
        a, b = run(ids), run(other)
        torch.testing.assert_close(a[:, 13:], b[:, 13:], rtol=0, atol=0)
        assert not torch.equal(a[:, :13], b[:, :13])


def test_weights_load_from_local_safetensors(tmp_path):
    """model.weights: each stage loads its own tensors by name; a tied copy from the
    embedding; a checkpoint that lacks one is refused naming it."""
    from safetensors.torch import save_file

    from pipeflow.models import hf_causal

    model = resolved("model=qwen2_tiny")  # tied
    donor = hf_causal.build_model(model, seed=99)
    save_file({k: v.contiguous() for k, v in donor.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = hf_causal.build_stage({**model, "weights": str(tmp_path)}, [2, 2], 1, seed=1)
    for name, p in loaded.named_parameters():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(p, donor.state_dict()[source], rtol=0, atol=0, msg=name)
    partial = {k: v for k, v in donor.state_dict().items() if "layers.3." not in k}
    (tmp_path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in partial.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"the checkpoint lacks model\.layers\.3\."):
        hf_causal.build_stage({**model, "weights": str(tmp_path)}, [2, 2], 1, seed=1)


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model_type 'bloom' is not supported .* supported model types: llama, "
                                          r"qwen2, mistral, gpt_neox, gpt2"):
        prepare_training(compose("train", ["model=llama_tiny", "model.hf.model_type=bloom", "logger=none"]))
    with pytest.raises(ConfigError, match=r"^model\.config=.*nope.*: no such file"):
        prepare_training(compose("train", ["model=llama_tiny", f"model.config={tmp_path / 'nope'}", "logger=none"]))
    with pytest.raises(ConfigError, match=r"^model\.n_layer=3: the HF config says 4"):
        prepare_training(compose("train", ["model=llama_tiny", "model.n_layer=3", "logger=none"]))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"needs a config\.json .* or model\.hf\.model_type"):
        prepare_training(compose("train", ["model=hf_causal", f"model.config={tmp_path}", "logger=none"]))


def test_the_hf_config_sets_the_shape_every_layer_reads():
    """Resolution fills the model group's shape keys from the HF config before anything
    else reads them: the schedule checks, the cost model, the summaries."""
    cfg = compose("simulate", ["model=llama3_8b", "pipeline.stages=8"])
    inputs = prepare_simulation(cfg)
    assert (cfg.model.n_layer, cfg.model.n_kv_head, cfg.model.mlp, cfg.model.tied) == (32, 8, "gated", False)
    assert inputs.spec.n_layer == 32 and inputs.spec.n_embd == 4096
    with pytest.raises(ConfigError, match=r"pipeline\.stages=40"):
        prepare_simulation(compose("simulate", ["model=llama3_8b", "pipeline.stages=40"]))


def _local_tokenizer(folder: Path) -> int:
    """A byte-pair tokenizer trained here on a little of the standard library's text."""
    import inspect
    import json as json_module

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator([inspect.getsource(json_module)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(folder))
    return len(fast)


def test_a_local_tokenizer_feeds_the_text_corpus(tmp_path):
    from pipeflow.data.text import load_corpus_tokens

    size = _local_tokenizer(tmp_path / "tok")
    text = tmp_path / "a.txt"
    text.write_text("def f(x):\n    return json.dumps(x)\n" * 20)
    ids = load_corpus_tokens([str(text)], cache_dir=str(tmp_path / "cache"), tokenizer=str(tmp_path / "tok"))
    assert ids.dtype == "int64" and 0 <= ids.min() and ids.max() < size
    assert len(ids) < text.stat().st_size  # merges: fewer tokens than bytes
    with pytest.raises(ConfigError, match=rf"^model\.hf\.vocab_size=256: tokenizer .* feeds token ids "
                                          rf"0\.\.{size - 1}; use model\.hf\.vocab_size >= {size}"):
        prepare_training(compose("train", ["model=llama_tiny", f"data.tokenizer={tmp_path / 'tok'}",
                                           "logger=none"]))
    prepare_training(compose("train", ["model=llama_tiny", "data=text_corpus", f"data.tokenizer={tmp_path / 'tok'}",
                                       f"model.hf.vocab_size={size}", "logger=none"]))


@pytest.mark.parametrize("arch,split,segments,attention", [
    ("llama", False, False, "sdpa"), ("llama", True, False, "sdpa"), ("llama", False, True, "sdpa"),
    ("llama", True, True, "sdpa"), ("gpt_neox", True, True, "sdpa"), ("llama", True, False, "eager"),
    ("llama", True, True, "eager")],
    ids=["llama-B-whole", "llama-I+W-whole", "llama-B-segment", "llama-I+W-segment", "gpt_neox-I+W-segment",
         "llama-I+W-whole-eager", "llama-I+W-segment-eager"])
def test_recomputation_gives_the_same_gradients_and_keeps_less(arch, split, segments, attention):
    """model.recompute on transformers' layers: full wraps each decoder layer, selective
    its attention module; the gradients are none's (the zero-bubble split and a second
    segment over the first's keys and values included, with the fused and the eager
    attention) and less is kept."""
    from test_recompute import _run

    from pipeflow.models import hf_causal
    from pipeflow.models.recompute import MODES

    model = {**resolved(*SMALL_HF[arch]), "attention": attention}
    torch.manual_seed(0)
    x, g = torch.randn(2, 32, model["n_embd"]), torch.randn(2, 16, 256)
    _, kv = hf_causal.build_stage(model, [2, 2], 1, seed=3).forward_segment(x[:, :16], 0)

    class Second(torch.nn.Module):  # the second segment, attending over the first's keys and values
        def __init__(self, stage):
            super().__init__()
            self.stage = stage

        def forward(self, t):
            return self.stage.forward_segment(t, 16, [(k.detach(), v.detach()) for k, v in kv])[0]

        def forward_segment(self, t, offset):
            return self.forward(t), None

    results = {}
    for mode in MODES:
        stage = hf_causal.build_stage({**model, "recompute": mode}, [2, 2], 1, seed=3)
        results[mode] = _run(Second(stage) if segments else stage, x[:, 16:] if segments else x,
                             g if segments else torch.randn(2, 32, 256, generator=torch.Generator().manual_seed(1)),
                             split)
    gi, want, saved_none = results["none"]
    for mode in ("full", "selective"):
        got_i, got, saved = results[mode]
        torch.testing.assert_close(got_i, gi, rtol=1e-6, atol=1e-9)
        assert got.keys() == want.keys() and want
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-9, msg=name)
        assert saved < saved_none, (mode, saved, saved_none)
    assert results["full"][2] < results["selective"][2]


# ------------------------------------------------------------------------ on ranks

# llama_tiny, small enough for CI, deep enough for 4 stages x 2 virtual stages
LLAMA_SMALL = ["model=llama_tiny", "model.hf.num_hidden_layers=8", "model.hf.hidden_size=64",
               "model.hf.intermediate_size=172", "model.seq_len=64", *pipeline_runs.GPT_SMALL[4:],
               "trainer.timeline_step=null", "trainer.steps=5", "runtime.dump_grads=true"]

CASES = [("gpipe", []), ("1f1b", []), ("interleaved_1f1b", ["pipeline.virtual_stages=2"]), ("zb_h1", []),
         ("chimera", []), ("seq1f1b", ["pipeline.segments=2"])]
MORE = [("seq1f1b_interleaved", ["pipeline.segments=2", "pipeline.virtual_stages=2"]),
        ("planned", ["partition=planner"])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return pipeline_runs.train(tmp_path_factory.mktemp("ref"), [*LLAMA_SMALL, "pipeline.stages=1"])


@slow
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name,extra", CASES, ids=[c[0] for c in CASES])
def test_llama_trains_like_one_device_under_every_schedule(name, extra, stages, reference, tmp_path):
    run = pipeline_runs.train(tmp_path, [*LLAMA_SMALL, f"schedule={name}", f"pipeline.stages={stages}", *extra])
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert len(run["losses"]) == 5
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


@slow
@pytest.mark.parametrize("name,extra", MORE, ids=[c[0] for c in MORE])
def test_llama_under_the_other_synchronous_schedules(name, extra, reference, tmp_path):
    run = pipeline_runs.train(tmp_path, [*LLAMA_SMALL, f"schedule={name}", "pipeline.stages=2", *extra])
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


@slow
@pytest.mark.parametrize("name,extra", [("amdp", ["schedule.windows=1"]), ("pipedream", []), ("pipedream_2bw", [])])
def test_llama_trains_under_the_asynchronous_schedules(name, extra, tmp_path):
    """Stale weights by design: no one-device gradient to match, but the run trains."""
    run = pipeline_runs.train(tmp_path, [*LLAMA_SMALL, f"schedule={name}", "pipeline.stages=2", *extra,
                                         "trainer.steps=8", "runtime.dump_grads=false"])
    assert run["summary"]["status"] == "finished" and len(run["losses"]) == 8
    assert run["losses"][-1] < run["losses"][0] - 0.1


@slow
def test_a_config_json_trains_with_no_other_file(tmp_path):
    """A small Qwen2 written as a config.json (tied embeddings, Q/K/V biases): it trains
    on 2 ranks, and its gradients are one device's."""
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
              "max_position_embeddings": 128, "tie_word_embeddings": True, "architectures": ["Qwen2ForCausalLM"]}
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(config))
    common = ["model=hf_causal", f"model.config={tmp_path / 'qwen'}", "model.seq_len=32",
              *pipeline_runs.GPT_SMALL[4:], "trainer.timeline_step=null", "trainer.steps=3", "runtime.dump_grads=true"]
    tied = {"lm_head.weight": "model.embed_tokens.weight"}  # the last stage's copy of the tied embedding
    one = pipeline_runs.train(tmp_path / "one", [*common, "pipeline.stages=1"], tied=tied)
    two = pipeline_runs.train(tmp_path / "two", [*common, "pipeline.stages=2"], tied=tied)
    assert two["summary"]["world_size"] == 2
    pipeline_runs.assert_same_grads(two["grads"], one["grads"])  # both tied copies hold the whole gradient
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)


@slow
@pytest.mark.parametrize("name,extra,mode", [("zb_h1", [], "full"), ("seq1f1b", ["pipeline.segments=2"], "selective")])
def test_llama_recomputation_on_ranks(name, extra, mode, reference, tmp_path):
    run = pipeline_runs.train(tmp_path, [*LLAMA_SMALL, f"schedule={name}", "pipeline.stages=2", *extra,
                                         f"model.recompute={mode}"])
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


def test_the_profiler_measures_a_decoders_units():
    """partition=profiled and cost=profiled measure an hf_causal model as they do a GPT:
    the embedding, each decoder layer, the final norm and head."""
    from pipeflow.models.profiler import profile_model

    model = resolved("model.hf.num_hidden_layers=2", "model.hf.hidden_size=64", "model.hf.intermediate_size=96")
    prof = profile_model(model, 1, seq_len=16, warmup=0, repeats=1)
    assert [u.name for u in prof.units] == ["embedding", "block.0", "block.1", "head"]
    layer = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64)  # fp32: Q, O, K, V (2 kv heads), SwiGLU, norms
    assert prof.units[1].param_bytes == layer and prof.units[3].param_bytes == 4 * (64 + 256 * 64)
    assert all(u.forward_s > 0 and u.activation_bytes > 0 for u in prof.units)


def test_any_transformers_field_can_be_set_from_the_command_line(tmp_path):
    """model.hf is transformers' config, not a schema: a field the preset does not list
    is added (the front writes ++ for it), and reaches the model."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pipeflow.simulate", "model=llama_tiny", "model.hf.rope_theta=77.0",
                          "model.hf.num_hidden_layers=2", "pipeline.stages=2", "draw=false", "cost=unit",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"]["hf"]["rope_theta"] == 77.0 and summary["model"]["n_layer"] == 2
    assert load_hf_config(summary["model"]).rope_parameters["rope_theta"] == 77.0


def test_only_grouped_query_architectures_read_key_value_heads():
    """llama_tiny's num_key_value_heads stays in model.hf when model_type is overridden;
    GPT-NeoX ignores it, and so does the shape the cost model reads."""
    assert resolved("model.hf.model_type=gpt_neox")["n_kv_head"] == 4
    assert resolved()["n_kv_head"] == 2


@slow
def test_ranks_train_on_a_local_tokenizers_ids(tmp_path):
    size = _local_tokenizer(tmp_path / "tok")
    run = pipeline_runs.train(tmp_path / "run", [*LLAMA_SMALL, "pipeline.stages=2", f"data.tokenizer={tmp_path / 'tok'}",
                                                 f"model.hf.vocab_size={size}", "trainer.steps=2",
                                                 "runtime.dump_grads=false"])
    assert run["summary"]["status"] == "finished" and len(run["losses"]) == 2
    # the first loss is about ln(vocabulary): the model starts uniform over the tokenizer's ids
    assert abs(run["losses"][0] - math.log(size)) < 0.3
