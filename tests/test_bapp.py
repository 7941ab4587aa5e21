"""BAPP schedules and the interaction coordinator (simulation side): the bidirectional
placement, validity over sizes and policies, and a coordinator that is never slower
than the uncoordinated schedule and respects its memory limit."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeflow.config import ConfigError, compose, prepare_simulation
from pipeflow.models.cbm import cbm_stage_graph
from pipeflow.planning.branched_cost import BranchedAnalyticCost
from pipeflow.schedules.bapp import UNCOORDINATED, BappPolicy, bapp, branch_chains
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.planning.coordinator import coordinate, policies
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import validate
from pipeflow.sim.engine import simulate
from pipeflow.topology.presets import get_topology

CONF = Path(__file__).resolve().parent.parent / "conf"
LARGE = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "cbm_large.yaml"))
UNBALANCED = copy.deepcopy(LARGE)
UNBALANCED["vision"]["n_layer"] = 32
UNBALANCED["text"]["n_layer"] = 24
UNBALANCED["interaction_layers"] = [9, 17]
ONE = copy.deepcopy(LARGE)  # one interaction depth, so two stages per branch are enough
ONE["interaction_layers"] = [13]


def _setup(model, p):
    graph, specs = cbm_stage_graph(model, p, p)
    cost = BranchedAnalyticCost(model, [(s.branch, s.lo, s.hi) for s in specs], 4)
    return graph, cost, get_topology("dgx_a100_8", p)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_valid_for_every_policy(p, m):
    """Every policy's schedule passes the validator, and runs each stage's F and B once
    per microbatch and one step per stage."""
    graph, _ = cbm_stage_graph(ONE, p, p)
    for pol in policies():
        s = validate(bapp(p, m, graph, pol))
        kinds = Counter((a.kind, a.stage) for _, _, a in s.actions())
        for stage in range(graph.num_stages):
            assert (kinds[("F", stage)], kinds[("B", stage)], kinds[("S", stage)]) == (m, m, 1)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_branches_run_in_opposite_directions(p):
    graph, _ = cbm_stage_graph(ONE, p, p)
    for head in ("vision_end", "text_end"):
        s = bapp(p, 4, graph, BappPolicy(head=head))
        chains = branch_chains(graph)
        dev = s.placement.table[0]
        assert [dev[x] for x in chains["vision"]] == list(range(p))
        assert [dev[x] for x in chains["text"]] == list(reversed(range(p)))
        (h,) = [x for x in range(graph.num_stages) if graph.branch[x] == "head"]
        assert dev[h] == (p - 1 if head == "vision_end" else 0)
        for d in range(p):  # one stage of each branch per device
            labels = sorted(graph.branch[x] for x in range(graph.num_stages) if dev[x] == d and graph.branch[x] != "head")
            assert labels == ["text", "vision"]


@pytest.mark.parametrize("model,p,m", list(itertools.product([LARGE, UNBALANCED], [4, 8], [8, 16])))
def test_coordinator_never_slower_than_uncoordinated(model, p, m):
    graph, cost, topo = _setup(model, p)
    c = coordinate(p, m, graph, cost, topo)
    base = simulate(bapp(p, m, graph, UNCOORDINATED,
                         lambda k, s: cost.compute_time(k, s, 0, topo.devices[0])), cost, topo, record=False)
    assert c.makespan <= base.makespan + 1e-12
    assert c.uncoordinated_makespan == pytest.approx(base.makespan)
    assert len(c.tried) == len(policies())


def test_memory_limit_is_respected_and_reported():
    graph, cost, topo = _setup(LARGE, 4)
    free = coordinate(4, 16, graph, cost, topo)
    peaks = sorted(p for _, _, p in free.tried)
    limit = (peaks[0] + peaks[-1]) / 2
    bounded = coordinate(4, 16, graph, cost, topo, memory_limit=limit)
    assert all(ms is None for _, ms, p in bounded.tried if p > limit)
    chosen = [p for pol, ms, p in bounded.tried if pol == bounded.policy][0]
    assert chosen <= limit
    with pytest.raises(ScheduleConfigError, match=r"^schedule\.memory_limit_gb=.*GB over"):
        coordinate(4, 16, graph, cost, topo, memory_limit=peaks[0] / 2)


def test_bapp_needs_a_branched_model_with_p_stages_per_branch():
    with pytest.raises(ScheduleConfigError, match="concurrent-branch model"):
        build_schedule("bapp", 4, 8)
    graph, _ = cbm_stage_graph(LARGE, 4, 5)
    with pytest.raises(ScheduleConfigError, match="text branch has 5"):
        bapp(4, 8, graph)


def test_simulate_app_runs_the_coordinator():
    cfg = compose("simulate", ["model=cbm_large", "schedule=bapp", "pipeline.stages=4", "pipeline.microbatches=8",
                               "topology=dgx_a100_8"])
    inputs = prepare_simulation(cfg)
    meta = inputs.schedule.meta["coordinator"]
    assert meta["makespan"] <= meta["uncoordinated_makespan"] and meta["candidates"] == len(policies())
    with pytest.raises(ConfigError, match=r"^schedule\.lead=text: the coordinator chooses"):
        prepare_simulation(compose("simulate", ["model=cbm_large", "schedule=bapp", "schedule.lead=text"]))
    fixed = prepare_simulation(compose("simulate", ["model=cbm_large", "schedule=bapp", "schedule.coordinate=false",
                                                    "schedule.lead=text"]))
    assert fixed.schedule.meta["policy"]["lead"] == "text"
