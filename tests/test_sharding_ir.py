"""pipeline.shard=full's lowering (pipeflow.schedules.sharding): where each gather policy
puts a stage's GATHER and FREE, that every schedule stays valid with them, and that the
simulator prices a GATHER as the ring all-gather of the stage's weights."""

from __future__ import annotations

import pytest

from pipeflow.config import compose, prepare_simulation
from pipeflow.config.assembly import sharded
from pipeflow.schedules.data_parallel import replicate
from pipeflow.schedules.ir import Kind
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.sharding import GATHER_POLICIES, gathers_per_step
from pipeflow.schedules.validate import validate
from pipeflow.sim.engine import simulate

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2)]


def _full(name: str, v: int, policy: str, p: int = 2, m: int = 4):
    return sharded(replicate(build_schedule(name, p, m, virtual_stages=v), 2), "full", policy)


def test_each_policy_gathers_where_it_says():
    """1F1B and interleaved 1F1B on 2 devices, 2 microbatches, device 0, exactly."""
    def order(name, v, policy):
        return " ".join(map(str, _full(name, v, policy, m=2).orders[0]))

    assert order("1f1b", 1, "step") == "0G@0 0F0 0F1 0B0 0B1 0X@0 0R@0 0S@0"
    assert order("1f1b", 1, "chunk") == order("1f1b", 1, "step")  # one stage a device: the same
    assert order("1f1b", 1, "microbatch") == ("0G@0 0F0 0X@0 0G@1 0F1 0X@1 0G@2 0B0 0X@2 0G@3 0B1 0X@3 "
                                              "0R@0 0S@0")
    assert order("interleaved_1f1b", 2, "step") == "0G@0 0F0 0F1 2G@0 2F0 2F1 2B0 2B1 2X@0 2R@0 0B0 0B1 0X@0 0R@0 0S@0 2S@0"
    assert order("interleaved_1f1b", 2, "chunk") == \
        "0G@0 0F0 0F1 0X@0 2G@0 2F0 2F1 2B0 2B1 2X@0 2R@0 0G@1 0B0 0B1 0X@1 0R@0 0S@0 2S@0"


@pytest.mark.parametrize("policy", GATHER_POLICIES)
@pytest.mark.parametrize("name,v", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_every_schedule_stays_valid_and_every_compute_runs_gathered(name, v, policy):
    sched = _full(name, v, policy)
    validate(sched)
    for order in sched.orders:
        held = set()
        for a in order:
            rep = (a.pipe, a.stage)
            if a.kind == Kind.GATHER:
                assert rep not in held
                held.add(rep)
            elif a.kind == Kind.FREE:
                held.remove(rep)
            elif a.kind in Kind.COMPUTE:
                assert rep in held, f"{a} runs without its stage's parameters"
            elif a.kind in (Kind.REDUCE, Kind.STEP):
                assert rep not in held, f"{a}: the stage is still gathered"
        assert not held
    counts = gathers_per_step(sched)
    computes = {}
    for order in sched.orders:
        for a in order:
            if a.kind in Kind.COMPUTE:
                computes[(a.pipe, a.stage)] = computes.get((a.pipe, a.stage), 0) + 1
    if policy == "step":
        assert set(counts.values()) == {1}
    if policy == "microbatch":  # every action apart, an overlapped pair's two as one
        pairs = {(b.pipe, b.stage) for _f, b in sched.overlapped} | {(f.pipe, f.stage) for f, _b in sched.overlapped}
        for rep, n in computes.items():
            assert counts[rep] <= n and (rep in pairs or counts[rep] == n)


def test_a_gather_is_the_ring_all_gather_of_the_stages_weights():
    """gpt_7b, 4 stages x 2 replicas on dgx_a100_8, gathered every microbatch: each GATHER's
    collective lasts (n-1)/n x bytes / bandwidth + (n-1) x latency of the stage's fp32
    weights; the REDUCE is the reduce-scatter; the STEP updates the shard alone."""
    over = ["model=gpt_7b", "topology=dgx_a100_8", "pipeline.stages=4", "pipeline.data_parallel=2",
            "pipeline.microbatches=8"]
    plain = prepare_simulation(compose("simulate", over))
    full = prepare_simulation(compose("simulate", [*over, "pipeline.shard=full", "pipeline.gather=microbatch"]))
    assert full.schedule.shard == "full" and full.schedule.gather == "microbatch"
    result = simulate(full.schedule, full.cost, full.topology)
    topo, cost = full.topology, full.cost
    seen = 0
    for a, s, e in zip(result.actions, result.start, result.end):
        devs = sorted({row[a.stage] for row in full.schedule.placement.table})
        if a.kind == Kind.GATHER:
            assert e - s == pytest.approx(topo.allgather_time(devs, cost.param_bytes(a.stage)), rel=1e-9)
            seen += 1
        elif a.kind == Kind.REDUCE:
            assert e - s == pytest.approx(topo.reducescatter_time(devs, cost.param_bytes(a.stage)), rel=1e-9)
    assert seen == sum(gathers_per_step(full.schedule).values()) > 0
    base = simulate(plain.schedule, plain.cost, plain.topology)
    steps = {(a.pipe, a.stage): e - s for a, s, e in zip(base.actions, base.start, base.end) if a.kind == Kind.STEP}
    for a, s, e in zip(result.actions, result.start, result.end):
        if a.kind == Kind.STEP:
            assert e - s == pytest.approx(steps[(a.pipe, a.stage)] / 2, rel=1e-9)
