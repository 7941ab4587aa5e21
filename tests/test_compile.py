"""compile=true: each transformer block compiled on its own (pipeflow.models.regional),
composing with every schedule (the zero-bubble split's I and W through blocks whose weight
products stay eager), recomputation, segments, tensor parallelism, sharding and every
family: trained to the eager run's losses (and gradients); what cannot compile (CPU ranks
without a C++ compiler, a simulation without a calibration's times) refused before any
rank starts, in one sentence naming the key."""

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


@pytest.mark.parametrize("over", [
    ["schedule=zb_h1"], ["schedule=zb_v", "pipeline.virtual_stages=2"], ["schedule=dualpipe_v", "pipeline.virtual_stages=2"],
    ["schedule=pipedream"], ["schedule=amdp"], ["schedule=seq1f1b", "pipeline.segments=2"],
    ["model.recompute=full"], ["model.recompute=selective"], ["pipeline.tensor_parallel=2", "pipeline.stages=1"],
    ["pipeline.tensor_parallel=2", "pipeline.sequence_parallel=true", "pipeline.stages=1"],
    ["pipeline.data_parallel=2", "pipeline.shard=optimizer"], ["pipeline.data_parallel=2", "pipeline.shard=full"],
    ["model=cbm_tiny", "data=image_text", "schedule=bapp"], ["model=bert_tiny", "data=mlm_corpus"],
    ["model=llama_tiny", "precision=bf16"],
], ids=["zb_h1", "zb_v", "dualpipev", "pipedream", "amdp", "segments", "full", "selective", "tensor", "sequence",
        "zero1", "zero3", "branched", "bert", "llama_bf16"])
def test_compile_composes_with_every_schedule_and_feature(over):
    """What compile=true refused until issue 63 now prepares (and trains: the runs below)."""
    plan = prepare_training(compose("train", ["compile=true", "pipeline.stages=2", *over])).plan
    assert plan.compile


def test_a_cpu_run_without_a_cpp_compiler_is_refused_and_a_gpu_run_needs_none(monkeypatch):
    """Inductor builds CPU kernels with a C++ compiler; CUDA's it builds with Triton."""
    from pipeflow.config.assembly import generate_schedule

    cfg = compose("train", ["compile=true", "pipeline.stages=2"])
    schedule = generate_schedule(cfg)
    monkeypatch.setattr(compile_group, "cpp_compiler", lambda: None)
    with pytest.raises(ConfigError, match="compile=true: compiling for CPU ranks needs a C\\+\\+ compiler"):
        compile_group.check_compile(cfg, schedule, on_gpus=False)
    compile_group.check_compile(cfg, schedule, on_gpus=True)  # (no refusal)


def test_the_simulator_prices_compile_only_by_a_calibration():
    """A compiled block's kernels are not the eager operators a device profile or the
    formulas price: pipeflow-simulate compile=true takes a calibration's times."""
    for cost in ("analytic", "profiled"):
        with pytest.raises(ConfigError, match=f"compile=true: cost.name={cost} prices eager kernels"):
            prepare_simulation(compose("simulate", ["compile=true", f"cost={cost}"]))


def test_the_compile_mode_follows_the_split():
    from pipeflow.config.assembly import generate_schedule

    one = generate_schedule(compose("train", ["schedule=1f1b"]))
    split = generate_schedule(compose("train", ["schedule=zb_h1"]))
    assert (split.compile_mode(False), one.compile_mode(True), split.compile_mode(True)) == \
        ("none", "blocks", "eager_products")


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
    """GPT 1F1B with full recomputation (each block compiled inside its region) on 2 CPU
    ranks, fp32, dropout off: compile=true's gradients after one step and losses over
    three are the eager run's (inductor's fused kernels round apart: 1e-4 relative)."""
    small = [*pipeline_runs.GPT_SMALL, "model.dropout=0", "trainer.timeline_step=null", "trainer.steps=3",
             "runtime.dump_grads=true", "schedule=1f1b", "pipeline.stages=2", "model.recompute=full"]
    runs = {c: pipeline_runs.train(tmp_path / c, [*small, f"compile={c}"], tied=pipeline_runs.GPT_TIED)
            for c in ("false", "true")}
    want, got = runs["false"]["grads"], runs["true"]["grads"]
    assert got.keys() == want.keys() and want
    for name, copies in want.items():
        for a, b in zip(got[name], copies):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=name)
    assert runs["true"]["losses"] == pytest.approx(runs["false"]["losses"], rel=1e-4)


@needs_compiler
def test_the_split_through_compiled_blocks_runs_each_product_once():
    """The zero-bubble split through blocks compiled with their weight products eager
    (compile_blocks(eager_products=True)): I then W computes B's gradients (B through
    the same compiled blocks) and runs B's matrix products, each once, by the profiler's
    count of each product kernel and its shapes (a product inside the compiled code
    would make its weight gradient in I and again in W); I touches no weight gradient."""
    from collections import Counter

    from test_split_backward import _case
    from torch.profiler import ProfilerActivity, profile

    from pipeflow.models.regional import blocks, compile_blocks, is_compiled
    from pipeflow.runtime.backward import backward_input, backward_weight

    module, run = _case("llama_middle")  # (nn.Linear's products; GPT-2's Conv1D trains split in the runs below)
    assert compile_blocks(module, eager_products=True) == len(blocks(module)) > 0
    assert all(is_compiled(b) for b in blocks(module))
    params = [p for p in module.parameters() if p.requires_grad]
    kernels = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")

    def products(fn) -> Counter:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
        return Counter((e.name, tuple(sorted(d for shape in e.input_shapes for d in shape)))
                       for e in prof.events() if e.name in kernels)

    leaves, out, g = run()
    torch.autograd.backward(out, grad_tensors=g)  # (the compiles, outside the counts)
    module.zero_grad(set_to_none=True)
    leaves, out, g = run()
    full = products(lambda: torch.autograd.backward(out, grad_tensors=g))
    want_inputs = [x.grad for x in leaves]
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    leaves, out, g = run()
    box = {}
    in_i = products(lambda: box.update(zip(("inputs", "pending"), backward_input(out, g, leaves, params))))
    assert all(p.grad is None for p in params), "I must not touch the weight gradients"
    in_w = products(lambda: backward_weight(box["pending"], params))
    assert full and in_w, "B and W run matrix products"
    assert in_i + in_w == full, "I + W run B's matrix products, each once"
    for a, b in zip(box["inputs"], want_inputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    got = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


# the acceptance's schedules beyond the 1F1B run above, over the four families and with
# selective recomputation, in four pairs of runs (a run compiles its blocks in 10-20 s
# on 2 cores: the pairs cover the grid rather than fill it; Llama's interleaved Seq1F1B
# runs virtual stages and segments at once, the branched model BAPP's two pipelines;
# test_compile_composes_with_every_schedule_and_feature prepares the rest)
TRAINED = {
    "gpt-zb_h1-selective": ["schedule=zb_h1", "model.recompute=selective"],
    "llama-seq1f1b-interleaved": ["model=llama_tiny", "model.seq_len=64", "schedule=seq1f1b_interleaved",
                                  "pipeline.virtual_stages=2", "pipeline.segments=2"],
    "bert-chimera": ["model=bert_tiny", "data=mlm_corpus", "model.seq_len=64", "schedule=chimera"],
    "cbm-bapp": ["model=cbm_tiny", "data=image_text", "schedule=bapp"],
}


@slow
@needs_compiler
@pytest.mark.parametrize("name", list(TRAINED))
def test_compiled_blocks_train_every_family_and_schedule_to_the_eager_losses(name, tmp_path):
    """compile=true against compile=false on the same run, fp32, dropout off: the losses
    of three steps agree (the later ones follow the gradients of the earlier)."""
    over = [*pipeline_runs.GPT_SMALL, "model.dropout=0", "trainer.timeline_step=null", "trainer.steps=3",
            "pipeline.stages=2", *TRAINED[name]]
    if not name.startswith("gpt"):
        over = [o for o in over if not o.startswith(("model.n_", "model.seq_len=64"))] + \
               [o for o in TRAINED[name] if o.startswith("model.seq_len")]
    runs = {c: pipeline_runs.train(tmp_path / c, [*over, f"compile={c}"]) for c in ("false", "true")}
    assert len(runs["false"]["losses"]) == 3
    assert runs["true"]["losses"] == pytest.approx(runs["false"]["losses"], rel=1e-4)
