"""pipeflow-plan with tensor parallelism (plan.tensor_parallel, plan.sequence_parallel):
the planner's closed form prices one tensor rank as the analytic cost does, the app plans
each degree the model and the nodes take and keeps the fastest fitting, a degree they do
not take is left out with its reason, and schedule=planned refuses a plan of another degree."""

from __future__ import annotations

import json

import pytest

from pipeflow.config import ConfigError, compose, prepare_simulation
from pipeflow.planning.cost import AnalyticCost
from pipeflow.planning.planner import Plan, StageModel, evaluate, plan
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.topology.presets import get_topology
from pipeflow.topology.tensor import tensor_topology

SPECS = {
    # vocabulary 3000: vocabulary-parallel at T = 2 and 4; 16 heads, 4 key/value heads (GQA)
    "gpt": TransformerSpec("gpt_small_tensor", 7, 16, 1024, 3000, 1024),
    "gqa_selective": TransformerSpec("gqa_small_tensor", 7, 16, 1024, 3000, 1024, n_kv_head=4,
                                     recompute="selective", mlp="gated", norm="rmsnorm", tied=False,
                                     position_embedding="rotary"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_stage_model_prices_a_tensor_rank_as_analytic_cost(T, sp, name):
    spec, layers = SPECS[name], [2, 1, 3, 1]
    topo = tensor_topology(get_topology("cluster", nodes=1), T)
    cost = AnalyticCost(spec, 4, microbatch_size=2, layers_per_stage=layers, tensor_parallel=T, sequence_parallel=sp)
    if T > 1:
        cost.place_tensor_groups(topo)
    model = StageModel(spec, microbatch_size=2, tensor_parallel=T, sequence_parallel=sp, topology=topo)
    for dev in (topo.devices[0], topo.devices[-1]):
        for s, n in enumerate(layers):
            first, last = s == 0, s == 3
            fb = cost.compute_time("F", s, 0, dev) + cost.compute_time("B", s, 0, dev)
            assert model.fb_time(n, last, dev, first) == pytest.approx(fb, rel=1e-12)
            assert model.step_time(n, first, last, dev) == pytest.approx(cost.compute_time("S", s, 0, dev), rel=1e-12)
            assert model.memory(n, first, last, 3) == pytest.approx(
                3 * cost.activation_bytes(s, 0) + cost.rebuilt_layer_bytes(s, 0) + cost.model_state_bytes(s), rel=1e-12)
    assert model.msg_bytes == cost.message_bytes(0, 1, 0)
    if T > 1:  # the collectives are in it: without them the closed form is faster
        bare = StageModel(spec, microbatch_size=2, tensor_parallel=1)
        assert model.tensor_waits(topo.devices[0], True, True)[0] > 0
        assert model.fb_time(2, False, topo.devices[0]) < bare.fb_time(2, False, topo.devices[0])


def test_stage_model_needs_the_grouped_topology():
    with pytest.raises(ValueError, match=r"pipeline\.tensor_parallel=2: .*groups of 2"):
        StageModel(SPECS["gpt"], tensor_parallel=2, topology=get_topology("cluster", nodes=1))
    with pytest.raises(ValueError, match=r"pipeline\.tensor_parallel=1: .*grouped in tensor groups of 2"):
        plan(SPECS["gpt"], tensor_topology(get_topology("cluster", nodes=1), 2), 4, tensor_parallel=1)


@pytest.mark.parametrize("sp", [False, True])
def test_a_tensor_plan_is_what_evaluate_says(sp):
    spec = SPECS["gpt"]
    topo = tensor_topology(get_topology("cluster", nodes=1), 2)
    best = plan(spec, topo, 8, tensor_parallel=2, sequence_parallel=sp)
    assert (best.tensor_parallel, best.sequence_parallel) == (2, sp)
    again, _ = evaluate(spec, topo, best.layers_per_stage, best.device_of_stage, 8,
                        replica_devices=best.replica_devices, tensor_parallel=2, sequence_parallel=sp)
    assert again.predicted_iteration_time == best.predicted_iteration_time
    assert Plan.from_json(best.to_json()) == best


def test_app_searches_the_tensor_degree(tmp_path):
    from pipeflow.plan import compose_plan, format_plan, run_plan

    cfg = compose_plan(["model=gpt_7b", "topology=cluster", "topology.nodes=2", "plan.tensor_parallel=[1,2,4,8]",
                        "pipeline.microbatches=32", "draw=false"])
    summary = run_plan(cfg, tmp_path)
    best: Plan = summary["plan"]
    degrees = summary["degrees"]
    assert best.tensor_parallel in (1, 2, 4, 8) and best.sequence_parallel == (best.tensor_parallel > 1)
    assert list(degrees) == ["1", "2", "4", "8"]
    fastest = min((d["predicted_iteration_time"], int(t)) for t, d in degrees.items() if d.get("fits"))
    assert fastest == (best.predicted_iteration_time, best.tensor_parallel)
    # the plan's time is what the simulator says of it, on the topology seen as its groups
    topo = tensor_topology(get_topology("cluster", nodes=2), best.tensor_parallel)
    spec = TransformerSpec.from_config(cfg.model)
    again, _ = evaluate(spec, topo, best.layers_per_stage, best.device_of_stage, 32,
                        replica_devices=best.replica_devices, tensor_parallel=best.tensor_parallel,
                        sequence_parallel=best.sequence_parallel)
    assert again.predicted_iteration_time == best.predicted_iteration_time
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert (doc["tensor_parallel"], doc["sequence_parallel"]) == (best.tensor_parallel, best.sequence_parallel)
    assert Plan.from_dict(doc) == best and set(doc["tensor_degrees"]) == {"1", "2", "4", "8"}
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["tensor_parallel"] == best.tensor_parallel
    assert s["run_key"]["tensor_parallel"] == (f"{best.tensor_parallel}+sp" if best.tensor_parallel > 1 else 1)
    text = format_plan(summary)
    for t in ("1", "2", "4", "8"):  # the best plan of each degree, one line each
        assert sum(line.startswith(f"  T={t}: ") for line in text.splitlines()) == 1
    assert f"T={best.tensor_parallel}" in text and "<- the plan" in text


def test_app_leaves_out_a_degree_the_nodes_or_model_refuse(tmp_path):
    from pipeflow.plan import compose_plan, format_plan, run_plan

    cfg = compose_plan(["model=gpt_tiny", "model.n_head=16", "topology=cluster", "plan.tensor_parallel=[1,2,3,16]",
                        "pipeline.microbatches=4", "draw=false", "baselines=false"])
    summary = run_plan(cfg, tmp_path)
    degrees = summary["degrees"]
    assert "16 attention heads" in degrees["3"]["left_out"]
    assert "node 0 has 8 devices" in degrees["16"]["left_out"]
    assert summary["plan"].tensor_parallel in (1, 2) and set(degrees) == {"1", "2", "3", "16"}
    text = format_plan(summary)
    assert "  T=3: left out: pipeline.tensor_parallel=3" in text
    # gpt_tiny's 4 heads: 8 does not split them, and with sequence parallelism a sequence of 128 takes 1, 2, 4
    bad = compose_plan(["model=gpt_tiny", "topology=cluster", "plan.tensor_parallel=[3,8]", "draw=false"])
    with pytest.raises(ConfigError, match=r"plan\.tensor_parallel=\[3, 8\]: no degree .* allowed values: \[1, 2, 4\] "
                                          r"\(.*attention heads"):
        run_plan(bad, tmp_path)
    with pytest.raises(ConfigError, match=r"plan\.tensor_parallel=\[0\]: give a list of whole numbers >= 1"):
        run_plan(compose_plan(["plan.tensor_parallel=[0]", "draw=false"]), tmp_path)


def test_default_is_one_degree_and_the_console_as_before(tmp_path):
    from pipeflow.plan import compose_plan, format_plan, run_plan

    summary = run_plan(compose_plan(["model=gpt_tiny", "topology=pcie_8", "pipeline.microbatches=4", "draw=false"]),
                       tmp_path)
    p = summary["plan"]
    assert (p.tensor_parallel, p.sequence_parallel) == (1, False)
    text = format_plan(summary)
    assert "tensor" not in text and "T=" not in text


def test_planned_refuses_a_plan_of_another_degree(tmp_path):
    spec_cfg = compose("simulate", ["pipeline.stages=2", "pipeline.microbatches=4"])
    spec = TransformerSpec.from_config(spec_cfg.model)
    topo = tensor_topology(get_topology("cluster", nodes=1), 2)
    p = plan(spec, topo, 4, num_stages=2, replicas=1, tensor_parallel=2, sequence_parallel=True)
    path = tmp_path / "plan.json"
    path.write_text(p.to_json())
    common = ["schedule=planned", f"schedule.plan={path}", "topology=cluster", "pipeline.stages=2",
              "pipeline.microbatches=4", "draw=false"]
    with pytest.raises(ConfigError, match=r"schedule\.plan=.*made for pipeline\.tensor_parallel=2 "
                                          r"pipeline\.sequence_parallel=true .* "
                                          r"the run has pipeline\.tensor_parallel=1;"):
        prepare_simulation(compose("simulate", common))
    with pytest.raises(ConfigError, match=r"the run has pipeline\.tensor_parallel=2 pipeline\.sequence_parallel=false"):
        prepare_simulation(compose("simulate", [*common, "pipeline.tensor_parallel=2"]))
    ok = prepare_simulation(compose("simulate", [*common, "pipeline.tensor_parallel=2",
                                                 "pipeline.sequence_parallel=true"]))
    assert ok is not None
