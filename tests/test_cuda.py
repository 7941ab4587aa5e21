"""On a GPU (issue 59): what only CUDA runs, the kernels and the caching allocator, checked
against the same references as on CPU. Every test here is marked ``cuda`` and skipped,
with the reason, where no GPU is visible (CI has none); ``tests/test_device_paths.py``
runs CUDA's code paths' arithmetic on CPU instead.

    .venv/bin/python -m pytest -m cuda -q        # where a GPU is lent: the ranks share it (gloo)
"""

from __future__ import annotations

import pytest
import torch

import pipeline_runs
from test_attention import HF, IDS, _model, _run

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

GPU = ["runtime.device=cuda", "runtime.backend=gloo"]  # ranks share one GPU, messages through host memory
STEPS = ["trainer.steps=2", "trainer.val_every=0", "trainer.timeline_step=null", "logger=none",
         "runtime.dump_grads=true", "pipeline.microbatches=4", "pipeline.microbatch_size=2",
         "optim.warmup_steps=2"]
FAMILIES = {  # 4 layers at least: 2 stages x 2 virtual stages
    "gpt": ["model=gpt_tiny", "model.n_layer=4"],
    "llama": ["model=llama_tiny"],  # rotary positions, grouped-query attention (4 heads over 2)
    "bert": ["model=bert_tiny", "model.n_layer=4"],
    "cbm": ["model=cbm_tiny", "data=image_text"],
}
SCHEDULES = {"1f1b": [], "zb_h1": [], "interleaved_1f1b": ["pipeline.virtual_stages=2"],
             "seq1f1b": ["pipeline.segments=2"]}
RUNS = [(f, s) for f in FAMILIES for s in SCHEDULES
        if not (f == "bert" and s == "seq1f1b") and not (f == "cbm" and s in ("interleaved_1f1b", "seq1f1b"))]
TIED = {"gpt": pipeline_runs.GPT_TIED, "bert": {"cls.decoder.weight": "embeddings.word_embeddings.weight"}}


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    if name.endswith("key.bias"):  # zero but for rounding: softmax ignores a shift shared by every key
        assert torch.isfinite(got).all(), name
        return
    # bf16: a stage's output rounded for the wire, and flash attention's backward sums in
    # its own order, move each gradient by a few parts in a thousand of its scale
    torch.testing.assert_close(got, want, rtol=3e-2, atol=2e-2 * float(want.abs().max()), msg=name)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One single-device bf16 run on the GPU per family (trained on first use)."""
    runs: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in runs:
            runs[family] = pipeline_runs.train(
                tmp_path_factory.mktemp(f"ref-{family}"),
                [*FAMILIES[family], *STEPS, *GPU, "precision=bf16", "pipeline.stages=1"], tied=TIED.get(family))
        return runs[family]

    return get


@pytest.mark.parametrize("family,schedule", RUNS, ids=[f"{f}-{s}" for f, s in RUNS])
def test_every_family_trains_at_bf16_on_ranks_sharing_the_gpu(family, schedule, references, tmp_path):
    """1F1B, ZB-H1, interleaved 1F1B and Seq1F1B (a Llama's later segments through torch's
    lower-right causal bias: the H200's crash) on 2 ranks of one GPU: the single-device
    bf16 gradients and first loss."""
    ref = references(family)
    run = pipeline_runs.train(tmp_path, [*FAMILIES[family], *STEPS, *GPU, "precision=bf16", f"schedule={schedule}",
                                         "pipeline.stages=2", *SCHEDULES[schedule]], tied=TIED.get(family))
    assert run["summary"]["precision"] == "bf16"
    pipeline_runs.assert_same_grads(run["grads"], ref["grads"], close=_close, msg=f"{family} {schedule}")
    assert run["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-2)


def _on_gpu(module, inputs):
    return module.cuda(), tuple(t.cuda() for t in inputs)


@pytest.mark.parametrize("arch", list(HF))
def test_fused_equals_eager_attention_on_cuda(arch):
    """CUDA's kernels (memory-efficient attention at fp32, K and V repeated for grouped
    queries; the lower-right causal bias for a later segment) against the eager
    reference: outputs and every weight's gradient, whole sequences and two segments."""
    from pipeflow.models import hf_causal

    model = _model("model=llama_tiny", "model.seq_len=32", *HF[arch])
    got = {}
    for mode in ("eager", "sdpa"):
        module, inputs = _on_gpu(hf_causal.build_model({**model, "attention": mode}, seed=3), (IDS,))
        got[mode] = _run(module, inputs, segments=True)
    (out_e, grads_e, seg_e), (out_f, grads_f, seg_f) = got["eager"], got["sdpa"]
    torch.testing.assert_close(out_f, out_e, rtol=0, atol=1e-4)
    torch.testing.assert_close(seg_f, out_e, rtol=0, atol=1e-4)
    torch.testing.assert_close(seg_e, out_e, rtol=0, atol=1e-4)
    assert grads_f.keys() == grads_e.keys() and grads_e
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-3, atol=1e-5, msg=f"{arch} {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_equals_eager_in_half_precision_on_cuda(dtype):
    """Under CUDA autocast, a Llama (fp32 rotary Q and K, 16-bit V) in two segments, the
    later one through the lower-right causal bias: outputs and a key projection's gradient."""
    from pipeflow.models import hf_causal

    model = _model("model=llama_tiny", "model.seq_len=32")
    got = {}
    for mode in ("eager", "sdpa"):
        stage, (ids,) = _on_gpu(hf_causal.build_model({**model, "attention": mode}, seed=3), (IDS,))
        with torch.autocast("cuda", dtype=dtype):
            x0, kv0 = stage.forward_segment(ids[:, :12], 0, None)
            split = torch.cat([x0, stage.forward_segment(ids[:, 12:], 12, kv0)[0]], 1).float()
        split.square().mean().backward()
        got[mode] = (split.detach(), stage.model.layers["0"].self_attn.k_proj.weight.grad)
    for a, b in zip(got["sdpa"], got["eager"]):
        assert float((a - b).norm() / b.norm()) < 0.02


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("schedule", ["zb_h1", "seq1f1b"])
def test_recomputation_at_bf16_gives_the_gradients_of_none_on_cuda(schedule, mode, tmp_path):
    """A rerun on autograd's device thread (where the step's shared casts must survive its
    autocast context: models.recompute) gives the gradients of the forward it repeats."""
    over = [*FAMILIES["llama"], *STEPS, *GPU, "precision=bf16", f"schedule={schedule}", "pipeline.stages=2",
            *SCHEDULES[schedule]]
    none = pipeline_runs.train(tmp_path / "none", over)
    rerun = pipeline_runs.train(tmp_path / mode, [*over, f"model.recompute={mode}"])
    pipeline_runs.assert_same_grads(rerun["grads"], none["grads"], close=_close, msg=mode)
    assert rerun["summary"]["peak_saved_bytes"][0] < none["summary"]["peak_saved_bytes"][0]


def test_the_profiled_peak_is_the_allocators_own(tmp_path):
    """runtime.memory=profile on the GPU, with expandable segments (runtime's default):
    each rank's replay of the allocator's history peaks at ``max_memory_allocated``, to
    the byte (every block its size asked for rounded to 512). A 4k-token Llama stage,
    whose tensors are several MiB each: without expandable segments the blocks' slack
    (up to 1 MiB each) stood 37-100 MiB above the replay on an H200."""
    over = ["model=llama_tiny", "model.hf.hidden_size=512", "model.hf.intermediate_size=1376",
            "model.hf.num_attention_heads=8", "model.hf.num_key_value_heads=2", "model.hf.max_position_embeddings=4096",
            "model.seq_len=4096", "pipeline.microbatch_size=1", "pipeline.microbatches=4", "trainer.steps=2",
            "trainer.val_every=0", "logger=none", "runtime.memory=profile", "precision=bf16", "pipeline.stages=2",
            *GPU]
    run = pipeline_runs.train(tmp_path, over)
    for rank in run["summary"]["memory_profile"]:
        assert rank["peak_bytes"] == rank["allocator_peak_bytes"] > 0, rank


def test_a_gpu_steps_walk_makes_no_host_synchronisation(tmp_path):
    """Issue 63's check: from the second step on, one GPU rank walks each step under
    torch.cuda.set_sync_debug_mode("error") up to the reads at its end (runtime.sync_check).
    At bf16 (the clip's factor on the device, the norm and the loss read once the step is
    launched) it trains; at fp16 the loss scaler reads the norm mid-step to decide whether
    to skip the update, and the same check fails that run, naming the synchronising call."""
    from pipeflow.runtime.launch import JobFailed

    over = ["model=gpt_tiny", "pipeline.stages=1", "runtime.device=cuda", "runtime.backend=nccl",
            "runtime.sync_check=true", "trainer.steps=3", "trainer.val_every=0", "trainer.timeline_step=null",
            "logger=none", "pipeline.microbatches=4", "pipeline.microbatch_size=2"]
    run = pipeline_runs.train(tmp_path / "bf16", [*over, "precision=bf16"])
    assert run["summary"]["status"] == "finished" and len(run["losses"]) == 3
    with pytest.raises(JobFailed, match="synchroniz"):
        pipeline_runs.train(tmp_path / "fp16", [*over, "precision=fp16"])
