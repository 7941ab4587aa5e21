"""Saved-activation accounting (pipeflow.runtime.saved_bytes): what autograd keeps for
backward, counted per storage, released when the backward frees it; and on real ranks
the schedules' known memory shapes (GPipe holds every microbatch, 1F1B at most p)."""

from __future__ import annotations

from pathlib import Path

import gc
import pytest
import torch

import pipeline_runs
from pipeflow.formats.settings import AdamWConfig
from pipeflow.runtime.saved_bytes import SavedBytes
from pipeflow.sim.device_memory import COMPARED as GROUPS

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out


def test_saved_tensors_are_counted_once_and_released_by_backward():
    lin = torch.nn.Linear(64, 64)
    meter = SavedBytes({p.untyped_storage().data_ptr() for p in lin.parameters()})
    x = torch.randn(32, 64, requires_grad=True)
    with meter.hooks():
        h = lin(x)
        y = (h * h).sum()  # h is saved twice (both operands): one storage
    assert meter.current == x.numel() * 4 + h.numel() * 4  # x (for the weight grad) and h; no weights
    y.backward()
    assert meter.current == 0 and meter.peak == x.numel() * 4 + h.numel() * 4


def test_kv_holds_share_the_count_with_saved_tensors():
    meter = SavedBytes()
    a = torch.randn(8, 8, requires_grad=True)
    with meter.hooks():
        b = a.exp()  # exp saves its result
    hold = meter.hold(b)
    assert meter.current == b.numel() * 4 and meter.kv_current == b.numel() * 4
    del hold
    assert meter.kv_current == 0 and meter.current == b.numel() * 4
    b.sum().backward()
    del b
    assert meter.current == 0


def test_what_i_hands_to_w_is_counted_until_w():
    """I frees the graph and keeps W's operands by hand: the meter counts them from before
    the graph goes (no dip) until W is done with them."""
    from pipeflow.runtime.backward import backward_input, backward_weight

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    params = list(net.parameters())
    meter = SavedBytes({p.untyped_storage().data_ptr() for p in params})
    x = torch.randn(16, 32, requires_grad=True)
    with meter.hooks():
        out = net(x)
    saved = meter.current
    grads, pending = backward_input(out, torch.ones_like(out), [x], params, keep=meter.keep)
    assert grads[0] is not None and pending.planned  # both products planned: the graph is gone
    held = meter.residual_current
    assert held > 0 and meter.current == held and meter.peak >= saved
    backward_weight(pending, params)
    del pending
    assert meter.current == 0 and meter.residual_current == 0 and meter.residual_peak == held
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    net(x).backward(torch.ones_like(out))
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, params))


def test_the_profile_names_what_a_step_holds_byte_for_byte():
    """runtime.memory=profile on one process: a forward (its saved tensors tagged by the
    meter), a backward and an AdamW step under the profiler; at the step's peak the
    categories hold exactly the weights, their gradients, the optimizer's moments, and
    what autograd saved (the meter's own count)."""
    from pipeflow.runtime.memory_profile import profile_step, tag_stage

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(128, 64)
    net(x).sum().backward()
    opt.step()  # the moments exist before the profiled step, as in a run's last step
    opt.zero_grad(set_to_none=True)
    meter = SavedBytes({p.untyped_storage().data_ptr() for p in net.parameters()})
    with profile_step(torch.device("cpu")) as step:
        with meter.hooks():
            out = net(x)
        saved = meter.current
        out.sum().backward()
        del out
        opt.step()
        tag_stage(net, opt)
        opt.zero_grad(set_to_none=True)
    weights = sum(p.numel() * 4 for p in net.parameters())
    moments = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values())
    assert moments >= 2 * weights
    peaks = step.category_peaks
    assert peaks["parameters"] == weights and peaks["optimizer_state"] == moments
    assert peaks["gradients"] == weights
    assert peaks["activations"] == saved == meter.peak
    assert step.peak_bytes >= weights + moments + max(saved, weights)
    assert sum(step.at_peak.values()) == step.peak_bytes


def test_a_cuda_step_is_replayed_from_the_allocators_history_with_its_tags_in_place():
    """On CUDA the step comes from the caching allocator's trace; each tag and action sits
    where the allocator's counters of allocations and frees put it. A synthetic trace
    (no GPU here): what a replay gives is fixed by the order alone."""
    from pipeflow.runtime.memory_profile import _CudaLog

    log = _CudaLog.__new__(_CudaLog)
    log.start = (10, 5)  # the allocator's counters when the step began
    trace = [{"action": "segment_alloc", "addr": 0, "size": 1 << 21},
             {"action": "alloc", "addr": 100, "size": 1000},  # a block of 1024
             {"action": "alloc", "addr": 200, "size": 300},  # 512
             {"action": "free_requested", "addr": 100, "size": 1000},
             {"action": "free_completed", "addr": 100, "size": 1000},
             {"action": "alloc", "addr": 100, "size": 2048}]  # the same address, a new life
    log.tags = [(11, 5, 100, "activations", 1000),  # after the first allocation: names the first life
                (13, 6, 100, "gradients", 2048),  # after the free and the third: the second life
                (10, 5, 999, "parameters", 4096)]  # nothing allocated there in the step: live from the start
    log.actions = [((10, 5), (12, 5), "0F0"), ((12, 5), (13, 6), "0B0")]
    step = log.replay(trace, live_at_start=4096 + 8192)  # 8192 live at the start, never named
    assert step.peak_bytes == 4096 + 8192 + 512 + 2048
    assert step.at_peak["parameters"] == 4096 and step.at_peak["gradients"] == 2048
    assert step.at_peak["temporaries"] == 8192 + 512 and step.at_peak["activations"] == 0
    assert step.category_peaks["activations"] == 1024
    assert step.peak_action == "0B0"


def test_what_a_stage_sends_is_an_output_from_the_send_on():
    """The gradient a stage sends back is the stream's gradient its backward made and
    carried as a temporary; the send's tag names it an output only from then on. A
    gradient tagged at the optimizer step is one for its whole life."""
    from pipeflow.runtime.memory_replay import replay

    events = [(1, 0, "alloc", 10, 1000, 0),  # the stream's gradient
              (2, 0, "alloc", 20, 500, 0),  # a product's scratch beside it: the backward's most
              (3, 0, "alloc", 30, 300, 0),  # a weight's gradient
              (4, 0, "alloc", 20, -500, 0),
              (5, 1, "tag", 10, "outputs", 1000),  # sent back
              (6, 0, "alloc", 40, 2000, 0),  # the next action's: the step's peak
              (7, 1, "tag", 30, "gradients", 300)]
    step = replay(events, [(0, 4, "1B0"), (6, 7, "1F1")], per_action=True)
    assert step.peak_bytes == 1000 + 300 + 2000 and step.peak_action == "1F1"
    assert step.at_peak["outputs"] == 1000 and step.at_peak["gradients"] == 300
    most, split, _ = step.action_peaks["1B0"]  # in the backward, before the send
    assert most == 1800 and split["temporaries"] == 1500 and split["gradients"] == 300 and split["outputs"] == 0


def test_an_address_handed_out_again_was_freed_before_though_no_free_was_recorded():
    """The profiler records no free made on another thread: a collective's buffer whose
    last reference gloo's work drops (after the caller let go) is freed unseen. An
    allocator never hands out a live address, so a new allocation there ends the old
    one (at the latest); without that, each such buffer stayed counted to the step's end."""
    from pipeflow.runtime.memory_replay import replay

    events = [(1, 0, "alloc", 10, 1000, 0),  # an all-reduce's clone, freed on gloo's thread: no event
              (2, 0, "alloc", 20, 300, 0),
              (3, 0, "alloc", 10, 1000, 0),  # the next collective's, at the same address
              (4, 0, "alloc", 30, 500, 0),
              (5, 0, "alloc", 20, -300, 0)]
    step = replay(events, [(0, 5, "0B0")])
    assert step.peak_bytes == 1000 + 300 + 500 and step.at_peak["temporaries"] == 1800


def test_a_backward_through_an_earlier_forwards_casts_holds_their_gradients_to_its_end():
    """At 16 bits a step's forwards share one cast of each weight (Precision.shared_casts),
    and the autograd engine runs the ready node with the highest sequence number first:
    the casts' backward nodes, made by the first forward, wait for the end of a later
    microbatch's backward, each holding its weight's 16-bit gradient until then (what
    pipeflow.sim.device_memory's ``held_cast_gradients`` prices). The first microbatch's own
    backward reaches each cast as it goes; the second holds all but the first one it
    reaches. Both after a first step, with the gradients accumulating in place."""
    from pipeflow.runtime.memory_profile import profile_step, tag_stage

    torch.manual_seed(0)
    H = 256
    net = torch.nn.Sequential(*[torch.nn.Linear(H, H) for _ in range(4)])
    x = [torch.randn(8, H) for _ in range(2)]
    peaks = []
    for _ in range(2):  # the second round's backwards accumulate into the first's .grad
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):  # the step's cache
            outs = []
            for xi in x:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    outs.append(net(xi).float().sum())
            peaks.append([])
            for out in outs:
                # garbage of earlier tests that Python's collector frees inside the window
                # would count as temporaries live at its start (it was, in one suite run)
                gc.collect()
                gc.disable()
                try:
                    with profile_step(torch.device("cpu")) as step:
                        out.backward()
                        tag_stage(net, None)
                finally:
                    gc.enable()
                peaks[-1].append(step.category_peaks["temporaries"])
        torch.clear_autocast_cache()
    first, second = peaks[1]
    held = (len(net) - 1) * H * H * 2  # every 16-bit weight gradient but the last one reached
    assert second - first == pytest.approx(held, rel=0.02)


OVER = [*pipeline_runs.GPT_SMALL, "pipeline.stages=2", "pipeline.microbatches=8", "trainer.steps=2",
        "runtime.memory=profile"]
SIZES = [*pipeline_runs.GPT_SMALL[:4], "pipeline.stages=2", "pipeline.microbatches=8", "pipeline.microbatch_size=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(schedule, *overrides)``: the summary of that run on 2 ranks (2 steps, the
    last one profiled), trained once for the module."""
    runs = {}

    def get(schedule: str, *extra: str) -> dict:
        key = (schedule, *extra)
        if key not in runs:
            out = tmp_path_factory.mktemp(schedule)
            runs[key] = pipeline_runs.train(out, [*OVER, f"schedule={schedule}", *extra])["summary"]
        return runs[key]

    return get


def test_gpipe_keeps_every_microbatch_1f1b_at_most_p(trained):
    gpipe = trained("gpipe")["peak_saved_bytes"]
    one = trained("1f1b")["peak_saved_bytes"]
    # stage 0 holds 8 microbatches under GPipe and 2 under 1F1B: a ratio of 4, give or take
    # the tensors a stage saves once per step
    assert 3.5 < gpipe[0] / one[0] < 4.5
    assert one[1] < one[0]  # the last stage holds one microbatch at a time


def test_the_zero_bubble_split_holds_its_residuals_until_w_measured_and_simulated(tmp_path: Path, trained):
    """Under ZB-H1 and ZB-H2 the last stage keeps what each I hands to its W (the planned
    products' operands and the gradients arriving at them, held by hand once I has freed
    the graph) until W runs: its measured peak exceeds 1F1B's by those residuals, and the
    simulator predicts each device's peak (fp32, as trained) within 1%."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    peaks = {}
    for schedule in ("1f1b", "zb_h1", "zb_h2"):
        run = trained(schedule)
        sim = run_simulation(compose("simulate", [*SIZES, f"schedule={schedule}", "draw=false"]), tmp_path / f"sim_{schedule}")
        assert sim["precision"] == run["precision"] == "fp32"
        for measured, simulated in zip(run["peak_saved_bytes"], sim["per_device"]):
            assert simulated["peak_activation_bytes"] == pytest.approx(measured, rel=0.01)
        peaks[schedule] = run
    one, h1, h2 = peaks["1f1b"], peaks["zb_h1"], peaks["zb_h2"]
    assert one["peak_residual_bytes"] == [0, 0] and h1["peak_residual_bytes"][0] == 0  # stage 0: W is its whole backward
    assert h1["peak_residual_bytes"][1] > 0 and h2["peak_residual_bytes"][1] > h1["peak_residual_bytes"][1]
    assert h1["peak_saved_bytes"][1] > 1.5 * one["peak_saved_bytes"][1]  # the residuals of the Ws it defers
    assert h2["peak_saved_bytes"][1] > h1["peak_saved_bytes"][1]
    # every allocation agrees: the profiled last stage holds the residuals (tagged as such)
    assert h1["memory_profile"][1]["category_peaks"]["residuals"] == h1["peak_residual_bytes"][1]




@pytest.mark.parametrize("case", [("1f1b",), ("gpipe",), ("zb_h1",), ("1f1b", "precision=bf16"),
                                  ("1f1b", "model.recompute=full"),
                                  ("zb_h1", "precision=bf16", "model.vocab_multiple=96"),
                                  ("zb_h1", "model.recompute=full"), ("pipedream",),
                                  ("1f1b", "precision=bf16", "model.recompute=full"),
                                  ("seq1f1b", "pipeline.segments=4", "model.recompute=selective"),
                                  ("pipedream", "precision=bf16"),
                                  ("zb_h1", "precision=bf16", "model.recompute=selective", "pipeline.stages=4")],
                         ids=lambda c: " ".join(c))
def test_the_simulated_peak_is_what_each_rank_allocates(case, trained, tmp_path: Path):
    """runtime.memory=profile against pipeflow-simulate on the same config: per device the
    simulated peak (of the sum over time) is within 3% of every byte the rank had live at
    its peak; the weights and the optimizer's moments are exact, and each category within
    5% of the peak (benchmarks/bench_memory.py prints the matrix). One case pads the
    vocabulary (256 words, 288 rows: the tables, the logits and their gradient as wide as
    the head, the loss's chunk as the words)."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    run = trained(*case)
    sim = run_simulation(compose("simulate", [*SIZES, f"schedule={case[0]}", *case[1:], "draw=false"]), tmp_path,
                         actions=_peak_actions(run))
    _assert_the_same_memory(run, sim)


@pytest.mark.parametrize("schedule,stages,extra", [("1f1b", 2, ()), ("zb_h1", 4, ()),
                                                   ("zb_h2", 2, ("model.recompute=full",)),
                                                   ("gpipe", 4, ("model.recompute=selective",))],
                         ids=["1f1b", "zb_h1 4 ranks", "zb_h2 full", "gpipe selective 4 ranks"])
def test_the_branched_models_16_bit_backward_is_simulated_as_it_holds_its_casts_gradients(schedule, stages, extra,
                                                                                           tmp_path: Path):
    """The cbm model at bf16 under 1F1B: its vision stages' weights outweigh a microbatch's
    activations, so the peak is where a backward holds the 16-bit gradients of the casts
    an earlier forward made (see the test above): measured and simulated as for GPT.
    Under ZB-H1 on 4 ranks the cross-attention stages' I frees the graph as it goes and
    keeps what W needs, as the model says (they kept the whole graph until W: 0.83).
    Under ZB-H2 with full recomputation the text stage peaks in its first W, every
    residual still held and all but one gradient made (0.955 before W was priced); under
    GPipe with selective recomputation the vision stage's later backwards peak in the
    cross-attention's key/value product, three MLPs' 16-bit gradients beside it (0.938;
    there the first stages' peaks are within 3% but the model's fall at other instants,
    so their categories differ: the totals are checked, and the vision stage's
    temporaries within 5% of its peak)."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    over = ["model=cbm_tiny", f"schedule={schedule}", f"pipeline.stages={stages}", "precision=bf16",
            "pipeline.microbatches=8", "pipeline.microbatch_size=4", *extra]
    run = pipeline_runs.train(tmp_path / "run", [*over, "trainer.steps=2", "trainer.val_every=0", "logger=none",
                                                 "runtime.memory=profile"])["summary"]
    sim = run_simulation(compose("simulate", [*over, "draw=false", "topology=local_cpu"]), tmp_path / "sim",
                         actions=_peak_actions(run))
    if schedule == "gpipe":  # (its first stages peak at other instants than the model's: totals only, see below)
        slack = _emulated_bf16_scratch()
        for meas, predicted in zip(run["memory_profile"], sim["per_device"]):
            assert abs(predicted["peak_memory_bytes"] - meas["peak_bytes"]) <= 0.03 * meas["peak_bytes"] + slack
        vision, meas = sim["per_device"][1]["memory_at_peak"]["temporaries"], run["memory_profile"][1]
        assert abs(vision - meas["at_peak"]["temporaries"]) <= 0.05 * meas["peak_bytes"] + slack
    else:
        _assert_the_same_memory(run, sim)
    assert run["memory_profile"][0]["at_peak"]["casts"] > 0


@pytest.mark.parametrize("over", [
    ("model=llama_tiny", "schedule=zb_h2", "pipeline.stages=4", "precision=bf16", "model.recompute=selective"),
    ("model=llama_tiny", "schedule=zb_h2", "pipeline.stages=2", "precision=bf16", "model.recompute=full"),
    ("model=cbm_tiny", "schedule=zb_h1", "pipeline.stages=2", "precision=fp32", "model.recompute=selective")],
    ids=["llama rotary rerun", "llama waiting gradients", "cbm multihead attention"])
def test_a_zero_bubble_i_is_walked_as_the_rank_runs_it(over, tmp_path: Path):
    """Three I phases the walk once missed, each measured on its ranks. Llama ZB-H2 bf16
    with selective recomputation on 4 ranks: the middle ranks' I peaks inside the
    attention's rerun, rotating Q and K in fp32 beside the rebuilt projections (the walk
    peaked at the MLP's: activations +6.6% of the peak). Llama ZB-H2 bf16 with full
    recomputation: the first stage's I is empty, and the gradients waiting for its W are
    fp32 copies restored from the 16-bit messages (the walk held the messages: 0.968).
    cbm ZB-H1 fp32 with selective recomputation: the text stage's I walked as a GPT
    stage's, with its cross-attention behind and nn.MultiheadAttention's extra gradients
    at its self-attention (it was priced as B: 0.944)."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    over = [*over, "pipeline.microbatches=8", "pipeline.microbatch_size=4"]
    run = pipeline_runs.train(tmp_path / "run", [*over, "trainer.steps=2", "trainer.val_every=0", "logger=none",
                                                 "runtime.memory=profile"])["summary"]
    actions = [m.get("peak_action") for m in run["memory_profile"]]
    sim = run_simulation(compose("simulate", [*over, "draw=false", "topology=local_cpu"]), tmp_path / "sim",
                         actions=actions)
    _assert_the_same_memory(run, sim)
    # every I-peaking rank's peak action is one the simulator prices as it measured it
    for meas, predicted in zip(run["memory_profile"], sim["per_device"]):
        if "I" in (meas.get("peak_action") or ""):
            at = predicted["memory_at_action"]
            assert at["action"] == meas["peak_action"]
            slack = _emulated_bf16_scratch() if run["precision"] == "bf16" else 0.0
            assert abs(at["bytes"] - meas["peak_bytes"]) <= 0.03 * meas["peak_bytes"] + slack


@pytest.mark.parametrize("over,within", [
    (("model=bert_tiny", "schedule=zb_h1", "model.recompute=full"), 0.03),
    (("model=llama_tiny", "schedule=1f1b", "model.recompute=full"), 0.015)], ids=["bert I", "llama B"])
def test_a_rebuilt_layers_16_bit_backward_peaks_where_the_rank_does(over, within, tmp_path: Path):
    """Full recomputation at bf16 on 4 ranks. BERT ZB-H1: a middle rank's I peaks at the
    MLP's activation, the rebuilt layer whole; by its attention the MLP sub-layer, its
    casts and the first norm's input are gone (the walk put the peak there, 0.59 MiB too
    high: temporaries -6.7% and residuals +4.5% of the peak). Llama 1F1B: the rebuilt
    block's own casts let the down projection's 16-bit gradients go with its backward,
    so the gated MLP peaks in that product (the walk added the gate-up product's two
    gradients to them: 1.024 to 1.030)."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    over = [*over, "pipeline.stages=4", "precision=bf16", "pipeline.microbatches=8", "pipeline.microbatch_size=4"]
    run = pipeline_runs.train(tmp_path / "run", [*over, "trainer.steps=2", "trainer.val_every=0", "logger=none",
                                                 "runtime.memory=profile"])["summary"]
    sim = run_simulation(compose("simulate", [*over, "draw=false", "topology=local_cpu"]), tmp_path / "sim",
                         actions=_peak_actions(run))
    _assert_the_same_memory(run, sim)
    slack = _emulated_bf16_scratch()  # (bf16: see there)
    for meas, predicted in zip(run["memory_profile"], sim["per_device"]):
        assert abs(predicted["peak_memory_bytes"] - meas["peak_bytes"]) <= within * meas["peak_bytes"] + slack


SEGMENTS_KERNEL = ("model=llama_tiny", "schedule=seq1f1b_interleaved", "pipeline.virtual_stages=2",
                   "pipeline.segments=4", "pipeline.stages=2")


@pytest.mark.parametrize("over", [
    SEGMENTS_KERNEL,
    ("model=bert_tiny", "schedule=zb_h2", "pipeline.stages=4"),
    ("model=bert_tiny", "schedule=pipedream", "pipeline.stages=4")], ids=["segment's kernel", "bert rerun", "own casts"])
def test_an_attention_backward_peaks_where_the_rank_does(over, tmp_path: Path):
    """Selective recomputation at bf16. Interleaved Seq1F1B: the last stage peaks inside
    the fused kernel's backward of the last segment (its queries over the whole prefix),
    which holds, beside the gradients of Q, K and V, the output gradient's contiguous
    copy, the rebuilt mask and its blocks (149 KiB on a host with AVX512-BF16, 123 KiB
    without: there the rank peaks at the head's instant, 260 bytes below the kernel's
    here, activations 5.6% of the peak more; the split is checked at whichever of the
    walk's near-tied instants it is, see NEAR_TIE). BERT ZB-H2: the first
    rank peaks at the end of the attention's rerun, past its last save (the first norm's
    fp32 output and the output projection's beside the rebuilt region: activations +5.1%).
    BERT PipeDream: each microbatch casts the weights for itself, and each cast goes with
    its weight's backward, so by that rerun the MLP's casts have gone (held, the walk put
    every rank's peak at the rerun: activations -7% to -13%)."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    over = [*over, "precision=bf16", "model.recompute=selective", "pipeline.microbatches=8",
            "pipeline.microbatch_size=4"]
    run = pipeline_runs.train(tmp_path / "run", [*over, "trainer.steps=2", "trainer.val_every=0", "logger=none",
                                                 "runtime.memory=profile"])["summary"]
    sim = run_simulation(compose("simulate", [*over, "draw=false", "topology=local_cpu"]), tmp_path / "sim",
                         actions=_peak_actions(run))
    _assert_the_same_memory(run, sim)


def test_the_attention_backwards_peak_holds_on_a_host_without_avx512_bf16():
    """The case above as CI's AMD EPYC hosts without AVX512-BF16 run it: oneDNN capped at
    AVX2 (``ONEDNN_MAX_CPU_ISA``) in every process, where its bf16 products take no
    scratch and the fused attention's backward holds 30 KB less, so the last stage peaks
    at its head's loss backward, not in the kernel (the split 5.6% of the peak apart: the
    test failed there, every run, before it compared the split at the near-tied instant)."""
    import os
    import subprocess
    import sys

    if not _has_avx512():
        # oneDNN's best path here is already AVX2's: the test above ran this very case
        pytest.skip("this CPU has no AVX-512: the test above ran on oneDNN's AVX2 path already")
    # (the test's own body in a fresh process, whose oneDNN reads the cap at its first use)
    code = ("import sys, tempfile, pathlib; sys.path.insert(0, sys.argv[1]); import test_memory as t\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    t.test_an_attention_backward_peaks_where_the_rank_does(t.SEGMENTS_KERNEL, pathlib.Path(d))\n"
            "from pipeflow.topology.kernel_scratch import product_scratch\n"
            "print('held', product_scratch(128, 128, 256, True))")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}, timeout=600)
    # held, and on oneDNN's AVX2 path: a bf16 product there takes no scratch
    assert proc.returncode == 0 and proc.stdout.split()[-2:] == ["held", "0"], proc.stderr[-3000:]


def _has_avx512() -> bool:
    """Whether this x86 CPU has AVX-512 (Linux's flags; elsewhere assumed, so the test runs)."""
    try:
        return " avx512f " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return True


def test_a_v_shaped_stage_keeps_its_output_for_its_successor_on_the_same_device(tmp_path: Path):
    """DualPipeV on 2 ranks puts stages 1 and 2 on one device: stage 1 keeps its output
    (fp32) until its own backward although nothing is sent, and at 16 bits stage 2
    restores a copy of its own. llama_tiny at bf16: the second device 0.968 of its peak
    simulated before the model held that output, 0.997 now."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    over = ["model=llama_tiny", "schedule=dualpipe_v", "pipeline.virtual_stages=2", "pipeline.stages=2",
            "precision=bf16", "pipeline.microbatches=8", "pipeline.microbatch_size=4"]
    run = pipeline_runs.train(tmp_path / "run", [*over, "trainer.steps=2", "trainer.val_every=0", "logger=none",
                                                 "runtime.memory=profile"])["summary"]
    sim = run_simulation(compose("simulate", [*over, "draw=false", "topology=local_cpu"]), tmp_path / "sim",
                         actions=_peak_actions(run))
    _assert_the_same_memory(run, sim)


def _peak_actions(run: dict) -> list:
    """The action each rank peaked in (the simulator then reports that action's instants)."""
    return [m.get("peak_action") for m in run["memory_profile"]]


# Where two instants of the walk lie within this share of its peak, which one the rank
# peaks at can turn on the host's kernels: on a CPU without AVX512-BF16 (an AMD EPYC of
# CI's) the fused attention's backward holds 30 KB less scratch than on this one, and
# Llama's interleaved Seq1F1B last stage peaks at its head's loss backward instead of in
# the kernel, 260 bytes apart, its split 5.6% of the peak away. The walk's peak is within
# 0.3% of both; the rank's split is checked against the walk's at whichever it is.
NEAR_TIE = 0.01


def _emulated_bf16_scratch() -> float:
    """On a CPU with AVX-512 but without AVX512-BF16 (Intel Skylake to Ice Lake), oneDNN
    emulates a bf16 product and holds an fp32 image of its output as scratch for the
    product's duration (4 m n bytes, measured for every shape: pipeflow.topology.kernel_scratch),
    where native bf16 (AVX512-BF16, AMX) holds a few blocks of the operands and AVX2
    none. The walk places the products' scratch where native hosts showed it to matter
    (the MLP's products), not at every product, so on such a host an instant may hold one
    product's image more than it says: the tests' tiny models' largest, a microbatch of
    4 x 128 tokens by 512 columns, 1 MiB. 0 on other hosts."""
    from pipeflow.topology.kernel_scratch import product_scratch

    return 4.0 * 512 * 512 + 128 if product_scratch(256, 64, 256, False) >= 4 * 256 * 256 else 0.0


def _assert_the_same_memory(run: dict, sim: dict) -> None:
    assert sim["precision"] == run["precision"]
    slack = _emulated_bf16_scratch() if run["precision"] == "bf16" else 0.0
    for dev, (meas, predicted) in enumerate(zip(run["memory_profile"], sim["per_device"])):
        peak = meas["peak_bytes"]
        # (what held each peak, so that a miss says where it came from)
        assert abs(predicted["peak_memory_bytes"] - peak) <= 0.03 * peak + slack, (
            dev, meas.get("peak_action"), meas["at_peak"], predicted["memory_at_peak"])
        assert sum(meas["at_peak"].values()) == peak
        # the walk's split at its peak, else at an instant of the rank's peak action all but tied with it
        near = [split for total, split in predicted.get("memory_at_action", {}).get("instants", ())
                if total >= (1 - NEAR_TIE) * predicted["peak_memory_bytes"] - slack]
        misses = [_split_misses(meas["at_peak"], split, peak, slack)
                  for split in (predicted["memory_at_peak"], *near)]
        assert min(misses, key=len) == [], (dev, misses[0])


def _split_misses(measured: dict, simulated: dict, peak: float, slack: float = 0.0) -> list:
    """The groups whose simulated bytes are off the measured ones: the weights and moments
    by more than 0.1%, any other by more than 5% of the peak (and ``slack``: a product's
    scratch the walk does not place, :func:`_emulated_bf16_scratch`) (group, measured, simulated)."""
    out = []
    for group, (m, s) in GROUPS.items():
        got = sum(measured.get(c, 0) for c in m)
        want = sum(simulated.get(c, 0.0) for c in s)
        exact = group in ("parameters", "optimizer_state")
        if abs(got - want) > (1e-3 * got if exact else 0.05 * peak + slack):
            out.append((group, got, want))
    return out


def test_the_search_keeps_the_candidate_that_fits_and_drops_the_one_that_does_not(trained, tmp_path: Path):
    """pipeflow-search with its memory limit set halfway between what two candidates'
    fullest ranks allocated when trained (1F1B and GPipe, the same sizes: trained by the
    module's runs, whose configs are the candidates' own overrides) keeps 1F1B and
    drops GPipe, each by the simulator's peak on its fullest device."""
    from pipeflow.config import compose
    from pipeflow.planning.search import Candidate
    from pipeflow.search import compose_search, run_search

    candidates = {s: Candidate(s, 2, 1, 8, 2) for s in ("1f1b", "gpipe")}
    for s, c in candidates.items():  # what trained is what the search prices
        mine = compose("train", [*OVER, f"schedule={s}"])
        theirs = compose("train", [*OVER, *c.overrides()])
        for key in ("pipeline", "model", "partition", "schedule"):
            assert mine[key] == theirs[key], key
    measured = {s: max(d["peak_bytes"] for d in trained(s)["memory_profile"]) for s in candidates}
    assert measured["gpipe"] > 1.5 * measured["1f1b"]
    limit = (measured["1f1b"] + measured["gpipe"]) / 2
    cfg = compose_search(["model=gpt_tiny", *SIZES[:4], "topology=local_cpu", "search.devices=2", "search.global_batch=16",
                          "search.schedules=[1f1b,gpipe]", "search.stages=[2]", "search.microbatch_sizes=[2]",
                          "search.recompute=[none]", "search.partitions=[uniform]", "search.workers=1",
                          f"search.memory_limit_gb={limit / 2**30}", "draw=false"])
    result, _ = run_search(cfg, tmp_path)
    assert [q.candidate for q in result.ranked] == [candidates["1f1b"]]
    assert [q.candidate for q in result.out_of_memory] == [candidates["gpipe"]]
    for q in result.closed:  # the closed form agrees with the measurement's side of the limit
        s = q.candidate.schedule
        assert q.peak_memory == pytest.approx(measured[s], rel=0.03), s


@pytest.mark.parametrize("model,recompute", [("gpt_tiny", "none"), ("llama_tiny", "none"), ("bert_tiny", "full")])
def test_an_input_gradient_holds_what_the_model_says(model, recompute):
    """benchmarks/bench_split_memory.py on a last stage: what I leaves for W is the
    model's residual to the byte; midway through I the stage holds more than at either
    end (the output gradients it keeps of the layers above, beside the saved tensors of
    the layers below), and the peak of I is the model's (activations + I's workspace,
    AnalyticCost.input_workspace_bytes) within 2.5%, as B's is (workspace_bytes)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_split_memory import measure

    (b, i), m = measure(model, 1, 4, 2, recompute)
    assert (b["kind"], i["kind"]) == ("B", "I") and b["saved"] == i["saved"]
    assert i["residual"] == m["residual"]
    if recompute == "none":
        held = i["peak"] - i["at_peak"]["temporaries"]
        assert held > max(i["saved"], i["residual"])
        assert b["peak"] - b["at_peak"]["temporaries"] == b["saved"]  # B holds no more than its start
        # (with full recomputation B's is 11-18% low here: docs/runtime.md, "Where it is off")
        assert m["activation"] + m["workspace"] == pytest.approx(b["peak"], rel=0.02)
    assert m["activation"] + m["input_workspace"] == pytest.approx(i["peak"], rel=0.025)
    assert m["input_workspace"] > m["workspace"]


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
def test_a_cpu_optimizer_step_holds_what_the_cost_model_says(family):
    """Each of torch's AdamW implementations (optim.impl) holds what the cost model says
    beside the state: fused nothing; foreach every second moment's square root; a tensor
    at a time (single) a tensor's two fp32 temporaries beside the one before's
    denominator, in the module's order (GPT-2 small's last stage at real width: its head
    beside the MLP down projection's, 9 MiB over the largest tensor's two alone). Every
    stage position of each family, grouped-query attention (llama) and BERT's MLM head
    included: the bytes, but for a few scalars."""
    from test_attention import _model

    from pipeflow.models import bert, gpt, hf_causal
    from pipeflow.planning.cost import AnalyticCost
    from pipeflow.planning.transformer import TransformerSpec
    from pipeflow.runtime.optimizer import make_optimizer
    from pipeflow.topology.kernel_scratch import most_live, profile_allocations

    over = {"gpt": ["model=gpt_tiny"], "llama": ["model=llama_tiny"], "bert": ["model=bert_tiny", "data=mlm_corpus"]}
    module = {"gpt": gpt, "llama": hf_causal, "bert": bert}[family]
    model = _model(*over[family], "model.seq_len=32")
    split = [1, 2, 1]
    cost = AnalyticCost(TransformerSpec.from_config(model), 3, microbatch_size=2, dtype_bytes=4, layers_per_stage=split)
    for impl in ("single", "foreach", "fused"):
        optim = AdamWConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, impl=impl)
        cost.step_impl = impl
        for stage in range(3):
            st = module.build_stage(model, split, stage, seed=0)
            opt = make_optimizer(st, optim)
            assert bool(opt.defaults["fused"]) is (impl == "fused") and bool(opt.defaults["foreach"]) is (impl == "foreach")
            for p in st.parameters():
                p.grad = torch.ones_like(p)
            opt.step()  # the moments made by the first step; the second holds only its temporaries
            with profile_allocations() as sizes:
                opt.step()
            # (and a few scalars: the step counts, 4 bytes a tensor, and foreach's lists)
            tensors = sum(1 for _ in st.parameters())
            assert most_live(sizes) == pytest.approx(cost.step_workspace_bytes(stage), abs=64 + 8 * tensors), \
                (family, impl, stage)
        assert cost.step_workspace_bytes(1) > 0 if impl != "fused" else cost.step_workspace_bytes(1) == 0


def test_the_clip_norms_sum_of_squares_makes_no_float64_copy():
    """The clip norm's sum of a gradient's squares (runtime.optimizer.square_sum): the float64
    sum to 1e-6 (float32 dot products of rows of 1,024), without the two float64 copies of the gradient ``g.double().pow(2).sum()``
    made (617 MB at once for GPT-2's embedding at the step: a first stage's peak)."""
    from pipeflow.runtime.optimizer import square_sum
    from pipeflow.topology.kernel_scratch import most_live, profile_allocations

    for n in (5, 1024, 50257 * 64 + 17):
        g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
        with profile_allocations() as sizes:
            got = square_sum(g)
        assert got.dtype == torch.float64
        assert float(got) == pytest.approx(float(g.double().pow(2).sum()), rel=1e-6), n
        assert most_live(sizes) < max(2 * 8 * 1024, n)  # well under one float32 copy: not two float64 ones


def test_the_step_implementation_follows_the_device_and_the_setting():
    """optim.impl=auto is fused where torch has the kernel (CPU and CUDA ranks), else
    foreach; a named one is that one on every device; the simulator's cost model takes
    the GPU ranks' (topology.on_gpus) without a GPU here."""
    from pipeflow.config import compose, prepare_simulation
    from pipeflow.planning.optimizer_step import step_impl

    assert [step_impl("auto", d) for d in ("cpu", "cuda", "mps")] == ["fused", "fused", "foreach"]
    assert step_impl("single", "cuda") == "single" and step_impl("foreach", "cpu") == "foreach"
    with pytest.raises(ValueError, match="optim.impl=apex"):
        step_impl("apex", "cpu")
    gpu = prepare_simulation(compose("simulate", ["topology=dgx_a100_8", "pipeline.stages=2"]))
    assert gpu.topology.on_gpus and gpu.cost.step_impl == "fused" and gpu.cost.step_workspace_bytes(0) == 0
