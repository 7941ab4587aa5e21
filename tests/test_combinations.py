"""Every accepted combination trains, or is refused in one sentence (issue 60): the
product schedule x shard x (data parallel, tensor parallel) x segments over a tiny GPT
on 2 stages, each combination checked as the trainer checks it and, where accepted,
trained one step on real ranks with short timeouts, so that no accepted combination can
hang unseen (Chimera under ZeRO-1/2 once did, past every timeout).

CI checks a seeded sample of the product (the config check costs about 0.4 s a
combination here, a step about 5 s); the whole product runs with

    PIPEFLOW_COMBINATIONS=all .venv/bin/python -m pytest tests/test_combinations.py -q

(PIPEFLOW_COMBINATIONS=<n>: a sample of n; PIPEFLOW_COMBINATIONS_SEED: its draw).
"""

from __future__ import annotations

import math
import os
import random

import pytest

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_training
from pipeflow.schedules.registry import schedule_names

slow = pytest.mark.slow  # starts ranks

BASE = ["model.n_layer=4", "model.n_embd=32", "model.n_head=4", "model.seq_len=32", "pipeline.microbatches=4",
        "pipeline.microbatch_size=2", "trainer.steps=1", "trainer.val_every=0", "trainer.val_batches=1",
        "trainer.timeline_step=null", "logger=none", "data.max_bytes=100000", "pipeline.stages=2",
        "runtime.timeout_s=30", "runtime.hang_timeout_s=15"]
CHUNKED = {"interleaved_1f1b", "interleaved_zb", "zb_v", "dualpipe_v", "looped_bfs", "seq1f1b_interleaved"}
SEGMENTED = {"seq1f1b", "seq1f1b_interleaved"}


def product() -> list[tuple[str, ...]]:
    """Every combination: (schedule, shard, data parallel, tensor parallel, segments);
    world sizes up to 4 (the schedules that take no branched model or file)."""
    out = []
    for s in schedule_names():
        if s in ("bapp", "file"):
            continue
        for shard in ("none", "optimizer", "gradients", "full"):
            for dp, tp in ((1, 1), (2, 1), (1, 2)):
                for seg in ((1, 2) if s in SEGMENTED else (1, 2) if shard == "none" and dp == tp == 1 else (1,)):
                    out.append((s, shard, dp, tp, seg))
    return out


def overrides(c) -> list[str]:
    s, shard, dp, tp, seg = c
    chunks = ["pipeline.virtual_stages=2"] if s in CHUNKED else []
    return [*BASE, f"schedule={s}", *chunks, f"pipeline.shard={shard}", f"pipeline.data_parallel={dp}",
            f"pipeline.tensor_parallel={tp}", f"pipeline.segments={seg}"]


def chosen() -> tuple[list, int]:
    """The combinations to check, and how many of the accepted ones to train."""
    every = product()
    want = os.environ.get("PIPEFLOW_COMBINATIONS", "")
    if want == "all":
        return every, len(every)
    n = int(want) if want else 20
    rng = random.Random(int(os.environ.get("PIPEFLOW_COMBINATIONS_SEED", "60")))
    # Chimera under sharding always among them: the combination that hung
    must = [c for c in every if c[0] == "chimera" and c[1] in ("optimizer", "gradients") and c[2] == 1 and c[3] == 1]
    rest = rng.sample([c for c in every if c not in must], max(0, n - len(must)))
    return must + rest, 4 if not want else n


CASES, TRAINED = chosen()


@pytest.fixture(scope="module")
def verdicts():
    """Each chosen combination: None where the trainer's check accepts it, else its refusal."""
    out = {}
    for c in CASES:
        try:
            prepare_training(compose("train", overrides(c)))
            out[c] = None
        except ConfigError as err:
            out[c] = str(err)
    return out


def test_a_refused_combination_is_refused_in_one_sentence_naming_a_key(verdicts):
    refused = {c: e for c, e in verdicts.items() if e is not None}
    for c, err in refused.items():
        assert "\n" not in err and err.split("=", 1)[0] in {
            "pipeline.shard", "pipeline.segments", "pipeline.data_parallel", "pipeline.tensor_parallel",
            "pipeline.virtual_stages", "schedule", "pipeline.microbatches", "pipeline.stages"}, (c, err)
    assert len(refused) < len(verdicts)  # (the sample holds accepted ones too)


@slow
def test_every_accepted_combination_trains_a_step(verdicts, tmp_path):
    accepted = [c for c, e in verdicts.items() if e is None][:TRAINED]
    assert accepted
    failed = []
    for i, c in enumerate(accepted):
        try:
            run = pipeline_runs.train(tmp_path / str(i), overrides(c))
            assert run["summary"]["status"] == "finished" and math.isfinite(run["losses"][-1]), run["summary"]
        except Exception as err:  # noqa: BLE001 - every combination reported, then the test fails
            failed.append(f"{c}: {' '.join(str(err).split())[:300]}")
    assert not failed, "\n".join(failed)
