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


def test_gpipe_keeps_every_microbatch_1f1b_at_most_p(tmp_path: Path):
    over = [*pipeline_runs.GPT_SMALL, "pipeline.stages=2", "pipeline.microbatches=8", "trainer.steps=2"]
    gpipe = pipeline_runs.train(tmp_path / "gpipe", [*over, "schedule=gpipe"])["summary"]["peak_saved_bytes"]
    one = pipeline_runs.train(tmp_path / "1f1b", [*over, "schedule=1f1b"])["summary"]["peak_saved_bytes"]
    # stage 0 holds 8 microbatches under GPipe and 2 under 1F1B: a ratio of 4, give or take
    # the tensors a stage saves once per step
    assert 3.5 < gpipe[0] / one[0] < 4.5
    assert one[1] < one[0]  # the last stage holds one microbatch at a time
