"""The discrete-event simulator: closed forms, communication, contention, collectives,
memory accounting, determinism, and the invariants every simulated schedule must keep."""

import dataclasses
import json

import pytest

from pipeflow.planning.cost import AnalyticCost
from pipeflow.planning.unit_cost import UnitCost
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.common import finish_sync
from pipeflow.schedules.deps import DepResolver
from pipeflow.schedules.ir import B, F, I, REDUCE, STEP, W, Kind, Placement, Schedule, StageGraph, WeightPolicy
from pipeflow.schedules.registry import build_schedule, get_spec, schedule_names
from pipeflow.schedules.validate import validate
from pipeflow.sim import SimulationError, compile_schedule, simulate
from pipeflow.topology import TopologyBuilder, get_topology
from pipeflow.topology.topology import Device

CPU = Device("cpu", 1e11, 8 * 2**30, 2e10)


def free_links(n: int):
    """n devices whose messages cost nothing: zero latency (bytes are zero in UnitCost)."""
    return get_topology("local_cpu", num_devices=n, latency=0.0)


def run(schedule, cost=None, topology=None, record=False):
    cost = cost or UnitCost(schedule.num_stages)
    return simulate(schedule, cost, topology or free_links(schedule.num_devices), record=record)


# ----------------------------------------------------------------- closed forms
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 13])
def test_bubble_ratio_matches_closed_form(name, p, m):
    sched = build_schedule(name, p, m)
    for f, b in [(1.0, 2.0), (1.0, 1.0), (0.5, 1.7), (2.0, 3.0)]:
        r = run(sched, UnitCost(p, forward=f, backward=b, weight=b / 2))
        assert r.makespan == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
        assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        for d in r.per_device:
            assert d.busy == pytest.approx(m * (f + b))
            assert d.idle == pytest.approx(r.makespan - d.busy)


@pytest.mark.parametrize("p", [1, 2, 4, 6])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_peak_live_microbatches_on_device_0(p, m):
    g = run(build_schedule("gpipe", p, m))
    o = run(build_schedule("1f1b", p, m))
    assert g.per_device[0].peak_live_microbatches == m
    assert o.per_device[0].peak_live_microbatches == min(p, m)
    # with UnitCost(activation=a) the activation peak is the same count times a
    o2 = run(build_schedule("1f1b", p, m), UnitCost(p, activation=3.5))
    assert o2.per_device[0].peak_activation_bytes == pytest.approx(3.5 * min(p, m))


def test_step_time_adds_to_the_end_and_to_busy():
    p, m, step = 3, 4, 0.75
    r = run(build_schedule("1f1b", p, m), UnitCost(p, step=step))
    assert r.makespan == pytest.approx((m + p - 1) * 3.0 + step)
    assert r.per_device[0].busy == pytest.approx(m * 3.0 + step)


# ---------------------------------------------------------------- communication
@pytest.mark.parametrize("nbytes, bandwidth, latency", [(1e6, 1e9, 1e-5), (5.0, 2.0, 0.25), (0.0, 3.0, 0.5)])
def test_two_stage_message_cost(nbytes, bandwidth, latency):
    f, b = 1.0, 2.0
    sched = build_schedule("gpipe", 2, 1)
    topo = get_topology("local_cpu", num_devices=2, bandwidth=bandwidth, latency=latency)
    r = run(sched, UnitCost(2, forward=f, backward=b, message=nbytes, comm=None), topo, record=True)
    hop = latency + nbytes / bandwidth
    assert r.makespan == pytest.approx(f + f + b + b + 2 * hop, rel=1e-12)
    assert r.p2p_bytes == pytest.approx(2 * nbytes)  # one activation, one gradient
    assert r.per_device[0].sent_bytes == r.per_device[1].sent_bytes == pytest.approx(nbytes)
    comm = r.timeline.select(stream="comm")
    assert sorted((e.src, e.dst) for e in comm) == [(0, 1), (1, 0)]
    for e in comm:
        assert e.end - e.start == pytest.approx(hop)


def test_p2p_volume_of_1f1b():
    p, m, msg = 4, 6, 10.0
    r = run(build_schedule("1f1b", p, m), UnitCost(p, message=msg, comm=None))
    assert r.p2p_bytes == pytest.approx(2 * (p - 1) * m * msg)
    # inner stages send an activation forward and a gradient back per microbatch
    assert [d.sent_bytes for d in r.per_device] == pytest.approx([m * msg] + [2 * m * msg] * (p - 2) + [m * msg])


def _join_schedule() -> Schedule:
    """Stages 0 and 1 both feed stage 2 (a join); one device per stage, one microbatch."""
    graph = StageGraph(3, ((0, 2), (1, 2)))
    orders = [[F(s, 0), B(s, 0)] for s in range(3)]
    return validate(finish_sync("join", graph, Placement.single([0, 1, 2]), orders, 1))


def _star_topology(shared: bool, bandwidth: float = 2.0, latency: float = 0.5):
    """Devices 0 and 1 talk to device 2. ``shared``: both directions into 2 use one port
    and both out of 2 use another, so concurrent transfers serialize."""
    b = TopologyBuilder("star", [CPU] * 3)
    if shared:
        into, out = b.resource("into2", bandwidth, latency), b.resource("outof2", bandwidth, latency)
        ports = {(0, 2): [into], (1, 2): [into], (2, 0): [out], (2, 1): [out]}
    else:
        ports = {(s, t): [b.resource(f"{s}->{t}", bandwidth, latency)] for s, t in [(0, 2), (1, 2), (2, 0), (2, 1)]}
    ports[(0, 1)] = [b.resource("0->1", bandwidth, latency)]
    ports[(1, 0)] = [b.resource("1->0", bandwidth, latency)]
    for (s, t), res in ports.items():
        b.path(s, t, res)
    return b.build()


def test_transfers_sharing_a_resource_serialize():
    f, bw_time, nbytes, bandwidth, latency = 1.0, 2.0, 6.0, 2.0, 0.5
    sched = _join_schedule()
    cost = UnitCost(3, forward=f, backward=bw_time, message=nbytes, comm=None)
    xfer = nbytes / bandwidth
    apart = run(sched, cost, _star_topology(False, bandwidth, latency), record=True)
    shared = run(sched, cost, _star_topology(True, bandwidth, latency), record=True)
    # disjoint links: both activations arrive together, both gradients leave together
    assert apart.makespan == pytest.approx(2 * f + 2 * bw_time + 2 * (latency + xfer))
    # one port: the second activation and the second gradient each wait one transfer
    assert shared.makespan == pytest.approx(apart.makespan + 2 * xfer)
    t = shared.times()
    assert t[F(2, 0)][0] == pytest.approx(f + 2 * xfer + latency)
    # the gradient that got the port first (ties go to the lower action id) is earlier by one transfer
    assert t[B(1, 0)][0] - t[B(0, 0)][0] == pytest.approx(xfer)
    into = sorted((e.start, e.end) for e in shared.timeline.select(stream="comm") if e.dst == 2)
    assert into[1][0] == pytest.approx(into[0][0] + xfer)


# ----------------------------------------------------------- REDUCE and STEP
def _two_pipe_schedule() -> Schedule:
    """Chimera in miniature: pipe 0 runs stage 0 on device 0 and stage 1 on device 1,
    pipe 1 the other way round; microbatch 0 on pipe 0, microbatch 1 on pipe 1."""
    placement = Placement(2, ((0, 1), (1, 0)))
    orders = [
        [F(0, 0, 0), F(1, 1, 1), B(1, 1, 1), B(0, 0, 0)],
        [F(0, 1, 1), F(1, 0, 0), B(1, 0, 0), B(0, 1, 1)],
    ]
    sched = finish_sync("two_pipes", StageGraph.chain(2), placement, orders, 2, pipe_of_microbatch=(0, 1))
    return validate(sched)


@pytest.mark.parametrize("reduce_time", [0.5, 1.0, 4.5])
@pytest.mark.parametrize("step", [0.0, 0.25])
def test_reduce_overlaps_compute_and_gates_step(reduce_time, step):
    f, b, params, bandwidth = 1.0, 2.0, 8.0, None
    bandwidth = params / reduce_time  # a 2-device ring all-reduce takes params / bandwidth
    sched = _two_pipe_schedule()
    topo = get_topology("local_cpu", num_devices=2, bandwidth=bandwidth, latency=0.0)
    assert topo.allreduce_time([0, 1], params) == pytest.approx(reduce_time)
    r = run(sched, UnitCost(2, forward=f, backward=b, step=step, params=params), topo, record=True)
    t = r.times()
    # stage 1's replicas finish their backward at 2F+B on both devices and issue its REDUCE
    r1_issue = 2 * f + b
    assert r.issued[REDUCE(1, 0)] == pytest.approx(r1_issue)
    assert t[REDUCE(1, 0)] == t[REDUCE(1, 1)] == pytest.approx((r1_issue, r1_issue + reduce_time))
    # the compute stream does not wait for the all-reduce
    assert t[B(0, 0, 0)][0] == pytest.approx(r1_issue)
    # stage 0's all-reduce queues behind stage 1's on the collective streams
    r0_start = max(2 * f + 2 * b, r1_issue + reduce_time)
    assert t[REDUCE(0, 0)] == pytest.approx((r0_start, r0_start + reduce_time))
    # each STEP waits for its own stage's REDUCE; device 0 steps stage 0 (pipe 0) first
    assert t[STEP(0, 0)][0] == pytest.approx(max(2 * f + 2 * b, r0_start + reduce_time))
    assert r.makespan == pytest.approx(t[STEP(0, 0)][0] + 2 * step)
    assert r.collective_bytes == pytest.approx(4 * params)  # two stages, two members each
    assert [d.collective_bytes for d in r.per_device] == pytest.approx([2 * params] * 2)
    coll = r.timeline.select(stream="collective")
    assert len(coll) == 4 and all(e.nbytes == params for e in coll)


def test_reduce_with_one_replica_is_a_no_op():
    f, b, step = 1.0, 2.0, 0.5
    orders = [[F(0, 0), B(0, 0), REDUCE(0), STEP(0)]]
    sched = validate(Schedule("one", StageGraph.chain(1), Placement.single([0]), orders, 1))
    r = run(sched, UnitCost(1, forward=f, backward=b, step=step, params=100.0), get_topology("local_cpu", num_devices=1))
    assert r.times()[REDUCE(0)] == (f + b, f + b)
    assert r.makespan == pytest.approx(f + b + step)
    assert r.collective_bytes == 0


# -------------------------------------------------------------------- memory
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h2", "interleaved_zb", "seq1f1b_interleaved", "chimera",
                                  "dualpipe_v", "pipedream_2bw"])
def test_the_memory_walk_priced_as_arrays_is_the_walk(name):
    """The search prices thousands of costs on one schedule by the walk's steps as arrays
    (sim.memory_peaks.Peaks); every device's peak is the walk's own, to the byte, with the
    zero-bubble residuals, Seq1F1B's key/value gradients, recomputation, 16-bit casts,
    a second pipeline's messages and an asynchronous policy's weight versions."""
    from pipeflow.sim.device_memory import device_memory
    from pipeflow.sim.device_walk import tapes
    from pipeflow.sim.memory_peaks import Peaks
    from pipeflow.sim.memory_terms import term_value

    spec = get_spec(name)
    sched = build_schedule(name, 4, 8, virtual_stages=2 if spec.virtual_stages else 1,
                           segments=2 if spec.segments else 1)
    base = TransformerSpec("tiny", n_layer=16, n_head=4, n_embd=256, vocab_size=1000, seq_len=128)
    for recompute, dtype in (("none", 4), ("full", 2)):
        cost = AnalyticCost(dataclasses.replace(base, recompute=recompute), sched.num_stages, microbatch_size=2,
                            dtype_bytes=dtype, segment_lengths=[96, 32] if sched.num_segments > 1 else None)
        per = simulate(sched, cost, get_topology("dgx_a100_8"), record=False).per_device
        walked = [d["peak_bytes"] for d in device_memory(sched, cost, per)]
        arrays = Peaks(tapes(sched))
        assert list(arrays.peaks([term_value(k, cost, per) for k in arrays.terms])) == pytest.approx(walked, rel=1e-12)
        assert len(set(walked)) > 1  # the devices differ: the test can tell them apart
        if sched.placement.num_pipes == 1 and sched.policy == WeightPolicy.SYNC:
            # the search prices a candidate without replicas on the replicated walk, with
            # one replica (nothing at its REDUCEs): the same peaks as the walk's own
            from pipeflow.planning.search.closed_form import priced_as
            from pipeflow.schedules.data_parallel import as_replica

            one = as_replica(sched)
            one = dataclasses.replace(one, shard="gradients")
            rep = Peaks(tapes(one, replicas=2))
            assert list(rep.peaks([term_value(priced_as(k, "none", 1), cost) for k in rep.terms])) == pytest.approx(
                walked, rel=1e-12)


@pytest.mark.parametrize("name", [n for n in schedule_names() if n not in ("bapp", "file") and not get_spec(n).assemble])
def test_a_devices_walk_copies_its_pieces_as_it_would_write_them(name, monkeypatch):
    """DeviceWalk writes the steps that depend on an action's stage and segment only once
    and copies them after (pipeflow.sim.device_walk): every device's tape, the sharded
    twin's too, is the one written afresh for each action, step by step and action by
    action, with every option that changes a walk (segments, chunks, pipes, weight
    versions, local neighbours, replicas)."""
    from pipeflow.schedules.data_parallel import as_replica
    from pipeflow.schedules.sharding import with_gathers
    from pipeflow.sim.device_walk import DeviceWalk, tapes

    spec = get_spec(name)
    sched = build_schedule(name, 4, 12, virtual_stages=2 if spec.virtual_stages else 1,
                           segments=3 if spec.segments else 1, check=False)
    walks = [lambda: tapes(sched)]
    if sched.policy == WeightPolicy.SYNC:
        full = with_gathers(as_replica(sched), "microbatch", every_stage=True)
        full = dataclasses.replace(full, shard="full")
        walks.append(lambda: sum(tapes(full, replicas=2, bare="gradients"), []))

    def seen(t):
        return t.named(), [(i, str(a)) for i, a in t.starts]

    for walk in walks:
        reused = [seen(t) for t in walk()]
        monkeypatch.setattr(DeviceWalk, "reuse", False)
        assert [seen(t) for t in walk()] == reused
        monkeypatch.setattr(DeviceWalk, "reuse", True)
        assert any(len(steps) > 4 * len(starts) for steps, starts in reused)  # (pieces of several steps)


def test_an_asynchronous_walk_holds_each_microbatchs_casts_and_the_tied_updates_not_yet_applied():
    """PipeDream on 4 devices: each forward casts the weights anew (their version moved),
    so stage 0 holds one cast per microbatch in flight (4), where 1F1B shares one; and
    the last stage holds each update's gradient of the tied embedding from its own STEP
    until the STEP after stage 0's backward of that update (pipeflow.runtime.async_executor
    applies it there, by the same plan), while stage 0 applies its own at once."""
    from pipeflow.schedules.versions import tied_update_plan
    from pipeflow.sim.device_walk import tapes
    from pipeflow.sim.memory_terms import REQUIRED

    class Only:  # every term 0 but the one priced (said so: the walk refuses a term not declared)
        absent_terms = REQUIRED

        def __init__(self, name):
            self.name = name

        def __getattr__(self, attr):
            if attr == self.name:
                return lambda *a: 1.0
            if attr == "state_bytes":
                return lambda s: {"parameters": 0.0, "optimizer_state": 0.0, "gradients": 0.0,
                                  "casts": 1.0 if self.name == "casts" else 0.0}
            raise AttributeError(attr)

    def category_peaks(sched, name, category):
        return [t.walk(t.values(Only(name), None, {}))["category_peaks"][category] for t in tapes(sched)]

    async_ = build_schedule("pipedream", 4, 8)
    assert category_peaks(async_, "casts", "casts") == [4.0, 3.0, 2.0, 1.0]
    assert category_peaks(build_schedule("1f1b", 4, 8), "casts", "casts") == [1.0] * 4
    plan = tied_update_plan(async_, (0, 3))
    # stage 0 applies each update at its own STEP; the last stage some STEPs later
    assert all(u == [w] for (_, _, w), u in plan[0].items())
    late = sum(w > u[0] or w == -1 for (_, _, w), u in plan[3].items())
    held = category_peaks(async_, "tied_gradient_bytes", "gradients")
    assert held[0] == 0.0 and held[1] == held[2] == 0.0 and held[3] == late > 1


def test_a_zero_bubble_w_runs_its_products_beside_what_i_kept_for_it():
    """W's products (their results, the host's scratch, at 16 bits the fp32 copies; in a
    stage without gradients yet, the gradients made by then) run while what I kept for
    that W is still held: the runtime lets it go when W returns. So on every device the
    walk's peak on each later stage is the most residuals ever held plus W's working set,
    where a W's peak after its release would have been one residual less."""
    from pipeflow.sim.device_walk import tapes
    from pipeflow.sim.memory_terms import REQUIRED

    class Priced:  # only the residuals and W's working set cost anything
        absent_terms = REQUIRED - {"weight_residual_bytes", "weight_workspace_bytes", "state_bytes"}

        def __init__(self, fresh):
            self.fresh = fresh

        def weight_residual_bytes(self, stage, segment):
            return 1.0

        def weight_workspace_bytes(self, stage, segment):
            return 10.0

        def fresh_weight_workspace_bytes(self, stage, segment):
            return self.fresh

        def state_bytes(self, stage):
            return {"parameters": 0.0, "optimizer_state": 0.0, "gradients": 0.0, "casts": 0.0}

    first_stage, *later = tapes(build_schedule("zb_h1", 4, 8))
    # (the first stage's input needs no gradient: its I is empty, its W the whole backward)
    assert first_stage.walk(first_stage.values(Priced(10.0), None, {}))["category_peaks"]["residuals"] == 0.0
    for t in later:
        held = t.walk(t.values(Priced(10.0), None, {}))
        assert held["peak_bytes"] == held["category_peaks"]["residuals"] + 10.0
        first = t.walk(t.values(Priced(100.0), None, {}))  # the step's first W makes the gradients
        assert 100.0 < first["peak_bytes"] <= held["category_peaks"]["residuals"] + 100.0


def test_split_backward_memory_and_free_before_alloc():
    """F0 I0 F1 W0 I1 W1 on one device: I frees all but the weight residual, W frees
    the rest, and a free at the same instant as an allocation goes first."""
    a, res = 4.0, 0.25
    orders = [[F(0, 0), I(0, 0), F(0, 1), W(0, 0), I(0, 1), W(0, 1)]]
    sched = validate(finish_sync("split", StageGraph.chain(1), Placement.single([0]), orders, 2))
    r = run(sched, UnitCost(1, activation=a, residual=res))
    # peak right after F1 starts: microbatch 0's residual plus microbatch 1's activations
    assert r.per_device[0].peak_activation_bytes == pytest.approx(a + res * a)
    assert r.per_device[0].peak_live_microbatches == 1
    # all F first: both microbatches whole
    orders = [[F(0, 0), F(0, 1), I(0, 0), I(0, 1), W(0, 0), W(0, 1)]]
    sched = validate(finish_sync("split2", StageGraph.chain(1), Placement.single([0]), orders, 2))
    r = run(sched, UnitCost(1, activation=a, residual=res))
    assert r.per_device[0].peak_activation_bytes == pytest.approx(2 * a)
    assert r.per_device[0].peak_live_microbatches == 2


def test_free_at_the_same_instant_as_an_allocation_goes_first():
    # with B = 0 the backward of microbatch 0 ends exactly when F of microbatch 1 starts;
    # counting the allocation first would report 2 microbatches' activations
    orders = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)]]
    sched = validate(finish_sync("zero", StageGraph.chain(1), Placement.single([0]), orders, 2))
    r = run(sched, UnitCost(1, forward=1.0, backward=0.0, weight=0.0, activation=2.0))
    assert r.per_device[0].peak_activation_bytes == 2.0


# --------------------------------------------------------------- invariants
def _check_invariants(sched, result, cost, topology):
    """Every action waits for what it depends on and for its device predecessor; compute
    actions on one device never overlap; busy is the sum of the cost model's times."""
    times = result.times()
    res = DepResolver(sched)
    for dev, order in enumerate(sched.orders):
        prev_free = 0.0
        busy = 0.0
        for a in order:
            s, e = times[a]
            assert e >= s
            if a.kind == Kind.REDUCE:
                issued = result.issued[a]
                assert issued >= prev_free - 1e-12
                assert s >= issued - 1e-12
                prev_free = issued
            else:
                assert s >= prev_free - 1e-12, f"{a} on device {dev} starts before its predecessor ends"
                dur = cost.compute_time(a.kind, a.stage, a.segment, topology.devices[dev])
                assert e - s == pytest.approx(dur, abs=1e-12)
                busy += dur
                prev_free = e
            for dep in res.deps(a):
                ds, de = times[dep.action]
                earliest = result.issued[a] if a.kind == Kind.REDUCE else s
                assert earliest >= de - 1e-12, f"{a} starts before its dependency {dep.action} ends"
        assert result.per_device[dev].busy == pytest.approx(busy)
    assert result.makespan == pytest.approx(max(result.end))
    assert 0.0 <= result.bubble_ratio < 1.0


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 6, 1), ("1f1b", 6, 9, 1), ("1f1b", 3, 2, 1)])
def test_invariants_analytic_cost_on_a_cluster(name, p, m, v):
    spec = TransformerSpec("tiny", n_layer=12, n_head=4, n_embd=256, vocab_size=1000, seq_len=128)
    sched = build_schedule(name, p, m, virtual_stages=v)
    cost = AnalyticCost(spec, sched.num_stages)
    gpn = max(1, (p + 1) // 2)
    topo = get_topology("cluster", nodes=2, gpus_per_node=gpn)
    r = simulate(sched, cost, topo, record=False)
    _check_invariants(sched, r, cost, topo)
    # the same GPUs with free links: communication can only make the iteration longer
    ideal = get_topology("cluster", nodes=2, gpus_per_node=gpn, nvlink_bandwidth=1e30, nvlink_latency=0.0,
                         nic_bandwidth=1e30, nic_latency=0.0)
    free = simulate(sched, cost, ideal, record=False)
    assert r.makespan > free.makespan
    assert r.p2p_bytes == free.p2p_bytes > 0


# Schedules of their own modules, through the registry
OTHER_SCHEDULES = [("interleaved_1f1b", 4, 8, 2), ("zb_h1", 4, 8, 1), ("chimera", 4, 8, 1)]


@pytest.mark.parametrize("name, p, m, v", OTHER_SCHEDULES)
def test_invariants_other_schedules(name, p, m, v):
    sched = build_schedule(name, p, m, virtual_stages=v)
    cost = UnitCost(sched.num_stages, step=0.5, params=4.0, message=1.0, residual=0.5, comm=None)
    topo = get_topology("local_cpu", num_devices=sched.num_devices, bandwidth=8.0, latency=0.01)
    _check_invariants(sched, simulate(sched, cost, topo, record=False), cost, topo)


# Every kind of dependency: segments, split backwards, overlapped pairs, REDUCE and STEP of
# replicas, GATHERs of fully sharded stages, asynchronous updates, a branched graph
DEPENDENCY_CONFIGS = [
    "schedule=seq1f1b pipeline.segments=2", "schedule=zb_h1", "schedule=dualpipe_v pipeline.virtual_stages=2",
    "schedule=chimera", "schedule=1f1b pipeline.data_parallel=2 pipeline.shard=full pipeline.gather=microbatch",
    "schedule=pipedream", "schedule=amdp", "schedule=bapp model=cbm_tiny pipeline.stages=3",
]


@pytest.mark.parametrize("overrides", DEPENDENCY_CONFIGS)
def test_numbered_deps_are_every_actions_deps_in_order(overrides):
    from pipeflow.config import compose, prepare_simulation

    cfg = compose("simulate", ["pipeline.stages=4", "pipeline.microbatches=8", "model=gpt_small", *overrides.split()])
    sched = prepare_simulation(cfg).schedule
    actions = [a for order in sched.orders for a in order]
    index = {a: i for i, a in enumerate(actions)}
    res = DepResolver(sched)
    want = [(c, index[d.action], d.carries_tensor) for c, a in enumerate(actions) for d in res.deps(a)]
    where, numbers, carries = res.numbered_deps(actions, index)
    assert list(zip(where.tolist(), numbers.tolist(), carries.tolist())) == want
    # a dependency the index lacks is numbered -1
    del index[actions[0]]
    where, numbers, _ = res.numbered_deps(actions, index)
    assert [c for c, d in zip(where.tolist(), numbers.tolist()) if d < 0] == [c for c, d, _ in want if d == 0]


# ----------------------------------------------------- determinism and API
def test_deterministic_and_record_does_not_change_metrics():
    sched = build_schedule("1f1b", 6, 12)
    cost = UnitCost(6, message=3.0, step=0.1, comm=None)
    topo = get_topology("pcie_8")  # shared uplinks: contention with ties
    a = simulate(sched, cost, topo, record=True)
    b = simulate(sched, cost, topo, record=True)
    c = simulate(compile_schedule(sched), cost, topo, record=False)
    assert a.start == b.start and a.end == b.end == c.end
    assert a.timeline.events == b.timeline.events
    assert a.summary() == b.summary() == c.summary()
    assert c.timeline is None


def test_summary_is_json():
    r = run(build_schedule("1f1b", 3, 4), record=True)
    s = json.loads(json.dumps(r.summary()))
    assert s["makespan"] == r.makespan and len(s["per_device"]) == 3
    assert s["cost"]["name"] == "unit"


def test_time_of_accepts_notation():
    r = run(build_schedule("gpipe", 2, 2))
    assert r.time_of("1B0") == r.times()[B(1, 0)]
    with pytest.raises(KeyError, match="not an action"):
        r.time_of("5F0")


# ---------------------------------------------------------------- errors
def test_topology_too_small():
    with pytest.raises(SimulationError, match="needs 4 devices.*has 2"):
        run(build_schedule("1f1b", 4, 4), topology=free_links(2))


def test_deadlock_names_stuck_devices():
    # device 1 wants the backward before the forward it depends on
    orders = [[F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)]]
    sched = Schedule("bad", StageGraph.chain(2), Placement.single([0, 1]), orders, 1)
    with pytest.raises(SimulationError, match=r"cannot finish: device 0 at 0B0, device 1 at 1B0"):
        run(sched)


def test_missing_dependency_is_named():
    orders = [[F(0, 0), B(0, 0)], [F(1, 0)]]  # 1B0 missing, so 0B0 waits for nothing that exists
    sched = Schedule("partial", StageGraph.chain(2), Placement.single([0, 1]), orders, 1)
    with pytest.raises(SimulationError, match=r"0B0 on device 0 depends on 1B0, which is not in the schedule"):
        run(sched)


def test_negative_cost_is_rejected():
    class Broken(UnitCost):
        def compute_time(self, kind, stage, segment, device):
            return -1.0

    with pytest.raises(SimulationError, match="durations must be finite and >= 0"):
        run(build_schedule("gpipe", 2, 1), Broken(2))


def test_simulator_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; import pipeflow.sim, pipeflow.sim.engine, pipeflow.formats.timeline, pipeflow.sim.gantt; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# (schedule, its sizes): each schedule with a period rule, the replicated and sharded walks
# among them, m well past the two short walks
PERIODIC_CASES = [
    ("1f1b", ["pipeline.stages=4"]), ("zb_h1", ["pipeline.stages=4", "precision=bf16"]),
    ("gpipe", ["pipeline.stages=3"]), ("interleaved_1f1b", ["pipeline.stages=4", "pipeline.virtual_stages=2"]),
    ("chimera", ["pipeline.stages=4", "pipeline.data_parallel=2", "pipeline.shard=optimizer"]),
    ("zb_v", ["pipeline.stages=4", "pipeline.virtual_stages=2"]), ("zb_h2", ["pipeline.stages=4"]),
    ("seq1f1b", ["pipeline.stages=3", "pipeline.segments=3", "model=llama_tiny"]),
    ("1f1b", ["pipeline.stages=4", "pipeline.data_parallel=2", "pipeline.shard=full", "model.recompute=selective"]),
    ("1f1b", ["pipeline.stages=2", "pipeline.tensor_parallel=2"]),
]


@pytest.mark.parametrize("name, sizes", PERIODIC_CASES, ids=[" ".join([n, *s]) for n, s in PERIODIC_CASES])
def test_a_long_walk_from_two_short_ones_is_the_whole_walk(name, sizes):
    """Past its fill a schedule's walk repeats blocks, so two short walks a period apart
    twice give every device's memory at m: the same peak, split, action and category
    peaks as the whole walk (pipeflow.sim.periodic_memory), to the bit."""
    from pipeflow.config import compose, prepare_simulation
    from pipeflow.sim.device_memory import device_memory

    inputs = prepare_simulation(compose("simulate", [f"schedule={name}", "model=gpt_small", "topology=local_cpu",
                                                     *sizes, "pipeline.microbatches=48"]))
    assert inputs.periods is not None and inputs.periods[1] >= 3
    result = simulate(inputs.schedule, inputs.cost, inputs.topology, record=False)
    whole = device_memory(inputs.schedule, inputs.cost, result.per_device)
    assert device_memory(inputs.schedule, inputs.cost, result.per_device, periods=inputs.periods) == whole


def test_a_period_rule_that_does_not_hold_costs_time_not_bytes(monkeypatch):
    """A rule whose short walks are not a period apart (here 1F1B's fill set before its
    warm-up is full) is caught device by device: those devices are walked whole."""
    from pipeflow.config import compose, prepare_simulation
    from pipeflow.schedules import periods
    from pipeflow.sim.device_memory import device_memory

    cfg = compose("simulate", ["schedule=1f1b", "model=gpt_small", "topology=local_cpu", "pipeline.stages=4",
                               "pipeline.microbatches=24"])
    whole = prepare_simulation(cfg)
    monkeypatch.setitem(periods.PERIODS, "1f1b", lambda p, v, s, m: (1, 1))
    inputs = prepare_simulation(cfg)
    result = simulate(inputs.schedule, inputs.cost, inputs.topology, record=False)
    assert inputs.periods is not None and whole.periods[1] != inputs.periods[1]
    assert device_memory(inputs.schedule, inputs.cost, result.per_device, periods=inputs.periods) == \
        device_memory(inputs.schedule, inputs.cost, result.per_device)
