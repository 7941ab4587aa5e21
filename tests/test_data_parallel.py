"""pipeline.data_parallel (issue 18): n replicas of a synchronous pipeline over n x p
ranks, each on its share of the global batch, each stage's gradients all-reduced across
its replicas; the same gradients as one device on the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation, prepare_training
from pipeflow.schedules.data_parallel import replicate
from pipeflow.schedules.ir import Kind
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import validate

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "trainer.steps=2", "runtime.dump_grads=true"]


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("chimera", 1)])
def test_replicas_run_the_schedule_on_their_own_devices_and_microbatches(name, v):
    base = build_schedule(name, 2, 4, v)
    dp = replicate(base, 3)
    validate(dp)
    assert dp.num_devices == 6 and dp.num_microbatches == 12 and dp.placement.num_pipes == 3 * base.placement.num_pipes
    for r in range(3):
        for d in range(2):
            got = [a for a in dp.orders[r * 2 + d] if a.kind not in (Kind.REDUCE, Kind.STEP)]
            want = [a for a in base.orders[d] if a.kind not in (Kind.REDUCE, Kind.STEP)]
            assert [(a.kind, a.stage, a.microbatch - 4 * r) for a in got] == [(a.kind, a.stage, a.microbatch) for a in want]
    # every stage's replicas reduce together, then step
    for order in dp.orders:
        kinds = [a.kind for a in order]
        assert kinds.count(Kind.REDUCE) == kinds.count(Kind.STEP) >= 1
        assert kinds[-kinds.count(Kind.STEP):] == [Kind.STEP] * kinds.count(Kind.STEP)


def test_data_parallel_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match=r"^pipeline.data_parallel=2: schedule 'amdp' is asynchronous"):
        prepare_training(compose("train", ["schedule=amdp", "pipeline.stages=4", "pipeline.microbatches=8",
                                           "pipeline.data_parallel=2"]))
    with pytest.raises(ConfigError, match=r"^pipeline.data_parallel=0: must be a whole number >= 1"):
        prepare_training(compose("train", ["pipeline.data_parallel=0"]))
    with pytest.raises(ConfigError, match=r"^pipeline.data_parallel=2: a branched model"):
        prepare_training(compose("train", ["model=cbm_tiny", "data=image_text", "pipeline.data_parallel=2"]))


def test_a_simulated_data_parallel_step_prices_the_all_reduce():
    """DP x PP on the cluster topology: the replicas' all-reduce is on the timeline, and
    two replicas of a batch take longer than one replica of half of it only by it."""
    base = ["schedule=1f1b", "pipeline.stages=4", "pipeline.microbatches=8", "topology=cluster", "model=gpt_1.5b"]
    from pipeflow.sim.engine import simulate

    one = prepare_simulation(compose("simulate", base))
    two = prepare_simulation(compose("simulate", [*base, "pipeline.data_parallel=2"]))
    r1 = simulate(one.schedule, one.cost, one.topology, record=True)
    r2 = simulate(two.schedule, two.cost, two.topology, record=True)
    reduces = [e for e in r2.timeline.events if e.kind == Kind.REDUCE]
    assert len(reduces) == 8 and all(e.end > e.start for e in reduces)  # one per stage replica
    assert r2.makespan > r1.makespan
    assert r2.collective_bytes > 0 == r1.collective_bytes


CASES = [("gpipe", []), ("1f1b", []), ("interleaved_1f1b", ["pipeline.virtual_stages=2"]), ("zb_h1", []),
         ("chimera", []), ("seq1f1b", ["pipeline.segments=2"])]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device, the global batch of two replicas: 2 x 4 microbatches."""
    return pipeline_runs.train(tmp_path_factory.mktemp("ref"), [*SMALL, "pipeline.stages=1", "pipeline.microbatches=8"],
                               tied=pipeline_runs.GPT_TIED)


@slow
@pytest.mark.parametrize("name,extra", CASES, ids=[c[0] for c in CASES])
def test_two_replicas_of_two_stages_match_one_device_on_the_global_batch(name, extra, reference, tmp_path):
    run = pipeline_runs.train(tmp_path, [*SMALL, f"schedule={name}", "pipeline.stages=2", "pipeline.data_parallel=2",
                                         *extra], tied=pipeline_runs.GPT_TIED)
    assert run["summary"]["world_size"] == 4 and run["summary"]["data_parallel"] == 2
    ref = reference["grads"]
    assert set(run["grads"]) == set(ref)
    for pname, (want,) in ref.items():
        for got in run["grads"][pname]:  # every replica holds the reduced gradient
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()), msg=pname)
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)
