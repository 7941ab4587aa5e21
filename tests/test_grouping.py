"""Chain schedules over a branched stage graph (contiguous groups of a topological order)."""

import pytest

from pipeflow.planning.unit_cost import UnitCost
from pipeflow.schedules import Kind, validate
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.grouping import contiguous_groups, place_graph
from pipeflow.schedules.ir import StageGraph
from pipeflow.schedules.registry import build_schedule
from pipeflow.sim.engine import simulate
from pipeflow.topology.presets import get_topology

# two branches (vision 0-2, text 3-5) with interaction edges and a fused head (6)
CBM_LIKE = StageGraph(
    7,
    ((0, 1), (1, 2), (3, 4), (4, 5), (0, 4), (3, 1), (1, 5), (4, 2), (2, 6), (5, 6)),
    branch=("vision",) * 3 + ("text",) * 3 + ("head",),
)


@pytest.mark.parametrize(
    "name,p",
    [(n, p) for n in ("gpipe", "1f1b", "zb_h1", "chimera") for p in (2, 3, 4, 6, 7) if n != "chimera" or p % 2 == 0],
)
def test_grouped_schedules_validate(name, p):
    for m in (2, 4, 2 * p):
        s = build_schedule(name, p, m, graph=CBM_LIKE)
        validate(s)
        assert s.graph is CBM_LIKE and s.num_devices == p
        # every stage of a group lives on the device of its chain position, in every pipe
        for pipe, row in enumerate(s.placement.table):
            for c, group in enumerate(s.meta["groups"]):
                assert {row[st] for st in group} == {s.placement.table[pipe][group[0]]}


def test_group_members_forward_in_order_backward_reversed():
    s = build_schedule("1f1b", 2, 2, graph=CBM_LIKE)
    groups = s.meta["groups"]
    # the topological order interleaves the branches: 0 and 3 first, the head last
    assert groups == [[0, 3, 1, 4], [2, 5, 6]]
    d0 = s.orders[0]
    fwd = [a.stage for a in d0 if a.kind == Kind.F and a.microbatch == 0]
    bwd = [a.stage for a in d0 if a.kind == Kind.B and a.microbatch == 0]
    assert fwd == [0, 3, 1, 4] and bwd == [4, 1, 3, 0]


def test_bad_groupings_are_refused():
    chain = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="topological"):
        place_graph(chain, CBM_LIKE, [[0, 1, 2, 4], [3, 5, 6]])  # 3 feeds 1 but comes after it
    with pytest.raises(ValueError, match="split stages"):
        place_graph(chain, CBM_LIKE, [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="pipeline.stages=9"):
        contiguous_groups(CBM_LIKE, 9)
    with pytest.raises(ScheduleConfigError, match="branched model"):
        build_schedule("interleaved_1f1b", 2, 2, virtual_stages=2, graph=CBM_LIKE)


def test_simulator_runs_branched_graph_and_chain_grouping_is_exact():
    # one stage per group on a chain reproduces the plain chain schedule's timing
    chain = StageGraph.chain(4)
    topo = get_topology("local_cpu", 4)
    plain = simulate(build_schedule("1f1b", 4, 8), UnitCost(4, comm=0.0), topo, record=False)
    grouped = simulate(place_graph(build_schedule("1f1b", 4, 8), chain), UnitCost(4, comm=0.0), topo, record=False)
    assert grouped.makespan == plain.makespan
    # the branched model: 7 unit stages on 2 devices (4 + 3); device 0 holds 4 stages' work
    r = simulate(build_schedule("1f1b", 2, 4, graph=CBM_LIKE), UnitCost(7, forward=1, backward=2, comm=0.0),
                 get_topology("local_cpu", 2), record=False)
    assert r.per_device[0].busy == 4 * 4 * 3 and r.per_device[1].busy == 3 * 4 * 3  # stages x mb x (F+B)
    assert r.makespan >= r.per_device[0].busy
