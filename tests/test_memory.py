"""Saved-activation accounting (pipeflow.runtime.memory): what autograd keeps for
backward, counted per storage, released when the backward frees it; and on real ranks
the schedules' known memory shapes (GPipe holds every microbatch, 1F1B at most p)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipeline_runs
from pipeflow.runtime.memory import SavedBytes

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


OVER = [*pipeline_runs.GPT_SMALL, "pipeline.stages=2", "pipeline.microbatches=8", "trainer.steps=2"]


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory) -> dict:
    """1F1B on 2 ranks, 8 microbatches: the baseline both rank tests compare with."""
    return pipeline_runs.train(tmp_path_factory.mktemp("1f1b"), [*OVER, "schedule=1f1b"])["summary"]


def test_gpipe_keeps_every_microbatch_1f1b_at_most_p(tmp_path: Path, one_f_one_b):
    gpipe = pipeline_runs.train(tmp_path / "gpipe", [*OVER, "schedule=gpipe"])["summary"]["peak_saved_bytes"]
    one = one_f_one_b["peak_saved_bytes"]
    # stage 0 holds 8 microbatches under GPipe and 2 under 1F1B: a ratio of 4, give or take
    # the tensors a stage saves once per step
    assert 3.5 < gpipe[0] / one[0] < 4.5
    assert one[1] < one[0]  # the last stage holds one microbatch at a time


def test_the_zero_bubble_split_holds_its_residuals_until_w_measured_and_simulated(tmp_path: Path, one_f_one_b):
    """Under ZB-H1 and ZB-H2 the last stage keeps what each I hands to its W (the planned
    products' operands and the gradients arriving at them, held by hand once I has freed
    the graph) until W runs: its measured peak exceeds 1F1B's by those residuals, and the
    simulator predicts each device's peak (fp32, as trained) within 1%."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    sizes = [*pipeline_runs.GPT_SMALL[:4], "pipeline.stages=2", "pipeline.microbatches=8", "pipeline.microbatch_size=2"]
    peaks = {}
    for schedule in ("1f1b", "zb_h1", "zb_h2"):
        run = one_f_one_b if schedule == "1f1b" else pipeline_runs.train(
            tmp_path / schedule, [*OVER, f"schedule={schedule}", "trainer.steps=1"])["summary"]
        sim = run_simulation(compose("simulate", [*sizes, f"schedule={schedule}", "draw=false"]), tmp_path / f"sim_{schedule}")
        assert sim["precision"] == run["precision"] == "fp32"
        for measured, simulated in zip(run["peak_saved_bytes"], sim["per_device"]):
            assert simulated["peak_activation_bytes"] == pytest.approx(measured, rel=0.01)
        peaks[schedule] = run
    one, h1, h2 = peaks["1f1b"], peaks["zb_h1"], peaks["zb_h2"]
    assert one["peak_residual_bytes"] == [0, 0] and h1["peak_residual_bytes"][0] == 0  # stage 0: W is its whole backward
    assert h1["peak_residual_bytes"][1] > 0 and h2["peak_residual_bytes"][1] > h1["peak_residual_bytes"][1]
    assert h1["peak_saved_bytes"][1] > 1.5 * one["peak_saved_bytes"][1]  # the residuals of the Ws it defers
    assert h2["peak_saved_bytes"][1] > h1["peak_saved_bytes"][1]
