"""Activation recomputation (issue 18): model.recompute=full and selective give the
gradients of none, for every model family and with the zero-bubble I/W split, keep
fewer saved activations, and train the same on real ranks for every runtime schedule
family."""

from __future__ import annotations


import pytest
import torch

import pipeline_runs
from pipeflow.config import compose
from pipeflow.config import RECOMPUTE
from pipeflow.models import bert, cbm, gpt
from pipeflow.models.recompute import MODES, apply_recompute
from pipeflow.runtime.backward import accumulators, backward_input, backward_weight
from pipeflow.runtime.saved_bytes import SavedBytes

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out


def test_the_config_layer_knows_the_same_modes():
    assert RECOMPUTE == MODES


def _model(name: str, **over) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose("train", [f"model={name}"]).model, resolve=True)
    cfg.update(over)
    return cfg


def _gpt_stage(mode: str, stage: int = 1, name: str = "gpt_tiny", **over):
    return gpt.build_stage(_model(name, recompute=mode, **over), [2, 2], stage, seed=3)


def _grads(module: torch.nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _run(module, x, g, split: bool, segments: bool = False):
    x = x.clone().requires_grad_(True)
    meter = SavedBytes({p.untyped_storage().data_ptr() for p in module.parameters()})
    with meter.hooks():
        out = module.forward_segment(x, 0)[0] if segments else module(x)
    saved = meter.step_peak
    params = list(module.parameters())
    if split:
        grads, pending = backward_input(out, g, [x], params, accumulators(params))
        backward_weight(pending, params)
        return grads[0], _grads(module), saved
    torch.autograd.backward(out, g)
    return x.grad, _grads(module), saved


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("segments", [False, True], ids=["whole", "segment"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt_recomputation_gives_the_same_gradients_and_keeps_less(attention, segments, split):
    """With fused and eager attention, whole sequences and a segment, a full backward and
    the zero-bubble I then W: full and selective recomputation give none's gradients and
    keep less (the Hugging Face decoders': tests/test_hf_causal.py)."""
    torch.manual_seed(0)
    x, g = torch.randn(2, 64, 128), torch.randn(2, 64, 256)
    results = {mode: _run(_gpt_stage(mode, attention=attention), x, g, split, segments) for mode in MODES}
    gi, want, saved_none = results["none"]
    for mode in ("full", "selective"):
        got_i, got, saved = results[mode]
        torch.testing.assert_close(got_i, gi, rtol=1e-6, atol=1e-9)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-9, msg=name)
        assert saved < saved_none, (mode, saved, saved_none)
    assert results["full"][2] < results["selective"][2]  # full keeps the least


@slow  # a gpt_small stage: seconds
def test_full_recomputation_keeps_at_most_a_quarter_on_gpt_small_stage_0():
    """Issue 18's acceptance, measured with the runtime's own meter on a gpt_small first
    stage (6 of 12 layers), one microbatch of 2 sequences."""
    ids = torch.randint(0, 256, (2, 256))
    saved = {}
    for mode in ("none", "full"):
        stage = gpt.build_stage(_model("gpt_small", recompute=mode, seq_len=256), [6, 6], 0, seed=1)
        meter = SavedBytes({p.untyped_storage().data_ptr() for p in stage.parameters()})
        with meter.hooks():
            out = stage(ids)
        saved[mode] = meter.step_peak
        out.sum().backward()
    assert saved["full"] * 4 <= saved["none"], saved


def _same_grads_in_every_mode(build, run) -> None:
    ref = None
    for mode in MODES:
        module = build(mode)
        run(module).float().pow(2).mean().backward()
        grads = _grads(module)
        ref = ref or grads
        assert grads.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-6, atol=1e-9, msg=f"{mode} {name}")


def test_bert_recomputation_gives_the_same_gradients():
    torch.manual_seed(0)
    cfg = _model("bert_tiny")
    x = torch.randn(2, cfg["seq_len"], cfg["n_embd"])
    _same_grads_in_every_mode(lambda m: bert.build_stage(dict(cfg, recompute=m), [2, 2], 1, seed=2),
                              lambda module: module(x.clone().requires_grad_(True)))


def test_cbm_recomputation_covers_attention_and_cross_attention():
    """The whole two-branch model (its interaction blocks cross-attend) and one
    pipeline stage of it, as the runtime builds them."""
    torch.manual_seed(0)
    cfg = _model("cbm_tiny")
    image, ids = torch.randn(2, 1, 8, 8), torch.randint(0, 256, (2, 32))
    _same_grads_in_every_mode(
        lambda m: apply_recompute(cbm.build_cbm_model(cfg, seed=2), m, (cbm.Block,)), lambda model: model(image, ids))
    _, specs = cbm.cbm_stage_graph(cfg, 2, 2)
    _same_grads_in_every_mode(lambda m: cbm.build_cbm_stage(dict(cfg, recompute=m), specs, 0, seed=2),
                              lambda stage: stage(image))
    wrapped = [b for b in cbm.build_cbm_model(cfg, 2).modules() if isinstance(b, cbm.Block)]
    assert wrapped and all("forward" not in vars(b) for b in wrapped)  # none: nothing wrapped
    stage = cbm.build_cbm_stage(dict(cfg, recompute="selective"), specs, 0, seed=2)
    assert all("self_attend" in vars(b) and "forward" not in vars(b)
               for b in stage.modules() if isinstance(b, cbm.Block))


def test_a_region_keeps_the_random_state_only_where_its_forward_drew_from_it():
    """With dropout a rerun must draw the forward's masks again (the same gradients as
    none); without, the region lets its generator's state go (5056 bytes a region and
    microbatch on CPU, which the memory model does not count)."""
    from pipeflow.models import recompute

    kept = []
    real = recompute._Region.forget_unused_rng

    def spy(region):
        real(region)
        kept.append(region.rng is not None)

    cfg = _model("cbm_tiny", dropout=0.1)
    image, ids = torch.randn(2, 1, 8, 8), torch.randint(0, 256, (2, 32))

    def run(model):
        model.train()
        torch.manual_seed(7)  # the same masks in every mode's forward
        return model(image, ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute._Region, "forget_unused_rng", spy)
        _same_grads_in_every_mode(lambda m: apply_recompute(cbm.build_cbm_model(cfg, seed=2), m, (cbm.Block,)), run)
        assert kept and all(kept)
        kept.clear()
        model = apply_recompute(cbm.build_cbm_model(dict(cfg, dropout=0.0), seed=2), "selective", (cbm.Block,))
        model(image, ids).float().pow(2).mean().backward()
        assert kept and not any(kept)


# -------------------------------------------------------------------- on real ranks

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "trainer.steps=1", "runtime.dump_grads=true"]
CBM = ["model=cbm_tiny", "data=image_text", "pipeline.microbatches=4", "pipeline.microbatch_size=2",
       "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null", "logger=none",
       "trainer.steps=1", "runtime.dump_grads=true"]
CASES = [
    ("gpipe", []), ("1f1b", []), ("interleaved_1f1b", ["pipeline.virtual_stages=2"]), ("zb_h1", []),
    ("chimera", []), ("seq1f1b", ["pipeline.segments=2"]), ("amdp", ["schedule.windows=1"]), ("bapp", CBM),
]


@slow
@pytest.mark.parametrize("name,extra", CASES, ids=[c[0] for c in CASES])
def test_recomputation_changes_no_gradient_on_real_ranks(name, extra, tmp_path):
    """Every runtime schedule family on 2 ranks: full and selective recomputation give
    the gradients of none (fp32, 1e-6 relative), the zero-bubble split included."""
    base = [] if extra is CBM else SMALL
    tied = None if extra is CBM else pipeline_runs.GPT_TIED
    runs = {mode: pipeline_runs.train(tmp_path / mode, [*base, *extra, f"schedule={name}", "pipeline.stages=2",
                                                        f"model.recompute={mode}"], tied=tied)
            for mode in MODES}
    want = runs["none"]["grads"]
    for mode in ("full", "selective"):
        got = runs[mode]["grads"]
        assert got.keys() == want.keys()
        for pname, copies in want.items():
            for a, b in zip(got[pname], copies):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9 * float(b.abs().max()), msg=f"{mode} {pname}")
        assert runs[mode]["losses"] == pytest.approx(runs["none"]["losses"], rel=1e-6)
    saved = {mode: runs[mode]["summary"]["peak_saved_bytes"][0] for mode in MODES}
    assert saved["full"] < saved["none"] and saved["selective"] < saved["none"], saved


def test_the_zero_bubble_input_gradient_rebuilds_a_recomputed_block_once():
    from torch import nn

    from pipeflow.models.recompute import recomputed
    from pipeflow.runtime.backward import backward_input, backward_weight

    calls = [0]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            calls[0] += 1
            return x + self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(3)])
    for blk in blocks:
        blk.forward = recomputed(blk.forward)
    x = torch.randn(8, 16, requires_grad=True)
    h = x
    for blk in blocks:
        h = blk(h)
    calls[0] = 0
    _, pending = backward_input(h.sum(), None, [x], list(blocks.parameters()))
    in_input = calls[0]
    backward_weight(pending, list(blocks.parameters()))
    assert (in_input, calls[0]) == (3, 3)  # one rebuild per block in I, none in W


def test_a_rerun_on_another_thread_keeps_the_steps_shared_casts():
    """Autocast's cache of weight casts is one for the process, its nesting depth one per
    thread. On CUDA a backward, and so a recomputed region's rerun, runs on autograd's
    device thread: the rerun's autocast context, the outermost there, cleared the cache at
    its exit, and the next microbatch cast every weight anew (each in-flight microbatch
    then kept its own 16-bit copies). Here the first microbatch's backward runs on a thread
    of its own, as CUDA's would; the second microbatch's forward still reads the first's
    casts."""
    import threading

    from pipeflow.runtime.mixed_precision import Precision

    stage = _gpt_stage("selective")  # the attention rebuilt, the MLP's casts shared
    precision = Precision("bf16", "cpu")
    weights = {id(p) for p in stage.parameters()}

    def forward(x):
        casts = set()  # the weight casts the stage's products saved (those outside a recomputed region)

        def pack(t):
            fn = t.grad_fn
            if type(fn).__name__ == "ToCopyBackward0" and id(getattr(fn.next_functions[0][0], "variable", None)) in weights:
                casts.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision.autocast():
            out = stage(x)
        return out, casts

    torch.manual_seed(0)
    width = next(p for n, p in stage.named_parameters() if n.endswith("ln_1.weight")).numel()
    x = [torch.randn(2, 32, width, requires_grad=True) for _ in range(2)]
    with precision.shared_casts():
        out, first = forward(x[0])
        worker = threading.Thread(target=lambda: out.float().sum().backward())
        worker.start()
        worker.join()
        _, second = forward(x[1])
    assert first  # the MLP's (and the head's) weights
    assert second == first  # the same casts, not new ones
    torch.clear_autocast_cache()
