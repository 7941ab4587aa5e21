"""pipeline.shard=optimizer (issue 34, ZeRO-1): each of a stage's data-parallel replicas
keeps and updates its slice of the optimizer state, then the replicas all-gather the
parameters: the single device's gradients and losses, and per rank the optimizer state
the simulator holds, byte for byte."""

from __future__ import annotations

import copy

import pytest
import torch

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "trainer.steps=5", "runtime.dump_grads=true"]
CASES = [("gpipe", []), ("1f1b", []), ("interleaved_1f1b", ["pipeline.virtual_stages=2"]), ("zb_h1", []),
         ("zb_v", ["pipeline.virtual_stages=2"]), ("seq1f1b", ["pipeline.segments=2"])]
# pipeline.shard=full: each schedule under one of the gather policies, every policy covered
GATHER = {"gpipe": "microbatch", "1f1b": "step", "interleaved_1f1b": "chunk", "zb_h1": "microbatch",
          "zb_v": "chunk", "seq1f1b": "microbatch"}


@pytest.mark.parametrize("over,says", [
    (["pipeline.shard=zero3"], "pipeline.shard=zero3: allowed values: none, optimizer, gradients, full"),
    (["pipeline.shard=full", "pipeline.gather=layer"], "pipeline.gather=layer: allowed values: step, chunk, microbatch"),
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
@pytest.mark.parametrize("shard", ["optimizer", "gradients", "full"])
@pytest.mark.parametrize("name,extra", CASES, ids=[c[0] for c in CASES])
def test_sharded_replicas_match_one_device_on_the_global_batch(name, extra, shard, reference, tmp_path):
    """2 replicas of 2 stages, each updating half of every stage's optimizer state (with
    ``gradients`` keeping half of its reduce-scattered gradients, with ``full`` half of its
    parameters too, gathered by the schedule's GATHERs): the single device's gradients
    (ZeRO-2/3: the slices the replicas hold, gathered), and its 5 losses (the updates
    each replica applies to its slice are the whole update, clipped by the norm of the
    whole gradient)."""
    gather = [f"pipeline.gather={GATHER[name]}"] if shard == "full" else []
    run = pipeline_runs.train(tmp_path, [*SMALL, f"schedule={name}", "pipeline.stages=2", "pipeline.data_parallel=2",
                                         f"pipeline.shard={shard}", *gather, *extra], tied=pipeline_runs.GPT_TIED)
    assert run["summary"]["world_size"] == 4 and run["summary"]["data_parallel"] == 2
    assert run["summary"]["shard"] == shard and run["summary"]["gather"] == (GATHER[name] if shard == "full" else None)
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


@slow
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_chimeras_mirror_replicas_shard_and_match_one_device(shard, reference, tmp_path):
    """Chimera's two pipelines hold each stage twice, on devices that hold their stages in
    opposite orders; their sharded steps (blocking all-gathers, one group per stage) once
    waited for each other for good. 2 stages x 2 replicas: the single device's gradients
    and losses."""
    run = pipeline_runs.train(tmp_path, [*SMALL, "schedule=chimera", "pipeline.stages=2", "pipeline.data_parallel=2",
                                         f"pipeline.shard={shard}", "runtime.timeout_s=20", "runtime.hang_timeout_s=10"],
                              tied=pipeline_runs.GPT_TIED)
    assert run["summary"]["world_size"] == 4 and run["summary"]["shard"] == shard
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


@slow
def test_each_sharding_level_lowers_each_ranks_memory_as_simulated(tmp_path):
    """gpt_tiny interleaved 1F1B (2 chunks a device), 2 replicas of 2 devices, fp32, short
    sequences, so that a rank peaks where its stages' gradients are reduced: per rank the
    optimizer state the profile measures is the simulator's to the byte (a tied copy's
    moments stay whole), every level's peak (and each gather policy's) is the simulator's
    within the memory model's 3%, and it falls with each level, measured as simulated
    (ZeRO-2: the whole gradients go at their reduce-scatter; ZeRO-3: the parameters'
    other half). The losses are the unsharded run's (ZeRO-1 bit for bit)."""
    from pipeflow.simulate import run_simulation

    over = ["model=gpt_tiny", "model.seq_len=16", "schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
            "pipeline.stages=2", "pipeline.data_parallel=2", "precision=fp32", "pipeline.microbatches=2",
            "pipeline.microbatch_size=1"]
    peaks, losses = {}, {}
    for shard in ("none", "optimizer", "gradients", "full", "full:microbatch"):
        mine = [*over, *f"pipeline.shard={shard}".replace(":", " pipeline.gather=").split()]
        trained = pipeline_runs.train(tmp_path / shard, [*mine, "trainer.steps=2", "trainer.val_every=0",
                                                         "logger=none", "runtime.memory=profile"])
        run, losses[shard] = trained["summary"], trained["losses"]
        sim = run_simulation(compose("simulate", [*mine, "draw=false", "topology=local_cpu"]), tmp_path / f"sim_{shard}")
        for meas, predicted in zip(run["memory_profile"], sim["per_device"]):
            assert predicted["memory_at_peak"]["optimizer_state"] == pytest.approx(
                meas["at_peak"]["optimizer_state"], rel=1e-4)
            assert predicted["peak_memory_bytes"] == pytest.approx(meas["peak_bytes"], rel=0.03), shard
        peaks[shard] = ([m["peak_bytes"] for m in run["memory_profile"]],
                        [d["peak_memory_bytes"] for d in sim["per_device"]])
    # (fused AdamW, the default: each slice's update the whole tensors' to rounding; the
    # single-tensor update, op for op, is the same bit for bit: the test below)
    for shard in ("optimizer", "gradients", "full", "full:microbatch"):  # (the clip norm summed by slices)
        assert losses[shard] == pytest.approx(losses["none"], rel=1e-6)
    # (full with pipeline.gather=step gathers each chunk once a step and lets it go after
    # its last backward: the peak, at the reduction, less the parameters' other half;
    # gathering for every forward and backward puts a gather inside the backwards)
    for less, more in (("optimizer", "none"), ("gradients", "optimizer"), ("full", "gradients"),
                       ("full:microbatch", "gradients"), ("full", "full:microbatch")):
        for a, b, c, d in zip(peaks[less][0], peaks[more][0], peaks[less][1], peaks[more][1]):
            assert a < b and c < d, f"{less} not below {more}: measured {a} and {b}, simulated {c} and {d}"
            assert b - a == pytest.approx(d - c, abs=0.005 * b), f"{less} against {more}"  # (half a percent of the peak)


@slow
@pytest.mark.parametrize("shard", ["full"])  # (ZeRO-1's and ZeRO-2's state is ZeRO-3's, without the weights)
def test_a_sharded_run_resumes_onto_the_same_sharding_and_continues_exactly(shard, tmp_path):
    """A checkpoint holds the replicas' slices of the optimizer state gathered whole, its
    weights written and loaded gathered (ZeRO-3: its shares taken from them): resumed,
    steps 3-5 are the uninterrupted run's; resumed without sharding too (the checkpoint
    does not depend on the layout: issue 60)."""
    common = [*SMALL, "schedule=1f1b", "pipeline.stages=2", "pipeline.data_parallel=2"]
    whole = pipeline_runs.train(tmp_path / "whole", [*common, f"pipeline.shard={shard}"])
    short = pipeline_runs.train(tmp_path / "short", [*common, f"pipeline.shard={shard}", "trainer.steps=2"])
    resumed = pipeline_runs.train(tmp_path / "resumed", [*common, f"pipeline.shard={shard}",
                                                          f"resume={tmp_path / 'short'}"])
    assert short["losses"] == pytest.approx(whole["losses"][:2], rel=1e-6)
    assert resumed["losses"] == pytest.approx(whole["losses"][2:], rel=1e-6)
    unsharded = pipeline_runs.train(tmp_path / "unsharded", [*common, f"resume={tmp_path / 'short'}"])
    assert unsharded["summary"]["shard"] == "none"
    assert unsharded["losses"] == pytest.approx(whole["losses"][2:], rel=2e-5)


def test_a_sharded_slices_update_is_torchs_adamw(tmp_path):
    """ShardedAdamW's update of its slice, on a one-rank group (the slice the whole flat):
    with ``optim.impl=single`` torch's single-tensor AdamW op for op, bit for bit; fused,
    torch's fused kernel over the flat, the per-tensor fused update to rounding."""
    import torch.distributed as dist

    from pipeflow.formats.settings import AdamWConfig
    from pipeflow.runtime.optimizer import make_optimizer
    from pipeflow.runtime.sharded import ShardedAdamW

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for impl, exact in (("single", True), ("fused", False)):
            optim = AdamWConfig(lr=1e-2, weight_decay=0.1, impl=impl)
            torch.manual_seed(0)
            ref = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 5))
            mine = copy.deepcopy(ref)
            plain = make_optimizer(ref, optim)
            sharded = ShardedAdamW(mine, optim, list(mine.parameters()), [], dist.group.WORLD)
            for step in range(4):
                x = torch.randn(3, 13)
                for module in (ref, mine):
                    module(x).square().sum().backward()
                plain.step()
                sharded.step()
                plain.zero_grad(set_to_none=True)
                sharded.zero_grad()
            for a, b in zip(ref.parameters(), mine.parameters()):
                if exact:
                    assert torch.equal(a, b), impl
                else:
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_a_sharded_step_updates_an_nth_and_all_gathers_on_the_ring():
    """gpt_7b, 4 stages x 2 replicas on dgx_a100_8: a replicated stage's STEP under
    ZeRO-1 and ZeRO-2 lasts the unsharded STEP's half plus the ring all-gather of its fp32 weights,
    (n-1)/n x bytes / bandwidth + (n-1) x latency; and the simulated optimizer state of
    every device falls by half of its stages' (but the tied embedding's moments, which
    each end stage keeps whole for its copy: the runtime's tied copies update themselves)."""
    import dataclasses

    from pipeflow.schedules.ir import Kind
    from pipeflow.sim.engine import simulate
    from pipeflow.planning.transformer import shared_head_params
    from pipeflow.sim.device_memory import device_memory

    over = ["model=gpt_7b", "topology=dgx_a100_8", "pipeline.stages=4", "pipeline.data_parallel=2",
            "pipeline.microbatches=8"]
    plain = prepare_simulation(compose("simulate", over))
    sharded = dataclasses.replace(plain.schedule, shard="optimizer")
    steps, memory, reduced = {}, {}, {}
    for name, schedule in (("none", plain.schedule), ("optimizer", sharded),
                           ("gradients", dataclasses.replace(plain.schedule, shard="gradients"))):
        result = simulate(schedule, plain.cost, plain.topology)
        steps[name] = {(a.pipe, a.stage): e - s for a, s, e in zip(result.actions, result.start, result.end)
                       if a.kind == Kind.STEP}
        reduced[name] = {(a.pipe, a.stage): e for a, e in zip(result.actions, result.end) if a.kind == Kind.REDUCE}
        memory[name] = device_memory(schedule, plain.cost, result.per_device)
    topo = plain.topology
    # ZeRO-2: each REDUCE issued when ZeRO-1's is, its ring half as long: a reduce-scatter
    # (on gloo's CPU ranks, which have none, an all-reduce; their all-gathers too)
    assert steps["gradients"] == steps["optimizer"]
    for (pipe, stage), end in reduced["gradients"].items():
        devs = sorted({row[stage] for row in plain.schedule.placement.table})
        grads = plain.cost.param_bytes(stage)
        assert reduced["optimizer"][(pipe, stage)] - end == pytest.approx(
            topo.allreduce_time(devs, grads) - topo.reducescatter_time(devs, grads), rel=1e-9)
        assert topo.reducescatter_time(devs, grads) == pytest.approx(topo.allgather_time(devs, grads), rel=1e-9)
    cpu = prepare_simulation(compose("simulate", ["topology=local_cpu", "pipeline.data_parallel=2"])).topology
    assert cpu.reducescatter_time([0, 4], 1e6) == cpu.allreduce_time([0, 4], 1e6) == cpu.allgather_time([0, 4], 1e6)
    assert topo.allreduce_time([0, 4], 1e6) > topo.allgather_time([0, 4], 1e6) > 0
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
