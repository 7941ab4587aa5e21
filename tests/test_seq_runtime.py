"""Seq1F1B on real CPU ranks: segments of a microbatch attend causally across segments
(later segments read the earlier ones' keys and values, whose gradients come back to
those segments' own backwards), positions are offset and losses scaled, so the
segmented pipeline computes exactly the unsplit single-device gradient. And the point
of it: stage 0 keeps far fewer activation bytes than 1F1B."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline_runs

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "model.seq_len=48", "trainer.steps=5",
         "runtime.dump_grads=true"]
TIED = pipeline_runs.GPT_TIED


def train(run_dir: Path, *overrides: str) -> dict:
    return pipeline_runs.train(run_dir, [*SMALL, *overrides], tied=TIED)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "pipeline.stages=1")


CASES = [(s, split, p) for s in (2, 4) for split in ("uniform", "compute") for p in (2, 4)]


@pytest.mark.parametrize("segments,split,stages", CASES)
def test_segments_match_the_unsplit_reference(segments, split, stages, reference, tmp_path):
    run = train(tmp_path, "schedule=seq1f1b", f"pipeline.stages={stages}", f"pipeline.segments={segments}",
                f"schedule.split={split}")
    lengths = run["summary"]["segment_lengths"]
    assert len(lengths) == segments and sum(lengths) == 48
    if split == "uniform":
        assert len(set(lengths)) == 1
    else:
        assert lengths[0] > lengths[-1]  # earlier tokens attend to fewer keys: longer segments
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


def test_interleaved_segments_match_the_reference(reference, tmp_path):
    run = train(tmp_path, "schedule=seq1f1b_interleaved", "pipeline.stages=2", "pipeline.virtual_stages=2",
                "pipeline.segments=2")
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


def test_stage0_keeps_fewer_activation_bytes_than_1f1b(tmp_path):
    """(p-1+s)/(s*p) of 1F1B's activations on stage 0 in theory, 5/8 for p = 2, s = 4, if
    a token's bytes did not depend on its segment; a later segment's fused attention also
    keeps the keys and values of its whole prefix, and each segment holds its own for the
    later ones, so it is more. The simulator, fp32, predicts both runs' peaks per rank."""
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    long = ["model.seq_len=256", "model.n_positions=256", "pipeline.stages=2", "pipeline.microbatches=4",
            "trainer.steps=2", "runtime.dump_grads=false"]
    one = train(tmp_path / "1f1b", *long, "schedule=1f1b")["summary"]
    seq = train(tmp_path / "seq", *long, "schedule=seq1f1b", "pipeline.segments=4")["summary"]
    ratio = seq["peak_saved_bytes"][0] / one["peak_saved_bytes"][0]
    assert ratio < 0.8, ratio
    shape = ["model.n_layer=8", "model.n_embd=64", "model.n_head=4", "model.seq_len=256", "model.n_positions=256",
             "pipeline.stages=2", "pipeline.microbatches=4", "pipeline.microbatch_size=2", "precision=fp32",
             "draw=false"]
    for name, run, extra in (("1f1b", one, []), ("seq", seq, ["schedule=seq1f1b", "pipeline.segments=4"])):
        sim = run_simulation(compose("simulate", [*shape, *extra]), tmp_path / f"sim_{name}")
        predicted = [d["peak_activation_bytes"] for d in sim["per_device"]]
        assert predicted == pytest.approx(run["peak_saved_bytes"], rel=0.01), name
    assert seq["peak_kv_bytes"][0] > 0 and one["peak_kv_bytes"][0] == 0
