"""Issue 17's schedules against torch 2.13's own and against their closed forms.

torch's orders come from ``_schedule_visualizer.get_schedule_ops`` (its schedule classes,
run on a mock stage); "the same unit-time bubble" is checked by simulating torch's
orders, read through schedule=file, beside pipeflow's generator."""

from __future__ import annotations

import pytest

from pipeflow.planning.unit_cost import UnitCost
from pipeflow.schedules.from_file import schedule_from_orders
from pipeflow.schedules.registry import build_schedule
from pipeflow.sim.engine import simulate
from pipeflow.topology.presets import get_topology

SIZES = [(4, 8), (4, 16), (8, 16)]  # the (p, m); v = 2 where it applies
TORCH = {"zb_v": "ZBVZeroBubble", "looped_bfs": "LoopedBFS", "interleaved_zb": "InterleavedZeroBubble",
         "dualpipe_v": "DualPipeV"}
CHUNKS = {"zb_v": 2, "looped_bfs": 2, "interleaved_zb": 2, "dualpipe_v": 2}  # pipeline.virtual_stages each takes


def torch_cells(name: str, p: int, m: int) -> list[list[str]]:
    """torch's cells, an overlapped pair written as pipeflow prints it: (0F3;3B1)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return [[str(a).replace("OVERLAP_F_B", "") for a in row if a is not None]
            for row in get_schedule_ops(TORCH[name], p, m, 2)]


def cells(schedule) -> list[list[str]]:
    return [[c for c in schedule.cells(d) if "@" not in c] for d in range(schedule.num_devices)]


def unit(schedule, overlap: float = 0.0):
    cost = UnitCost(schedule.num_stages)
    cost.overlap = overlap
    return simulate(schedule, cost, get_topology("local_cpu", schedule.num_devices))


def _torch_runs(name: str, p: int, m: int) -> bool:
    # torch's interleaved zero bubble refuses m not a multiple of its m // p rounds, and
    # DualPipeV fewer than two microbatches per stage of the V
    if name == "dualpipe_v":
        return m >= 2 * p
    return name != "interleaved_zb" or m % max(1, m // p) == 0


@pytest.mark.parametrize("name,p,m", [(n, p, m) for n in TORCH for p, m in [*SIZES, (2, 1), (2, 4), (4, 3), (4, 5),
                                                                            (3, 7), (4, 10)] if _torch_runs(n, p, m)])
def test_orders_are_torchs_action_for_action(name, p, m):
    assert cells(build_schedule(name, p, m, CHUNKS[name])) == torch_cells(name, p, m)


@pytest.mark.parametrize("name", list(TORCH))
@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("overlap", [0.0, 1.0])
def test_unit_time_bubble_equals_torchs_schedule_on_its_own_orders(name, p, m, overlap):
    from pipeflow.schedules.from_file import read_schedule_text

    orders, pairs = read_schedule_text("\n".join(",".join(r) for r in torch_cells(name, p, m)))
    theirs = unit(schedule_from_orders(orders, overlapped=tuple(pairs)), overlap)
    ours = unit(build_schedule(name, p, m, CHUNKS[name]), overlap)
    assert ours.makespan == theirs.makespan and ours.bubble_ratio == pytest.approx(theirs.bubble_ratio)


@pytest.mark.parametrize("p,m", [*SIZES, (2, 4), (4, 7), (3, 5)])
def test_zb_v_closed_forms(p, m):
    """F = I = W = 1 per stage (B = 2): with m >= 2p-1 a device works 6m and waits only
    p-1 (the first forward's trip down the V), and holds at most 2p chunk activations:
    p microbatches of its layers, 1F1B's peak."""
    sched = build_schedule("zb_v", p, m, 2)
    assert sched.placement.table[0] == tuple([*range(p), *reversed(range(p))])
    res = unit(sched)
    assert res.makespan == 6 * m + p - 1
    assert res.bubble_ratio == pytest.approx((p - 1) / (6 * m + p - 1))
    one_f_one_b = unit(build_schedule("1f1b", p, m))
    for d in range(p):
        # chunks are half a device's layers: 2p chunk activations = 1F1B's p stage activations
        assert res.per_device[d].peak_activation_bytes == 2 * p == 2 * one_f_one_b.per_device[0].peak_activation_bytes


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 2), (8, 16, 2), (2, 4, 3), (4, 4, 2)])
def test_looped_bfs_closed_forms(p, m, v):
    """With m >= p: (v*m + p - 1) slots of F + B, the interleaved bubble (p-1)/(v*m+p-1),
    and every microbatch of every chunk alive at once (v*m chunk activations)."""
    res = unit(build_schedule("looped_bfs", p, m, v))
    assert res.makespan == 3 * (v * m + p - 1)
    assert res.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))
    assert res.per_device[0].peak_activation_bytes == v * m


@pytest.mark.parametrize("p,m", [(1, 3), (2, 3), (3, 7), (5, 9), (4, 13)])
def test_interleaved_zb_runs_any_m(p, m):
    """Where torch refuses (m not a multiple of its rounds) the groups are uneven; the
    order still validates, every action once."""
    from pipeflow.schedules.validate import validate

    sched = build_schedule("interleaved_zb", p, m, 2)
    validate(sched)
    computes = [a for o in sched.orders for a in o if a.is_compute]
    assert len(computes) == len(set(computes)) == 3 * 2 * p * m


@pytest.mark.parametrize("p,m", [*SIZES, (2, 4), (4, 7), (3, 5)])
def test_zb_h2_closed_forms(p, m):
    """With m >= 2p-1 and a flush every iteration the only idle time is the parallelogram's
    edge, the first forward's trip: (p-1)F per device, against ZB-H1's (p-1)(F+I-W) (the
    paper's (p-1)(F+I-2W) counts iterations tiled without the optimizer's synchronisation).
    Stage 0 holds up to 2p-1 microbatches before its first I, against 1F1B's p."""
    for f, i, w in [(1, 1, 1), (1, 1, 0.5), (2, 1, 0.5)]:
        cost = UnitCost(p, forward=f, backward=i + w, weight=w)
        topo = get_topology("local_cpu", p)
        h2 = simulate(build_schedule("zb_h2", p, m), cost, topo)
        h1 = simulate(build_schedule("zb_h1", p, m), cost, topo)
        assert h2.makespan == pytest.approx((p - 1) * f + m * (f + i + w))
        assert h1.makespan == pytest.approx((p - 1) * max(f + i - w, f) + m * (f + i + w))
        assert h2.makespan <= h1.makespan
    res = unit(build_schedule("zb_h2", p, m))
    assert [d.peak_activation_bytes for d in res.per_device] == [2 * (p - r) - 1 for r in range(p)]


@pytest.mark.parametrize("p,m", [*SIZES, (2, 4), (4, 12), (3, 6)])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_dualpipe_v_closed_forms(p, m, overlap):
    """The DualPipe paper's bubble for p devices (2p stages): (p-1)(F&B + B - 3W) on the
    devices that wait longest, F&B the overlapped pair's time, max(F, B) + (1 - overlap) x
    min(F, B) (F = 1, B = 2, W = 1 here); 2p+1 chunk activations per device (the paper's
    PP+1 with PP = 2p stages)."""
    res = unit(build_schedule("dualpipe_v", p, m, 2), overlap)
    fb = 2 + (1 - overlap) * 1
    assert max(res.makespan - d.busy for d in res.per_device) == pytest.approx((p - 1) * (fb + 2 - 3))
    assert all(d.peak_activation_bytes == 2 * p + 1 for d in res.per_device)


def test_an_overlapped_pair_is_checked_and_priced():
    """The validator refuses a pair that is not a forward followed at once by a full
    backward on one device; the simulator starts a pair when both halves are ready and
    takes max + (1 - overlap) x min of them."""
    import dataclasses

    from pipeflow.schedules.ir import Kind
    from pipeflow.schedules.validate import ScheduleError, validate

    sched = build_schedule("dualpipe_v", 2, 4, 2)
    assert sched.overlapped and all(f.kind == Kind.F and b.kind == Kind.B for f, b in sched.overlapped)
    f, b = sched.overlapped[0]
    with pytest.raises(ScheduleError, match=r"must be a forward \(F\) and a full backward \(B\)"):
        validate(dataclasses.replace(sched, overlapped=((b, f),)))
    other = next(a for a in sched.orders[0] if a.kind == Kind.B and a != b)
    with pytest.raises(ScheduleError, match=r"must be adjacent on one device"):
        validate(dataclasses.replace(sched, overlapped=((f, other),)))
    plain = dataclasses.replace(sched, overlapped=())
    # overlap 0 runs the halves one after the other, but a pair starts only when both are
    # ready, so it can wait where its forward alone could have started (25 against 26 here)
    assert unit(plain).makespan < unit(sched, 0.0).makespan
    assert unit(sched, 1.0).makespan < unit(sched, 0.5).makespan < unit(sched, 0.0).makespan
