"""CUDA's code paths, taken on CPU (issue 59; ``pipeflow.device_paths``): each branch a GPU
run takes computes what the CPU branch computes, at fp32 and under CPU autocast (bf16),
so that CI, which has no GPU, runs their arithmetic. The kernels themselves are CUDA's
alone: ``tests/test_cuda.py`` runs them where a GPU is lent."""

from __future__ import annotations

import pytest
import torch

from pipeflow import device_paths
from pipeflow.device_paths import cuda_path, cuda_paths
from pipeflow.models import attention as attn

pytestmark = pytest.mark.filterwarnings("ignore:.*(Flash|Memory efficient|CuDNN).*:UserWarning")


def test_the_switch_names_its_paths_and_refuses_others():
    assert not cuda_path("attention", torch.device("cpu")) and cuda_path("attention", "cuda")
    with cuda_paths("staging"):
        assert cuda_path("staging", torch.device("cpu")) and not cuda_path("attention", "cpu")
        assert device_paths.emulated() == ("staging",)
    with cuda_paths():
        assert device_paths.emulated() == device_paths.PATHS
    assert device_paths.emulated() == ()
    with pytest.raises(ValueError, match=r"runtime.cuda_paths=kernels: allowed values: attention, staging, memory, reads, all"):
        device_paths.check(["kernels"])


def _inputs(queries: int, keys: int, heads: int, kv_heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, queries, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, keys, 16, generator=gen, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(2, heads, queries, 16, generator=gen)


def _attend(q, k, v, g, pattern, window, dtype):
    """Output and gradients of one call, at fp32 or under CPU autocast; Q and K fp32 and V
    16-bit at 16 bits, as a rotary model hands them over (the rotation's output is fp32)."""
    for t in (q, k, v):
        t.grad = None
    if dtype is torch.float32:
        out = attn.attention(q, k, v, pattern, window=window)
    else:
        with torch.autocast("cpu", dtype=dtype):
            out = attn.attention(q, k, v.to(dtype), pattern, window=window)
    out.backward(g.to(out.dtype))
    return [out.detach().float(), *(t.grad.clone() for t in (q, k, v))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["whole", "segment", "window"])
def test_cudas_attention_branches_compute_what_the_cpu_branch_does(case, dtype):
    """Grouped-query attention (4 heads over 2): a whole causal sequence (CUDA: K and V
    repeated at fp32, flash attention's groups at 16 bits), a later segment, queries
    16..31 over 32 keys (torch's lower-right causal bias: the path that crashed on an
    H200 at bf16, its Q and K fp32 and V 16-bit), and a sliding window of 5 over that
    segment (a mask, K and V repeated)."""
    queries, offset, window = {"whole": (32, 0, None), "segment": (16, 16, None), "window": (16, 16, 5)}[case]
    q, k, v, g = _inputs(queries, 32, 4, 2)
    pattern = attn.Pattern("sdpa", causal=True, offset=offset)
    want = _attend(q, k, v, g, pattern, window, dtype)
    with cuda_paths("attention"):
        got = _attend(q, k, v, g, pattern, window, dtype)
    eager = _attend(q, k, v, g, attn.Pattern("eager", causal=True, offset=offset), window, dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype is torch.float32 else {"rtol": 0.02, "atol": 0.02}
    for a, b, c in zip(got, want, eager):
        torch.testing.assert_close(a, b, **tol)
        torch.testing.assert_close(a, c, **tol)


def test_a_llamas_later_segment_trains_at_bf16_through_cudas_branch():
    """The H200's crash, on CPU: a Llama (rotary positions, grouped-query attention) in two
    segments under autocast, the second through CUDA's lower-right causal bias, whose
    dtype check saw fp32 Q and K beside a bf16 V before the kernel's inputs were cast as
    autocast casts them. The same outputs and weight gradients as the CPU branch."""
    from test_attention import HF, IDS, _model

    from pipeflow.models import hf_causal

    model = _model("model=llama_tiny", "model.seq_len=32", *HF["llama"])
    got = []
    for emulated in ((), ("attention",)):
        stage = hf_causal.build_model({**model, "attention": "sdpa"}, seed=3)
        with device_paths.cuda_paths(*emulated) if emulated else torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x0, kv0 = stage.forward_segment(IDS[:, :12], 0, None)
                x1, _ = stage.forward_segment(IDS[:, 12:], 12, kv0)
            torch.cat([x0, x1], 1).float().square().mean().backward()
        attn_weight = stage.model.layers["0"].self_attn.k_proj.weight.grad
        got.append((torch.cat([x0, x1], 1).float().detach(), attn_weight))
    for a, b in zip(*got):
        assert float((a - b).norm() / b.norm()) < 0.02


def _profiled_step(gpt_stage, optimizer, ids):
    """One profiled forward, backward and AdamW step of a stage with its tags, as a rank runs it."""
    from pipeflow.models.gpt import lm_loss
    from pipeflow.runtime.saved_bytes import SavedBytes
    from pipeflow.runtime.memory_profile import action, profile_step, tag_stage

    meter = SavedBytes({p.untyped_storage().data_ptr() for p in gpt_stage.parameters()})
    with profile_step(torch.device("cpu")) as step:
        with action("0F0"), meter.hooks():
            loss = lm_loss(gpt_stage(ids), ids, ids.numel())
        with action("0B0"):
            loss.backward()
            del loss
        with action("0S"):
            optimizer.step()
            tag_stage(gpt_stage, optimizer)
            optimizer.zero_grad(set_to_none=True)
    return step


def test_a_cpu_step_read_as_the_cuda_allocators_history_holds_what_the_cpu_replay_holds(monkeypatch):
    """runtime.memory=profile through CUDA's replay (a GPT stage's bf16 step, its casts
    included): the step's allocations as the allocator's trace, its tags and actions
    placed by the counts of allocations and frees before them. At each event's own size
    it is the CPU replay exactly (the same peak, split, per-category peaks and action);
    in CUDA's 512-byte blocks, what profile_step reports under
    runtime.cuda_paths=[memory], more by each allocation's rounding."""
    from test_attention import IDS, _model

    from pipeflow.models import gpt
    from pipeflow.runtime import memory_profile as mp
    from pipeflow.runtime.memory_replay import replay

    stage = gpt.build_model(_model("model=gpt_tiny", "model.seq_len=32"), seed=1)
    opt = torch.optim.AdamW(stage.parameters())
    stage(IDS).float().sum().backward()
    opt.step()  # AdamW's moments exist before the profiled step, as in a run's last
    opt.zero_grad(set_to_none=True)
    seen = {}
    analyse = mp.analyse

    def both(result, device):  # the same events, replayed both ways
        events, actions, _ = mp._events(result, device)
        seen["cpu"] = replay(list(events), actions)
        seen["as_cuda"] = mp.as_allocator_history(events, actions, block=lambda n: n)
        return analyse(result, device)

    monkeypatch.setattr(mp, "analyse", both)
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_paths("memory"):
        blocks = _profiled_step(stage, opt, IDS)
    cpu, as_cuda = seen["cpu"], seen["as_cuda"]
    assert as_cuda.peak_bytes == cpu.peak_bytes > 0 and as_cuda.at_peak == cpu.at_peak
    assert as_cuda.category_peaks == cpu.category_peaks and as_cuda.peak_action == cpu.peak_action
    assert min(cpu.at_peak[c] for c in ("parameters", "optimizer_state", "casts")) > 0
    assert all(v % 512 == 0 for v in blocks.at_peak.values())
    assert cpu.peak_bytes < blocks.peak_bytes and blocks.at_peak["parameters"] >= cpu.at_peak["parameters"]


@pytest.mark.slow  # starts ranks
def test_a_llama_seq1f1b_run_trains_at_bf16_through_every_cuda_path(tmp_path):
    """The H200's failing run, on CPU ranks taking every CUDA path (its attention, its
    messages through host memory in posted order, its memory replay): it trains, to the
    gradients and losses of the same run through the CPU paths (bf16's tolerance: the two
    attention kernels sum in their own orders), and its profiled step is in CUDA's
    512-byte blocks."""
    import pipeline_runs

    over = ["model=llama_tiny", "schedule=seq1f1b", "pipeline.segments=2", "pipeline.stages=2", "precision=bf16",
            "pipeline.microbatches=4", "pipeline.microbatch_size=2", "trainer.steps=2", "trainer.val_every=0",
            "trainer.timeline_step=null", "logger=none", "runtime.dump_grads=true"]
    cpu = pipeline_runs.train(tmp_path / "cpu", over)
    cuda = pipeline_runs.train(tmp_path / "cuda", [*over, "runtime.cuda_paths=[all]", "runtime.memory=profile"])
    assert cuda["summary"]["status"] == "finished" and cuda["losses"] == pytest.approx(cpu["losses"], rel=1e-2)

    def close(got, want, name):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=2e-2 * float(want.abs().max()), msg=name)

    pipeline_runs.assert_same_grads(cuda["grads"], cpu["grads"], close=close)
    for rank in cuda["summary"]["memory_profile"]:
        assert rank["peak_bytes"] > 0 and all(v % 512 == 0 for v in rank["at_peak"].values())
