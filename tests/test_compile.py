"""compile=true: each transformer block compiled on its own (pipeflow.models.regional),
composing with the synchronous schedules without the zero-bubble split; every other
combination refused before any rank starts, in one sentence naming the key."""

from __future__ import annotations

import pytest
import torch

from pipeflow.config import ConfigError, compose, prepare_simulation, prepare_training
from pipeflow.config.groups import compile as compile_group
from pipeflow.config.groups.compile import cpp_compiler

import pipeline_runs

slow = pytest.mark.slow
needs_compiler = pytest.mark.skipif(not cpp_compiler(),
                                    reason="compile=true on CPU ranks needs a C++ compiler (inductor's kernels)")


@pytest.mark.parametrize("over,says", [
    (["schedule=zb_h1"], "splits the backward into I and W"),
    (["schedule=pipedream"], "asynchronous policy"),
    (["schedule=seq1f1b", "pipeline.segments=2"], "sequence segments"),
    (["model.recompute=full"], "model.recompute=full"),
    (["pipeline.tensor_parallel=2", "pipeline.stages=1"], "pipeline.tensor_parallel=2"),
    (["pipeline.data_parallel=2", "pipeline.shard=optimizer"], "pipeline.shard=optimizer"),
    (["model=cbm_tiny", "data=image_text", "schedule=bapp"], "model.family=cbm"),
], ids=["zb_h1", "async", "segments", "recompute", "tensor", "shard", "branched"])
def test_compile_refuses_what_it_does_not_compose_with_yet(over, says):
    cfg = compose("train", ["compile=true", "pipeline.stages=2", *over])
    with pytest.raises(ConfigError, match="^compile=true: ") as err:
        prepare_training(cfg)
    assert says in str(err.value) and "compile=false" in str(err.value)


def test_a_cpu_run_without_a_cpp_compiler_is_refused_and_a_gpu_run_needs_none(monkeypatch):
    """Inductor builds CPU kernels with a C++ compiler; CUDA's it builds with Triton."""
    from pipeflow.config.prepare import generate_schedule

    cfg = compose("train", ["compile=true", "pipeline.stages=2"])
    schedule = generate_schedule(cfg)
    monkeypatch.setattr(compile_group, "cpp_compiler", lambda: None)
    with pytest.raises(ConfigError, match="compile=true: compiling for CPU ranks needs a C\\+\\+ compiler"):
        compile_group.check_compile(cfg, schedule, on_gpus=False)
    compile_group.check_compile(cfg, schedule, on_gpus=True)  # (no refusal)


def test_the_simulator_refuses_compile():
    with pytest.raises(ConfigError, match="compile=true: pipeflow-simulate prices eager execution only"):
        prepare_simulation(compose("simulate", ["compile=true"]))


def test_compile_blocks_compiles_each_block_in_place_and_keeps_the_parameters():
    from omegaconf import OmegaConf

    from pipeflow.models import gpt
    from pipeflow.models.regional import blocks, compile_blocks, is_compiled

    cfg = OmegaConf.to_container(compose("train", ["model=gpt_tiny"]).model, resolve=True)
    stage = gpt.build_stage(cfg, [2, 2], 1, seed=3)
    names = [n for n, _ in stage.named_parameters()]
    assert compile_blocks(stage) == 2 and all(is_compiled(b) for b in blocks(stage))
    assert [n for n, _ in stage.named_parameters()] == names  # optimizers and checkpoints see the same tensors
    assert not is_compiled(stage.ln_f)  # the head stays eager


@slow
@needs_compiler
def test_compiled_blocks_train_to_the_eager_gradients_and_losses(tmp_path):
    """GPT 1F1B on 2 CPU ranks, fp32, dropout off: compile=true's gradients after one step
    and losses over three are the eager run's (inductor's fused kernels round apart:
    1e-4 relative)."""
    small = [*pipeline_runs.GPT_SMALL, "model.dropout=0", "trainer.timeline_step=null", "trainer.steps=3",
             "runtime.dump_grads=true", "schedule=1f1b", "pipeline.stages=2"]
    runs = {c: pipeline_runs.train(tmp_path / c, [*small, f"compile={c}"], tied=pipeline_runs.GPT_TIED)
            for c in ("false", "true")}
    want, got = runs["false"]["grads"], runs["true"]["grads"]
    assert got.keys() == want.keys() and want
    for name, copies in want.items():
        for a, b in zip(got[name], copies):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=name)
    assert runs["true"]["losses"] == pytest.approx(runs["false"]["losses"], rel=1e-4)
