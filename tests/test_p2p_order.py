"""NCCL-safe communication, provable on CPU (issue 18): NCCL pairs a pair of ranks'
point-to-point messages in the order they are posted and ignores tags. order_pairs
posts every receive in its sender's order; check_pair_order finds a pair that is not;
runtime.p2p=ordered runs over gloo with every tag 0, so a wrong pairing would show."""

from __future__ import annotations

import pytest

import pipeline_runs
from pipeflow.config import compose, prepare_training
from pipeflow.schedules.ir import Action
from pipeflow.schedules.lowering import Comm, check_pair_order, lower, order_pairs
from pipeflow.schedules.registry import build_schedule, specs

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out


def _schedules():
    for s in specs():
        if s.generator is None or s.branch_aware or not s.sized:
            continue
        v = 2 if s.virtual_stages else 1
        seg = 4 if s.segments else 1
        for p in (2, 4):
            yield f"{s.name}-p{p}", build_schedule(s.name, p, 2 * p, v, seg)
    yield "chimera-dp2", build_schedule("chimera", 4, 8, data_parallel=2)
    for p in (2, 3):
        cfg = ["model=cbm_tiny", "data=image_text", f"pipeline.stages={p}"]
        for name in ("bapp", "1f1b"):
            yield f"cbm-{name}-p{p}", prepare_training(compose("train", [*cfg, f"schedule={name}"])).schedule


CASES = list(_schedules())


@pytest.mark.parametrize("schedule", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_ordered_receives_match_their_senders_and_only_move_earlier(schedule):
    raw = lower(schedule)
    ordered = order_pairs(raw)
    check_pair_order(ordered)
    for before, after in zip(raw, ordered):
        assert sorted(map(str, before)) == sorted(map(str, after))  # the same items
        assert [x for x in before if isinstance(x, Action)] == [x for x in after if isinstance(x, Action)]
        assert [x for x in before if isinstance(x, Comm) and x.op == "send"] == \
               [x for x in after if isinstance(x, Comm) and x.op == "send"]
        # a receive is posted no later than before: it precedes at least the actions it preceded
        computes_before = {id(x): sum(isinstance(y, Action) for y in before[:i]) for i, x in enumerate(before)}
        for i, x in enumerate(after):
            if isinstance(x, Comm) and x.op == "recv":
                assert sum(isinstance(y, Action) for y in after[:i]) <= computes_before[id(x)]


def test_the_check_finds_a_pair_posted_out_of_order():
    """Interleaved Seq1F1B and the branched models' lowering receive some messages in
    another order than they were sent: tags save them; NCCL would not."""
    bad = [name for name, sched in CASES if not _in_order(lower(sched))]
    assert "seq1f1b_interleaved-p2" in bad and "cbm-bapp-p2" in bad
    with pytest.raises(ValueError, match=r"^devices \d+ -> \d+: message \d+ is sent as tag"):
        check_pair_order(lower(dict(CASES)["cbm-bapp-p2"]))


def _in_order(lowered) -> bool:
    try:
        check_pair_order(lowered)
    except ValueError:
        return False
    return True


# -------------------------------------------------------------------- on real ranks

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "trainer.steps=2", "runtime.dump_grads=true"]
CBM = ["model=cbm_tiny", "data=image_text", "pipeline.microbatches=4", "pipeline.microbatch_size=2",
       "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null", "logger=none",
       "trainer.steps=2", "runtime.dump_grads=true"]
# GPU ranks under gloo order their messages and pass them through host memory: half of
# the cases run that way too (CUDA's message path on CPU ranks: pipeflow.device_paths)
STAGED = "runtime.cuda_paths=[staging]"
STAGED_ATTENTION = "runtime.cuda_paths=[staging,attention]"  # and a later segment through CUDA's causal bias
RUNS = [("gpipe", SMALL, []), ("1f1b", SMALL, [STAGED]), ("interleaved_1f1b", SMALL, ["pipeline.virtual_stages=2"]),
        ("zb_h1", SMALL, [STAGED]), ("chimera", SMALL, []), ("seq1f1b", SMALL, ["pipeline.segments=2", STAGED_ATTENTION]),
        ("seq1f1b_interleaved", SMALL, ["pipeline.segments=2", "pipeline.virtual_stages=2"]),
        ("amdp", SMALL, ["schedule.windows=1", STAGED]), ("bapp", CBM, [STAGED])]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One single-device run per model, shared by the schedules (trained on first use)."""
    runs: dict[str, dict] = {}

    def get(base: list[str]) -> dict:
        key = "cbm" if base is CBM else "gpt"
        if key not in runs:
            tied = pipeline_runs.GPT_TIED if base is SMALL else None
            runs[key] = pipeline_runs.train(tmp_path_factory.mktemp(f"ref-{key}"), [*base, "pipeline.stages=1"],
                                            tied=tied)
        return runs[key]

    return get


@slow
@pytest.mark.parametrize("name,base,extra", RUNS, ids=[r[0] for r in RUNS])
def test_every_runtime_schedule_trains_to_the_reference_with_ordered_messages(name, base, extra, references,
                                                                              tmp_path):
    tied = pipeline_runs.GPT_TIED if base is SMALL else None
    ref = references(base)
    run = pipeline_runs.train(tmp_path / "run", [*base, *extra, f"schedule={name}", "pipeline.stages=2",
                                                 "runtime.p2p=ordered"], tied=tied)
    pipeline_runs.assert_same_grads(run["grads"], ref["grads"])
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-4)
