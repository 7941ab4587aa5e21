"""pipeline.shard=optimizer (issue 34, ZeRO-1): each of a stage's data-parallel replicas
keeps and updates its slice of the optimizer state, then the replicas all-gather the
parameters: the single device's gradients and losses, and per rank the optimizer state
the simulator holds, byte for byte."""

from __future__ import annotations

import pytest

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "trainer.steps=5", "runtime.dump_grads=true"]
CASES = [("gpipe", []), ("1f1b", []), ("interleaved_1f1b", ["pipeline.virtual_stages=2"]), ("zb_h1", []),
         ("zb_v", ["pipeline.virtual_stages=2"]), ("seq1f1b", ["pipeline.segments=2"])]


@pytest.mark.parametrize("over,says", [
    (["pipeline.shard=gradients"], "pipeline.shard=gradients: allowed values: none, optimizer"),
    (["pipeline.shard=optimizer", "schedule=amdp"], "pipeline.shard=optimizer: schedule 'amdp' is asynchronous"),
    (["pipeline.shard=optimizer", "model=cbm_tiny"], "pipeline.shard=optimizer: a branched model's stages")])
def test_a_sharding_the_run_cannot_take_is_refused_before_any_rank_starts(over, says):
    with pytest.raises(ConfigError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        prepare_simulation(compose("simulate", [*over, "topology=local_cpu"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device, the global batch of two replicas (2 x 4 microbatches), 5 steps."""
    return pipeline_runs.global_batch_reference(tmp_path_factory.mktemp("ref"), SMALL)


@slow
@pytest.mark.parametrize("name,extra", CASES, ids=[c[0] for c in CASES])
def test_sharded_replicas_match_one_device_on_the_global_batch(name, extra, reference, tmp_path):
    """2 replicas of 2 stages, each updating half of every stage's optimizer state: the
    single device's gradients on every replica, and its 5 losses (the updates each
    replica applies to its slice and all-gathers are the whole update)."""
    run = pipeline_runs.train(tmp_path, [*SMALL, f"schedule={name}", "pipeline.stages=2", "pipeline.data_parallel=2",
                                         "pipeline.shard=optimizer", *extra], tied=pipeline_runs.GPT_TIED)
    assert run["summary"]["world_size"] == 4 and run["summary"]["data_parallel"] == 2
    assert run["summary"]["shard"] == "optimizer"
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


@slow
def test_sharding_the_optimizer_state_lowers_each_ranks_memory_as_simulated(tmp_path):
    """gpt_tiny 1F1B, 2 replicas of 2 stages, fp32: per rank the optimizer state the
    profile measures is the simulator's to the byte (a tied copy's moments stay whole),
    and the peak falls by it, as simulated (within the memory model's 3%); the losses are
    the unsharded run's, bit for bit."""
    from pipeflow.simulate import run_simulation

    over = ["model=gpt_tiny", "schedule=1f1b", "pipeline.stages=2", "pipeline.data_parallel=2", "precision=fp32",
            "pipeline.microbatches=8", "pipeline.microbatch_size=4"]
    peaks, losses = {}, {}
    for shard in ("none", "optimizer"):
        mine = [*over, f"pipeline.shard={shard}"]
        trained = pipeline_runs.train(tmp_path / shard, [*mine, "trainer.steps=2", "trainer.val_every=0",
                                                         "logger=none", "runtime.memory=profile"])
        run, losses[shard] = trained["summary"], trained["losses"]
        sim = run_simulation(compose("simulate", [*mine, "draw=false", "topology=local_cpu"]), tmp_path / f"sim_{shard}")
        for meas, predicted in zip(run["memory_profile"], sim["per_device"]):
            assert predicted["memory_at_peak"]["optimizer_state"] == pytest.approx(
                meas["at_peak"]["optimizer_state"], rel=1e-4)
            assert predicted["peak_memory_bytes"] == pytest.approx(meas["peak_bytes"], rel=0.03)
        peaks[shard] = ([m["peak_bytes"] for m in run["memory_profile"]],
                        [d["peak_memory_bytes"] for d in sim["per_device"]])
    assert losses["optimizer"] == losses["none"]  # AdamW's update of each slice, op for op: the same weights
    for (measured, simulated), (measured_sharded, simulated_sharded) in [(peaks["none"], peaks["optimizer"])]:
        for a, b, c, d in zip(measured, measured_sharded, simulated, simulated_sharded):
            assert b < a and d < c
            assert (a - b) == pytest.approx(c - d, rel=0.03)


@slow
def test_a_sharded_run_resumes_onto_the_same_sharding_and_continues_exactly(tmp_path):
    """A checkpoint holds each replica's slice: resumed, steps 3-5 are the uninterrupted
    run's; resumed without sharding, it is refused before any rank starts."""
    from pipeflow.config import prepare_training

    common = [*SMALL, "schedule=1f1b", "pipeline.stages=2", "pipeline.data_parallel=2"]
    full = pipeline_runs.train(tmp_path / "full", [*common, "pipeline.shard=optimizer"])
    short = pipeline_runs.train(tmp_path / "short", [*common, "pipeline.shard=optimizer", "trainer.steps=2"])
    resumed = pipeline_runs.train(tmp_path / "resumed", [*common, "pipeline.shard=optimizer",
                                                          f"resume={tmp_path / 'short'}"])
    assert short["losses"] == pytest.approx(full["losses"][:2], rel=1e-6)
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-6)
    with pytest.raises(ConfigError, match="shard=optimizer, this run has shard=none"):
        prepare_training(compose("train", [*common, f"resume={tmp_path / 'short'}"]))


def test_a_sharded_step_updates_an_nth_and_all_gathers_on_the_ring():
    """gpt_7b, 4 stages x 2 replicas on dgx_a100_8: a replicated stage's STEP under
    ZeRO-1 lasts the unsharded STEP's half plus the ring all-gather of its fp32 weights,
    (n-1)/n x bytes / bandwidth + (n-1) x latency; and the simulated optimizer state of
    every device falls by half of its stages' (but the tied embedding's moments, which
    each end stage keeps whole for its copy: the runtime's tied copies update themselves)."""
    import dataclasses

    from pipeflow.schedules.ir import Kind
    from pipeflow.sim.engine import simulate
    from pipeflow.planning.transformer import shared_head_params
    from pipeflow.sim.memory import device_memory

    over = ["model=gpt_7b", "topology=dgx_a100_8", "pipeline.stages=4", "pipeline.data_parallel=2",
            "pipeline.microbatches=8"]
    plain = prepare_simulation(compose("simulate", over))
    sharded = dataclasses.replace(plain.schedule, shard="optimizer")
    steps, memory = {}, {}
    for name, schedule in (("none", plain.schedule), ("optimizer", sharded)):
        result = simulate(schedule, plain.cost, plain.topology)
        steps[name] = {(a.pipe, a.stage): e - s for a, s, e in zip(result.actions, result.start, result.end)
                       if a.kind == Kind.STEP}
        memory[name] = device_memory(schedule, plain.cost, result.per_device)
    topo = plain.topology
    for (pipe, stage), t in steps["optimizer"].items():
        devs = sorted({row[stage] for row in plain.schedule.placement.table})
        weights = plain.cost.state_bytes(stage)["parameters"]
        route = topo._routes[devs[0]][devs[1]]
        ring = (1 / 2) * weights / min(topo.resource_bandwidth[x] for x in route.resources) + route.latency
        if topo.collective_bandwidth is not None:
            ring = max(ring, (1 / 2) * weights / topo.collective_bandwidth + route.latency)
        assert t == pytest.approx(steps["none"][(pipe, stage)] / 2 + topo.allgather_time(devs, weights), rel=1e-9)
        assert topo.allgather_time(devs, weights) == pytest.approx(ring, rel=1e-9)
    for d, (a, b) in enumerate(zip(memory["none"], memory["optimizer"])):
        held = [s for _, s in plain.schedule.placement.stages_on(d)]
        whole = sum(plain.cost.state_bytes(s)["optimizer_state"] for s in held)
        tied = sum(8.0 * shared_head_params(plain.spec) for s in held if s in (0, plain.schedule.num_stages - 1))
        assert a["at_peak"]["optimizer_state"] - b["at_peak"]["optimizer_state"] == pytest.approx((whole - tied) / 2)
