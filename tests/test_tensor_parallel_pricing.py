"""Tensor parallelism in the simulator and the analytic cost (pipeline.tensor_parallel,
pipeline.sequence_parallel): the collectives' time against the ring's closed form on the
topology's own parameters, compute and model state divided by T (the replicated norms
and biases whole), activations by the per-tensor count, the topology's tensor groups, and
every refusal. No rank is started."""

from __future__ import annotations

import pytest

from pipeflow.config import ConfigError, compose, prepare_simulation
from pipeflow.config.tensor_degree import check_tensor_parallel
from pipeflow.planning.cost import AnalyticCost, layer_cost
from pipeflow.planning.tensor_cost import shard_spec
from pipeflow.planning.saved_tensors import norm_saved_bytes
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.sim import simulate
from pipeflow.topology import get_topology
from pipeflow.topology.presets import preset_params
from pipeflow.topology.tensor import TensorTopology

GPT_7B = ["model=gpt_7b", "topology=dgx_a100_8", "pipeline.microbatches=4", "draw=false"]


def _inputs(T: int, sp: bool = False, *more: str):
    stages = 8 // T  # one DGX: T ranks per device, 8 // T devices
    return prepare_simulation(compose("simulate", [*GPT_7B, f"pipeline.stages={max(stages, 1)}",
                                                   f"pipeline.tensor_parallel={T}",
                                                   f"pipeline.sequence_parallel={str(sp).lower()}", *more]))


# ------------------------------------------------------------- collectives, closed form


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("T", [2, 4, 8])
def test_one_layers_collectives_are_the_rings_closed_form(T, sp):
    inputs = _inputs(T, sp)
    cost, topo = inputs.cost, inputs.topology
    params = preset_params("dgx_a100_8")
    bw, lat = params["nvlink_bandwidth"], params["nvlink_latency"]  # NVSwitch: a hop is one GPU's out and in port
    E = 4096 * 1 * 4096  # s x b x H elements of one microbatch
    c, r = 2, 4  # the row-parallel products' bf16 outputs; the stream's fp32 gradients and tokens

    def allreduce(nbytes):
        return 2 * (T - 1) / T * nbytes / bw + 2 * (T - 1) * lat

    def half(nbytes):  # all-gather or reduce-scatter: half the ring
        return (T - 1) / T * nbytes / bw + (T - 1) * lat

    dev = topo.devices[0]
    forward, backward = cost.layer_collective_time("F", 0, dev), cost.layer_collective_time("I", 0, dev)
    if sp:  # each all-reduce an all-gather at a sub-layer's entry and a reduce-scatter at its exit
        assert forward == 2 * half(E * r) + 2 * half(E * c)
        assert backward == 2 * half(E * r) + 2 * half(E * c)
    else:
        assert forward == 2 * allreduce(E * c)
        assert backward == 2 * allreduce(E * r)
    assert cost.layer_collective_time("B", 0, dev) == backward
    assert cost.layer_collective_time("W", 0, dev) == 0.0  # weight gradients need no collective
    # the action waits for its layers' collectives (and the embedding's, the head's)
    if cost.num_stages > 2:
        mid = 1
        n = cost.layers_per_stage[mid]
        compute = cost.flops("F", mid, 0) / (dev.peak_flops * cost.efficiency)
        assert cost.tensor_time("F", mid, 0, dev) == n * forward
        assert cost.compute_time("F", mid, 0, dev) == max(compute, cost.weight_traffic_bytes("F", mid)
                                                          / dev.memory_bandwidth) + n * forward
    # and the simulator times each action so
    result = simulate(inputs.schedule, cost, topo)
    last = cost.num_stages - 1
    F = [e for e in result.timeline.events if e.kind == "F" and e.stage == last]
    assert F and all(e.end - e.start == pytest.approx(cost.compute_time("F", last, 0, dev), rel=1e-12) for e in F)


@pytest.mark.parametrize("T", [1, 4])
def test_the_searchs_time_tables_are_compute_time_number_for_number(T):
    """AnalyticCost.compute_table (the search's F, B, I, W tables in array operations, a
    segment length's collectives priced once) is compute_time exactly, segments of
    unequal lengths included."""
    topo = TensorTopology(get_topology("cluster", nodes=1, gpus_per_node=8), T) if T > 1 \
        else get_topology("cluster", nodes=1, gpus_per_node=8)
    cost = AnalyticCost(SPEC, 4, microbatch_size=2, tensor_parallel=T, sequence_parallel=T > 1,
                        segment_lengths=[1536, 1024, 1024, 512])
    if T > 1:
        cost.place_tensor_groups(topo)
    dev = topo.devices[0]
    for kind in "FBIW":
        table = cost.compute_table(kind, [0, 1, 3], dev)
        assert table.tolist() == [[cost.compute_time(kind, s, x, dev) for x in range(4)] for s in (0, 1, 3)]
    with pytest.raises(ValueError, match="S"):
        cost.compute_table("S", [0], dev)


def test_the_tensor_groups_are_consecutive_devices_of_a_node():
    physical = get_topology("cluster", nodes=2, gpus_per_node=8)
    topo = TensorTopology(physical, 4)
    assert topo.num_devices == 4 and topo.group(1) == (4, 5, 6, 7) and topo.group(2) == (8, 9, 10, 11)
    assert [d.node for d in topo.devices] == [0, 0, 1, 1]
    # group 1 to group 2 crosses the nodes: tensor rank 0's route, each rank on its own NIC
    assert topo.route(1, 2).bandwidth == physical.route(4, 8).bandwidth
    assert topo.transfer_time(0, 1, 1e9) == physical.transfer_time(0, 4, 1e9)
    # one NIC per node: the four matching ranks' messages share it, a quarter each
    shared = get_topology("cluster", nodes=2, gpus_per_node=8, nics_per_node=1)
    assert TensorTopology(shared, 4).route(1, 2).bandwidth == shared.route(4, 8).bandwidth / 4
    with pytest.raises(ValueError, match=r"pipeline\.tensor_parallel=16: .*\(at most 8\)"):
        TensorTopology(get_topology("cluster", nodes=2, gpus_per_node=8), 16)
    with pytest.raises(ValueError, match=r"pipeline\.tensor_parallel=4: .* node 0 has 6 devices"):
        TensorTopology(get_topology("cluster", nodes=2, gpus_per_node=6), 4)


# ----------------------------------------------------------- compute, state, activations

SPEC = TransformerSpec("gpt_7b", n_layer=32, n_head=32, n_embd=4096, vocab_size=50304, seq_len=4096, n_inner=16384,
                       n_positions=4096)


@pytest.mark.parametrize("T", [2, 4, 8])
def test_compute_divides_by_T(T):
    one, split = AnalyticCost(SPEC, 4), AnalyticCost(SPEC, 4, tensor_parallel=T)
    for stage in range(4):  # the vocabulary-parallel head's FLOPs too (T divides 50304)
        for kind in "FBIW":
            assert split.flops(kind, stage, 0) == pytest.approx(one.flops(kind, stage, 0) / T, rel=1e-12)


@pytest.mark.parametrize("T", [2, 4, 8])
def test_model_state_divides_by_T_but_the_replicated_parameters(T):
    H = SPEC.n_embd
    one, split = AnalyticCost(SPEC, 4), AnalyticCost(SPEC, 4, tensor_parallel=T)
    for stage in range(4):
        n = split.layers_per_stage[stage]
        # per block two LayerNorms (2H each) and the row-parallel projections' biases (H each)
        replicated = n * 6 * H
        if stage == 0:
            replicated += SPEC.positions * H  # the learned position table
        if stage == 3:
            replicated += 2 * H  # the final LayerNorm
        want = (one.stage_params(stage) - replicated) // T + replicated
        assert (one.stage_params(stage) - replicated) % T == 0
        assert split.stage_params(stage) == want
        state = split.state_bytes(stage)
        assert state["parameters"] == 4.0 * want and state["gradients"] == 4.0 * want
        assert state["optimizer_state"] == 8.0 * want
        assert state["casts"] == one.state_bytes(stage)["casts"] / T  # the matrices alone are cast


@pytest.mark.parametrize("T", [2, 4, 8])
def test_activations_per_tensor(T):
    """Without sequence parallelism what is H wide per token stays whole (two norms, the
    column-parallel products' inputs), the heads and the MLP's width divide: this
    codebase's Korthikanti s·b·h·(10 + 24/t); with it the norms (and the stream) run
    on s/T tokens, the gathered inputs of the products stay whole."""
    s, b, c = SPEC.seq_len, 2, 2
    whole = layer_cost(SPEC, s, s, b, c).saved
    part = layer_cost(shard_spec(SPEC, T), s, s, b, c).saved
    replicated = b * s * (2 * norm_saved_bytes(SPEC) + 2 * SPEC.n_embd * c)
    assert part == replicated + (whole - replicated) / T
    sp = AnalyticCost(SPEC, 4, microbatch_size=b, tensor_parallel=T, sequence_parallel=True)
    tp = AnalyticCost(SPEC, 4, microbatch_size=b, tensor_parallel=T)
    n = tp.layers_per_stage[1]
    assert tp.activation_bytes(1, 0) - sp.activation_bytes(1, 0) == n * b * s * 2 * norm_saved_bytes(SPEC) * (T - 1) / T
    assert sp.message_bytes(1, 2, 0) == tp.message_bytes(1, 2, 0) / T == b * s * SPEC.n_embd * 2 / T
    assert sp.output_bytes(1, 0) == tp.output_bytes(1, 0) / T


def test_T_1_is_todays_cost():
    base, same = AnalyticCost(SPEC, 4), AnalyticCost(SPEC, 4, tensor_parallel=1)
    assert same.spec is SPEC and same.describe() == base.describe()
    assert [same.activation_bytes(s, 0) for s in range(4)] == [base.activation_bytes(s, 0) for s in range(4)]


# ------------------------------------------------------------------------------ refusals


def _check(spec, T=2, sp=False, schedule=None, lengths=None):
    check_tensor_parallel(T, sp, schedule, spec, lengths)  # (spec None: a concurrent-branch model)


@pytest.mark.parametrize("spec,T,sp,lengths,message", [
    (TransformerSpec("m", 2, 6, 96, 100, 64), 4, False, None, r"6 attention heads \(model\.n_head\)"),
    (TransformerSpec("m", 2, 8, 128, 100, 64, n_kv_head=2), 8, False, None, None),  # T a multiple of kv: fine
    (TransformerSpec("m", 2, 12, 96, 100, 64, n_kv_head=6), 4, False, None, r"6 key/value heads"),
    (TransformerSpec("m", 2, 4, 128, 100, 64, n_inner=510), 4, False, None, r"MLP width 510"),
    (TransformerSpec("m", 2, 4, 128, 100, 66), 4, True, None, r"model\.seq_len=66 tokens"),
    (TransformerSpec("m", 2, 4, 128, 100, 64), 4, True, [30, 34], r"segment 0 has 30 tokens"),
])
def test_shapes_that_do_not_split_are_refused(spec, T, sp, lengths, message):
    if message is None:
        _check(spec, T, sp, lengths=lengths)
        return
    with pytest.raises(ConfigError, match=r"^pipeline\.(tensor|sequence)_parallel"):
        _check(spec, T, sp, lengths=lengths)
    with pytest.raises(ConfigError, match=message):
        _check(spec, T, sp, lengths=lengths)


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream_2bw", "amdp"])
def test_asynchronous_schedules_are_refused(schedule):
    with pytest.raises(ConfigError, match=rf"^pipeline\.tensor_parallel=2: schedule '{schedule}' updates weights "
                                          r"asynchronously"):
        prepare_simulation(compose("simulate", [f"schedule={schedule}", "pipeline.tensor_parallel=2"]))


def test_a_branched_model_is_refused():
    with pytest.raises(ConfigError, match=r"^pipeline\.tensor_parallel=2: a concurrent-branch model"):
        prepare_simulation(compose("simulate", ["model=cbm_tiny", "pipeline.tensor_parallel=2"]))
    with pytest.raises(ConfigError, match=r"concurrent-branch"):
        _check(None)


def test_groups_that_leave_a_node_or_split_it_unevenly_are_refused():
    with pytest.raises(ConfigError, match=r"^pipeline\.tensor_parallel=16: .*\(at most 8\)"):
        prepare_simulation(compose("simulate", [*GPT_7B, "topology=cluster", "topology.nodes=4",
                                                "pipeline.stages=2", "pipeline.tensor_parallel=16"]))
    with pytest.raises(ConfigError, match=r"^topology 'dgx_a100_8' has 8 devices but the schedule needs 16 "
                                          r".*pipeline\.tensor_parallel=4: 4 x 4"):
        prepare_simulation(compose("simulate", [*GPT_7B, "pipeline.stages=4", "pipeline.tensor_parallel=4"]))


def test_a_cost_without_a_shape_is_refused():
    with pytest.raises(ConfigError, match=r"^pipeline\.tensor_parallel=2: cost model 'unit' has no shape"):
        prepare_simulation(compose("simulate", ["cost=unit", "pipeline.tensor_parallel=2"]))


def test_every_synchronous_chain_schedule_simulates():
    from pipeflow.schedules.registry import get_spec, schedule_names

    extra = {"interleaved_1f1b": ["pipeline.virtual_stages=2"], "interleaved_zb": ["pipeline.virtual_stages=2"],
             "looped_bfs": ["pipeline.virtual_stages=2"], "zb_v": ["pipeline.virtual_stages=2"],
             "dualpipe_v": ["pipeline.virtual_stages=2"], "seq1f1b": ["pipeline.segments=2"],
             "seq1f1b_interleaved": ["pipeline.segments=2", "pipeline.virtual_stages=2"]}
    ran = []
    for name in schedule_names():
        spec = get_spec(name)
        if name == "file" or spec.asynchronous or spec.branch_aware:
            continue
        inputs = prepare_simulation(compose("simulate", [f"schedule={name}", "model=gpt_small", "topology=dgx_a100_8",
                                                         "pipeline.stages=4", "pipeline.tensor_parallel=2",
                                                         "pipeline.sequence_parallel=true", *extra.get(name, [])]))
        assert inputs.topology.num_devices == inputs.schedule.num_devices
        assert simulate(inputs.schedule, inputs.cost, inputs.topology).makespan > 0
        ran.append(name)
    assert {"gpipe", "1f1b", "zb_h1", "chimera", "seq1f1b", "dualpipe_v"} <= set(ran)


def test_a_split_vocabulary_prices_the_embeddings_and_the_losss_collectives():
    """V = 3000 on T = 4 ranks: T divides the vocabulary (750 rows a rank), so the first
    stage's forward waits for the embedding's all-reduce (fp32, s x b x H) and the last
    stage's for the loss's three (fp32, one value per token) and its input gradient's,
    whether or not T also divides the shard's 750 (it does not)."""
    inputs = _inputs(4, False, "model.vocab_size=3000")
    cost, topo = inputs.cost, inputs.topology
    dev = topo.devices[0]
    tokens, H = 4096, 4096
    ar = lambda nbytes: topo.collective_time("all-reduce", dev, nbytes)  # noqa: E731
    n0, n1 = cost.layers_per_stage
    assert cost.spec.vocab_size == 750 and 750 % 4
    assert cost.tensor_time("F", 0, 0, dev) == pytest.approx(
        n0 * cost.layer_collective_time("F", 0, dev) + ar(tokens * H * 4), rel=1e-12)
    assert cost.tensor_time("F", 1, 0, dev) == pytest.approx(
        n1 * cost.layer_collective_time("F", 0, dev) + 3 * ar(tokens * 4), rel=1e-12)
    assert cost.tensor_time("B", 1, 0, dev) == pytest.approx(
        n1 * cost.layer_collective_time("B", 0, dev) + ar(tokens * H * 4), rel=1e-12)
