"""Simulated bubble ratios and memory against the closed forms in ALGORITHMS.md.

Unit costs, zero communication, equal stages: the simulator must reproduce each
schedule's published formula exactly, not approximately.
"""

import pytest

from pipeflow.planning.unit_cost import UnitCost
from pipeflow.schedules.registry import build_schedule
from pipeflow.sim.engine import simulate
from pipeflow.topology.presets import get_topology

COSTS = [(1.0, 1.0), (1.0, 2.0), (2.0, 3.0), (1.0, 3.5)]  # (F, B)


def run(name, p, m, forward=1.0, backward=2.0, weight=1.0, v=1):
    s = build_schedule(name, p, m, virtual_stages=v)
    cost = UnitCost(s.num_stages, forward=forward, backward=backward, weight=weight, comm=0.0)
    return s, simulate(s, cost, get_topology("local_cpu", s.num_devices), record=False)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_gpipe_1f1b_bubble(name, p):
    for m in (1, 2, p, 2 * p + 1, 4 * p):
        for f, b in COSTS:
            _, r = run(name, p, m, f, b, weight=b / 2)
            assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert r.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble(p, v):
    for m in (p, 2 * p, 3 * p):
        for f, b in COSTS:
            _, r = run("interleaved_1f1b", p, m, f, b, weight=b / 2, v=v)
            assert r.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_zb_h1_bubble_time_per_device(p):
    # B is the full backward (I + W); bubble time per device (p-1)(F+B-2W) for m >= p
    for m in (p, p + 1, 2 * p, 4 * p):
        for f, b, w in [(1, 2, 1), (1, 1, 0.5), (1, 3, 1), (2, 3, 1), (1, 2, 0.5), (1.5, 2.5, 1.25)]:
            _, r = run("zb_h1", p, m, f, b, weight=w)
            for d in r.per_device:
                assert d.idle == pytest.approx((p - 1) * (f + b - 2 * w), abs=1e-9)
            # and against 1F1B at the same costs: the saving is exactly (p-1)*2W per device
            _, base = run("1f1b", p, m, f, b, weight=w)
            assert base.makespan - r.makespan == pytest.approx((p - 1) * 2 * w)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_chimera_bubble(p):
    _, r = run("chimera", p, p, 1.0, 1.0, weight=0.5)
    assert r.bubble_ratio == pytest.approx((p - 2) / (2 * p + p - 2), abs=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_peak_live_microbatches_stage0(p):
    for m in (1, p - 1, p, 2 * p, 4 * p):
        if m < 1:
            continue
        _, g = run("gpipe", p, m)
        _, o = run("1f1b", p, m)
        _, z = run("zb_h1", p, m)
        assert g.per_device[0].peak_live_microbatches == m
        assert o.per_device[0].peak_live_microbatches == min(p, m)
        # ZB-H1 keeps 1F1B's activation memory
        assert z.per_device[0].peak_live_microbatches == min(p, m)
        # the last stage holds one microbatch at a time under 1F1B, all of them under GPipe
        assert o.per_device[p - 1].peak_live_microbatches == 1
        assert g.per_device[p - 1].peak_live_microbatches == m


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_chimera_memory_between_half_and_full(p):
    # ALGORITHMS.md: Chimera's stage-0 device holds between p/2+1 and p microbatches
    s, r = run("chimera", p, p, 1.0, 1.0, weight=0.5)
    peaks = [d.peak_live_microbatches for d in r.per_device]
    if p == 2:
        assert peaks == [2, 2]
    else:
        assert peaks[0] == p / 2 + 1
        assert all(p / 2 + 1 <= x <= p for x in peaks)
    # the two directions make the memory profile symmetric: device i mirrors device p-1-i
    assert peaks == peaks[::-1]


def test_unit_comm_time_delays_each_hop():
    # 2-stage GPipe, one microbatch: the activation and the gradient each cross once
    for comm in (0.0, 0.25, 3.0):
        s = build_schedule("gpipe", 2, 1)
        r = simulate(s, UnitCost(2, 1.0, 2.0, 1.0, comm=comm), get_topology("local_cpu", 2), record=False)
        assert r.makespan == pytest.approx(2 * 1.0 + 2 * 2.0 + 2 * comm)
