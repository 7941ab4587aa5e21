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


def _sync_checkpoint(run, step: int, chunk_start: int | None = None) -> None:
    """A whole checkpoint folder at ``step`` as a synchronous run (``chunk_start``: an
    asynchronous one that ended inside a chunk) leaves it; its one rank file is no
    tensor (the plan reads its record only)."""
    folder = run / "checkpoints" / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "rank0.pt").write_bytes(b"x" * 10)
    (folder / "meta.json").write_text(json.dumps({
        "step": step, "format": 2, "chunk_start": step if chunk_start is None else chunk_start, "world_size": 1,
        "meta": {}, "files": {"rank0.pt": 10}, "names": {}}))
    (run / "checkpoints" / "latest").write_text(f"{step}\n")


@pytest.mark.parametrize("written,steps,chunks", [
    ((4, None), 6, {2}),  # issue 76: every rank raised "no schedule for a chunk of 2 steps (it has [6, 8])"
    ((4, None), 21, {4, 5}),  # 5-8 to the grid, 9-16, then 17-21
    ((10, 8), 12, {4}),  # an asynchronous run that ended inside its chunk 9-16 restarts it at 8
    ((3, 0), 6, {6}),  # ... inside its first chunk: from the seed's weights, 1-6
])
def test_a_resumed_asynchronous_plan_holds_its_first_chunk_to_the_grid(written, steps, chunks, tmp_path):
    """A checkpoint off the windows' grid (a synchronous run's at step 4, windows 8)
    resumes into an asynchronous schedule with a shorter first chunk, to the grid's next
    line: the plan holds a schedule for each chunk the run trains."""
    from pipeflow.config import compose, prepare_training

    if written[1] not in (None, 0):
        _sync_checkpoint(tmp_path, written[1])
    _sync_checkpoint(tmp_path, written[0], written[1])
    plan = prepare_training(compose("train", ["schedule=pipedream", "pipeline.stages=2", f"trainer.steps={steps}",
                                              f"resume={tmp_path}"])).plan
    assert plan.schedule.windows == 8 and set(plan.chunk_lowered) == chunks - {8}
    assert all(plan.chunk(n).schedule.windows == n for n in chunks)


@slow
def test_a_synchronous_checkpoint_trains_on_in_an_asynchronous_schedule(base, tmp_path):
    """Issue 76: the 1F1B run's step-2 checkpoint into PipeDream (windows 8) to step 4
    (every rank raised: no schedule for a chunk of 2 steps): steps 3-4 are one chunk,
    the grid's 1-8 cut at both ends. Stopped at step 3 instead (inside that chunk, whose
    start, step 2, is saved in the run's own folder) and resumed to 4 from that folder
    alone, it replays step 3 and gives the same step 4."""
    run, _ = base
    common = [*SMALL, "pipeline.stages=2", "schedule=pipedream"]
    straight = pipeline_runs.train(tmp_path / "straight", [*common, "trainer.steps=4", f"resume={_step(run, 2)}"])
    assert straight["summary"]["resumed_from"] == 2 and len(straight["losses"]) == 2
    short = tmp_path / "short"
    pipeline_runs.train(short, [*common, "trainer.steps=3", f"resume={_step(run, 2)}"])
    assert sorted(p.name for p in (short / "checkpoints").iterdir()) == ["latest", "step_0000002", "step_0000003"]
    assert json.loads((short / "checkpoints" / "step_0000003" / "meta.json").read_text())["chunk_start"] == 2
    again = pipeline_runs.train(tmp_path / "again", [*common, "trainer.steps=4", f"resume={short}"])
    assert again["summary"]["resumed_from"] == 3
    assert again["losses"] == pytest.approx(straight["losses"][1:], rel=1e-6)
