"""A checkpoint moves between layouts (issue 60): saved by parameter name, whole, it
resumes under another stage count, schedule, data-parallel degree with sharding, and
tensor degree, and the steps after the switch are the steps the run would have taken:
the base run's own steps 3 and 4 (every layout computes one device's gradients, which
the runtime tests assert, so the uninterrupted run of any layout is this one to float
rounding). A dropped optimizer state (its moments, its step count: AdamW's bias
correction) or one weight loaded into the wrong place moves the loss in the third
digit."""

from __future__ import annotations

import json

import pytest

import pipeline_runs

slow = pytest.mark.slow  # starts ranks

SMALL = ["model.n_layer=4", "model.n_embd=32", "model.n_head=4", "model.seq_len=32", "pipeline.microbatches=4",
         "pipeline.microbatch_size=2", "optim.warmup_steps=1", "trainer.val_every=0", "trainer.val_batches=1",
         "trainer.timeline_step=null", "logger=none", "data.max_bytes=200000"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """1F1B over 2 stages, 4 steps, a checkpoint at step 2 (and at the end)."""
    run = tmp_path_factory.mktemp("base") / "run"
    out = pipeline_runs.train(run, [*SMALL, "pipeline.stages=2", "trainer.steps=4", "trainer.save_every=2"])
    return run, out["losses"]


def _step(run, n: int) -> str:
    return str(run / "checkpoints" / f"step_{n:07d}")


LAYOUTS = {
    "4 stages": ["pipeline.stages=4"],
    "zb_v": ["schedule=zb_v", "pipeline.stages=2", "pipeline.virtual_stages=2"],
    "2 replicas, fully sharded": ["pipeline.stages=2", "pipeline.data_parallel=2", "pipeline.microbatches=2",
                                  "pipeline.shard=full"],
}


@slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_checkpoint_resumes_under_another_layout_as_the_run_would_have_gone_on(layout, base, tmp_path):
    run, losses = base
    out = pipeline_runs.train(tmp_path / "run", [*SMALL, *LAYOUTS[layout], "trainer.steps=4",
                                                 f"resume={_step(run, 2)}"])
    assert out["summary"]["resumed_from"] == 2
    assert out["losses"] == pytest.approx(losses[2:], rel=2e-5)


@slow
def test_tensor_parallel_and_back(base, tmp_path):
    """1 -> 2 tensor ranks at step 2 (saving at step 3 there), then 2 -> 1 at step 3: the
    pieces gathered whole and cut again each way. The tensor-parallel leg pads the
    vocabulary (model.vocab_multiple=48: 256 words, 288 rows, the second tensor rank's
    cut 112 words and 32 padding columns its loss never reads): the unpadded checkpoint's
    tables get zero rows, its own checkpoint's lose them again, and the losses are the
    unpadded run's."""
    run, losses = base
    tp = tmp_path / "tp2"
    # (trainer.steps stays 4: the learning rate's schedule runs to the last step)
    out = pipeline_runs.train(tp, [*SMALL, "pipeline.stages=2", "pipeline.tensor_parallel=2", "trainer.steps=4",
                                   "model.vocab_multiple=48", "trainer.save_every=1", f"resume={_step(run, 2)}"])
    assert out["summary"]["tensor_parallel"] == 2 and out["summary"]["world_size"] == 4
    assert out["losses"] == pytest.approx(losses[2:], rel=2e-5)
    meta = json.loads((tp / "checkpoints" / "step_0000003" / "meta.json").read_text())
    assert meta["format"] == 2 and meta["world_size"] == 4
    # each parameter written once, whole, by the first tensor rank of its stage's device
    names = [n for files in meta["names"].values() for n in files]
    assert len(names) == len(set(names)) and set(meta["names"]) == {"rank0.pt", "rank2.pt"}
    import torch

    wte = torch.load(tp / "checkpoints" / "step_0000003" / "rank0.pt", weights_only=False)["params"]["wte.weight"]
    assert wte.shape == (288, 32) and wte[:256].abs().sum() > 0 and not wte[256:].any()
    back = pipeline_runs.train(tmp_path / "tp1", [*SMALL, "pipeline.stages=2", "trainer.steps=4",
                                                  f"resume={_step(tp, 3)}"])
    assert back["losses"] == pytest.approx(losses[3:], rel=2e-5)
