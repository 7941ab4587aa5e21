"""pipeline.data_parallel (issue 18): n replicas of a synchronous pipeline over n x p
ranks, each on its share of the global batch, each stage's gradients all-reduced across
its replicas; the same gradients as one device on the same global batch."""

from __future__ import annotations


import pytest

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation, prepare_training
from pipeflow.planning.placement_plan import build_plan_schedule
from pipeflow.schedules.data_parallel import pipeline_shape, replicate, replicate_onto
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
    return pipeline_runs.global_batch_reference(tmp_path_factory.mktemp("ref"), SMALL)


@slow
@pytest.mark.parametrize("name,extra", CASES, ids=[c[0] for c in CASES])
def test_two_replicas_of_two_stages_match_one_device_on_the_global_batch(name, extra, reference, tmp_path):
    run = pipeline_runs.train(tmp_path, [*SMALL, f"schedule={name}", "pipeline.stages=2", "pipeline.data_parallel=2",
                                         *extra], tied=pipeline_runs.GPT_TIED)
    assert run["summary"]["world_size"] == 4 and run["summary"]["data_parallel"] == 2
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])  # every replica holds the reduced gradient
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("chimera", 1), ("interleaved_1f1b", 2)])
def test_replicas_onto_any_devices_and_microbatches(name, v):
    """replicate_onto: replica r's device d on devices[r][d], its microbatch i on
    microbatch_ids[r][i]; validated, and the same actions as the schedule it replicates."""
    base = build_schedule(name, 2, 4, v)
    rows, ids = [[5, 1], [0, 3]], [[0, 2, 4, 6], [1, 3, 5, 7]]
    dp = replicate_onto([base, base], rows, 6, ids)
    validate(dp)
    assert dp.data_parallel == 2 and dp.orders[2] == [] and dp.orders[4] == []
    for r in range(2):
        for d in range(2):
            got = [(a.kind, a.stage, a.microbatch) for a in dp.orders[rows[r][d]] if a.kind not in (Kind.REDUCE, Kind.STEP)]
            assert got == [(a.kind, a.stage, ids[r][a.microbatch]) for a in base.orders[d]
                           if a.kind not in (Kind.REDUCE, Kind.STEP)]
        for i, mb in enumerate(ids[r]):
            assert dp.pipe_of_microbatch[mb] == r * base.placement.num_pipes + base.pipe_of_microbatch[i]
    with pytest.raises(ValueError, match="every replica needs its own devices"):
        replicate_onto([base, base], [[0, 1], [1, 2]], 6, ids)
    with pytest.raises(ValueError, match="exactly one replica"):
        replicate_onto([base, base], rows, 6, [[0, 1, 2, 3], [3, 4, 5, 6]])


def test_the_planners_replicas_are_pipeline_data_parallel():
    """A plan with replicas on consecutive devices is pipeline.data_parallel's 1F1B, its
    microbatches dealt round robin instead of in blocks; an uneven deal runs too."""
    dp = replicate(build_schedule("1f1b", 3, 2), 2)
    planned = build_plan_schedule([0, 1, 2], 6, 4, [[3, 4, 5]])
    block_to_robin = {r * 2 + i: i * 2 + r for r in range(2) for i in range(2)}
    assert planned.placement == dp.placement and planned.data_parallel == 2
    assert planned.orders == [[a._replace(microbatch=block_to_robin.get(a.microbatch, a.microbatch)) for a in order]
                              for order in dp.orders]
    uneven = build_plan_schedule([0, 2], 4, 5, [[3, 1]])
    validate(uneven)
    assert uneven.pipe_of_microbatch == (0, 1, 0, 1, 0)
    assert pipeline_shape(dp, 3) == {"stages": 3, "data_parallel": 2}


def test_a_simulated_plan_says_its_stages_and_replicas(tmp_path):
    """schedule=planned from a plan.json with replicas: the summary says the plan's stages
    and data_parallel, not pipeline.stages (the devices)."""
    from pipeflow.planning.planner import plan
    from pipeflow.planning.transformer import TransformerSpec
    from pipeflow.simulate import run_simulation
    from pipeflow.topology.presets import get_topology

    cfg = compose("simulate", ["pipeline.stages=4", "pipeline.microbatches=4"])
    p = plan(TransformerSpec.from_config(cfg.model), get_topology("local_cpu", 4), 4, 2, num_stages=2, replicas=2)
    (tmp_path / "plan.json").write_text(p.to_json())
    s = run_simulation(compose("simulate", ["schedule=planned", f"schedule.plan={tmp_path / 'plan.json'}",
                                            "pipeline.stages=4", "pipeline.microbatches=4", "draw=false"]), tmp_path)
    assert (s["stages"], s["data_parallel"], s["num_devices"]) == (2, 2, 4)
