"""pipeline.tensor_parallel (issue 35): each device's stages split across T ranks,
Megatron style (column- and row-parallel projections, a vocabulary-parallel embedding
and head with a parallel cross-entropy; with pipeline.sequence_parallel the residual
stream, the norms and the stages' messages on 1/T of the tokens), under every
synchronous schedule: the single device's gradients (each piece put back together)
and its losses, on real CPU ranks over gloo."""

from __future__ import annotations

import pytest
import torch

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_training

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out

STEPS = ["trainer.steps=5", "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null",
         "logger=none", "runtime.dump_grads=true", "optim.warmup_steps=2"]
SHAPE = ["model.seq_len=32", "pipeline.microbatches=4", "pipeline.microbatch_size=2"]
MODELS = {"gpt_tiny": pipeline_runs.GPT_TIED, "llama_tiny": None}
SCHEDULES = [("1f1b", []), ("zb_h1", []), ("interleaved_1f1b", ["pipeline.virtual_stages=2"]),
             ("seq1f1b", ["pipeline.segments=2"])]
# BERT's key bias gets no gradient but rounding (a softmax does not see a shift of every
# score): compared against the whole model's gradients' scale, as every other tensor is
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def _close(scale: float):
    def close(got, want, name):
        torch.testing.assert_close(got, want, rtol=TOLERANCE["rtol"],
                                   atol=TOLERANCE["atol"] * max(float(want.abs().max()), scale), msg=name)
    return close


def _scale(grads: dict) -> float:
    return max(float(g[0].abs().max()) for g in grads.values()) * 1e-3


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One device per model (the global batch of two replicas for the data-parallel case), 5 steps."""
    root = tmp_path_factory.mktemp("tp_ref")
    out = {}
    for model, tied in MODELS.items():
        out[model] = pipeline_runs.train(root / model, [f"model={model}", *SHAPE, *STEPS, "pipeline.stages=1"], tied)
    out["gpt_tiny/dp2"] = pipeline_runs.train(root / "dp2", ["model=gpt_tiny", *SHAPE, *STEPS, "pipeline.stages=1",
                                                             "pipeline.microbatches=8"], MODELS["gpt_tiny"])
    return out


def _check(run: dict, ref: dict, world: int, msg: str) -> None:
    assert run["summary"]["world_size"] == world and run["summary"]["tensor_parallel"] == 2, msg
    pipeline_runs.assert_same_grads(run["grads"], ref["grads"], close=_close(_scale(ref["grads"])), msg=msg)
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), msg


@slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name,extra", SCHEDULES, ids=[s[0] for s in SCHEDULES])
@pytest.mark.parametrize("model", list(MODELS))
def test_two_stages_of_two_tensor_ranks_match_one_device(model, name, extra, sp, references, tmp_path):
    """2 stages x 2 tensor ranks on 4 ranks: the gradients of every parameter (the pieces
    of the split ones all-gathered) and 5 losses are the single device's, under 1F1B,
    ZB-H1 (its I/W split), interleaved 1F1B and Seq1F1B (its segments), with and without
    sequence parallelism."""
    run = pipeline_runs.train(tmp_path, [f"model={model}", *SHAPE, *STEPS, f"schedule={name}", *extra,
                                         "pipeline.stages=2", "pipeline.tensor_parallel=2",
                                         f"pipeline.sequence_parallel={str(sp).lower()}"], MODELS[model])
    assert run["summary"]["sequence_parallel"] is sp
    _check(run, references[model], 4, f"{model} {name} sp={sp}")


@slow
@pytest.mark.parametrize("sp,shard", [(False, "none"), (True, "gradients")])
def test_data_parallel_tensor_parallel_pipelines_match_one_device(sp, shard, references, tmp_path):
    """The device mesh's three dimensions, 2 x 2 x 2 on 8 ranks (1F1B): the single
    device's gradients and losses on the global batch; with ZeRO-2 over the replicas the
    clip norm counts each parameter once (a norm's weight, which every tensor rank holds
    whole, among the slices of all of them)."""
    run = pipeline_runs.train(tmp_path, ["model=gpt_tiny", *SHAPE, *STEPS, "schedule=1f1b", "pipeline.stages=2",
                                         "pipeline.tensor_parallel=2", "pipeline.data_parallel=2",
                                         f"pipeline.sequence_parallel={str(sp).lower()}", f"pipeline.shard={shard}"],
                              MODELS["gpt_tiny"])
    assert run["summary"]["data_parallel"] == 2
    _check(run, references["gpt_tiny/dp2"], 8, f"dp2 sp={sp} shard={shard}")


# the other families: BERT (bidirectional, post-norm, a biased MLM head), and Hugging
# Face decoders with biases (Qwen2), a sliding window (Mistral), fused per-head Q/K/V
# (GPT-NeoX), GPT-2's Conv1D, and grouped-query heads fewer than the tensor ranks
# (llama_tiny's 2 key/value heads on 4 ranks: each held by two, their gradients summed)
FAMILIES = {
    "bert": (["model=bert_tiny"], {"cls.decoder.weight": "embeddings.word_embeddings.weight"}, 2),
    "qwen2": (["model=qwen2_tiny"], {"lm_head.weight": "model.embed_tokens.weight"}, 2),
    "mistral": (["model=llama_tiny", "model.hf.model_type=mistral", "+model.hf.sliding_window=8"], None, 2),
    "gpt_neox": (["model=llama_tiny", "model.hf.model_type=gpt_neox"], None, 2),
    "hf_gpt2": (["model=llama_tiny", *pipeline_runs.SMALL_HF["gpt2"]], None, 2),
    "llama_kv_replicated": (["model=llama_tiny"], None, 4),
}


@slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_splits_across_tensor_ranks(family, tmp_path):
    """One schedule each (ZB-H1, sequence parallel): the single device's gradients and losses."""
    over, tied, t = FAMILIES[family]
    common = [*over, *SHAPE, *STEPS, "trainer.steps=2"]
    ref = pipeline_runs.train(tmp_path / "ref", [*common, "pipeline.stages=1"], tied)
    run = pipeline_runs.train(tmp_path / "tp", [*common, "schedule=zb_h1", "pipeline.stages=2",
                                                f"pipeline.tensor_parallel={t}", "pipeline.sequence_parallel=true"],
                              tied)
    assert run["summary"]["world_size"] == 2 * t
    pipeline_runs.assert_same_grads(run["grads"], ref["grads"], close=_close(_scale(ref["grads"])), msg=family)
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)


@pytest.mark.parametrize("over,says", [
    (["schedule=amdp", "pipeline.tensor_parallel=2"], "pipeline.tensor_parallel=2: schedule 'amdp' updates weights asynchronously"),
    (["model=cbm_tiny", "schedule=gpipe", "pipeline.tensor_parallel=2"],
     "pipeline.tensor_parallel=2: a concurrent-branch model's stages"),
    (["pipeline.sequence_parallel=true"], "pipeline.sequence_parallel=true: it splits the sequence"),
    (["pipeline.tensor_parallel=3"], "pipeline.tensor_parallel=3: model 'gpt_tiny' has 4 attention heads"),
    (["model=llama_tiny", "pipeline.tensor_parallel=4", "model.hf.intermediate_size=342"],
     "pipeline.tensor_parallel=4: model 'llama_tiny''s MLP width 342"),
    (["pipeline.tensor_parallel=2", "pipeline.sequence_parallel=true", "model.seq_len=33"],
     "pipeline.sequence_parallel=true: model.seq_len=33 tokens do not split"),
])
def test_a_split_the_model_cannot_take_is_refused_before_any_rank_starts(over, says):
    """Nothing starts: the sentence names the key and why (pipeflow.config.tensor_degree)."""
    with pytest.raises(ConfigError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        prepare_training(compose("train", over))


def test_segments_given_that_do_not_split_are_refused():
    """Lengths given by hand (pipeflow-simulate's cost.segment_lengths) are taken as they
    are: one that the tensor ranks cannot split is refused, naming it."""
    from pipeflow.config import prepare_simulation

    with pytest.raises(ConfigError, match="^pipeline.sequence_parallel=true: sequence segment 0 has 33 tokens"):
        prepare_simulation(compose("simulate", ["model=gpt_tiny", "model.seq_len=64", "schedule=seq1f1b",
                                                "pipeline.segments=2", "pipeline.tensor_parallel=2",
                                                "pipeline.sequence_parallel=true", "topology=local_cpu",
                                                "cost.segment_lengths=[33,31]"]))


def test_sequence_parallel_segments_split_into_the_tensor_ranks_slices():
    """schedule.split=compute with sequence parallelism: the run's segments are the split
    rounded to multiples of T (planning.seqsplit.granular), which the runtime trains and
    the simulator prices alike, where the unrounded split would be refused."""
    over = ["schedule=seq1f1b", "schedule.split=compute", "pipeline.segments=2", "model.seq_len=128",
            "pipeline.tensor_parallel=2", "pipeline.sequence_parallel=true"]
    plan = prepare_training(compose("train", over)).plan
    lengths = plan.segment_lengths
    assert lengths == [68, 60]  # the compute split's [67, 61], each a multiple of 2
    from pipeflow.config import prepare_simulation

    assert prepare_simulation(compose("simulate", [*over, "topology=local_cpu"])).segment_lengths == lengths
