"""The simulator's shared host (processor sharing): CPU ranks that share a host's cores.

A topology with ``cores`` fewer than its devices, or a ``contention`` below 1, makes
devices that compute at once progress at ``compute_rate(k)`` each. Checked against
what must hold exactly: one core runs a work-conserving schedule in the sum of its
work; a host as fast as dedicated devices changes nothing; rates follow the model.
"""

from __future__ import annotations

import pytest

from pipeflow.planning.unit_cost import UnitCost
from pipeflow.schedules.registry import build_schedule
from pipeflow.sim import simulate
from pipeflow.topology import get_topology


def test_compute_rate_model():
    t = get_topology("local_cpu", num_devices=4, cores=2, contention=0.8)
    assert t.shares_compute
    assert [t.compute_rate(k) for k in (0, 1, 2)] == [1.0, 1.0, 0.8]
    assert t.compute_rate(4) == pytest.approx(0.4)  # half a core each, at the contended speed
    assert not get_topology("local_cpu", num_devices=4, cores=4).shares_compute
    assert not get_topology("local_cpu", num_devices=4).shares_compute
    with pytest.raises(ValueError, match="topology.cores"):
        get_topology("local_cpu", num_devices=2, cores=0)
    with pytest.raises(ValueError, match="contention"):
        get_topology("local_cpu", num_devices=2, cores=2, contention=1.5)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_one_core_runs_the_sum_of_the_work(name):
    """With one core, some action is always running in these schedules (each device's
    next action is ready whenever the other's is not), so the makespan is the total work."""
    p, m = 2, 4
    sched = build_schedule(name, p, m)
    cost = UnitCost(p, forward=1.0, backward=2.0, weight=1.0)
    res = simulate(sched, cost, get_topology("local_cpu", num_devices=p, cores=1), record=False)
    assert res.makespan == pytest.approx(p * m * 3.0)
    # busy is elapsed time on a shared host: together the devices were busy longer than the makespan
    assert sum(d.busy for d in res.per_device) > res.makespan


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "chimera"])
def test_enough_cores_change_nothing(name):
    sched = build_schedule(name, 4, 8)
    cost = UnitCost(4)
    alone = simulate(sched, cost, get_topology("local_cpu", num_devices=4), record=False)
    shared = simulate(sched, cost, get_topology("local_cpu", num_devices=4, cores=4), record=False)
    assert shared.makespan == alone.makespan
    assert shared.start == alone.start and shared.end == alone.end


def test_two_busy_devices_each_at_the_contended_rate():
    """GPipe, p=2, m=2: the devices overlap in the middle of the step, so a contended host
    lies between dedicated devices and one core; at contention 0.5 two busy devices are
    exactly one core. With m=1 nothing overlaps and nothing slows down."""
    sched = build_schedule("gpipe", 2, 2)
    cost = UnitCost(2, forward=1.0, backward=2.0)
    dedicated = simulate(sched, cost, get_topology("local_cpu", num_devices=2), record=False).makespan
    half = simulate(sched, cost, get_topology("local_cpu", num_devices=2, cores=2, contention=0.5),
                    record=False).makespan
    fast = simulate(sched, cost, get_topology("local_cpu", num_devices=2, cores=2, contention=0.9),
                    record=False).makespan
    assert dedicated < fast < half == pytest.approx(2 * 2 * 3.0)
    one = simulate(build_schedule("gpipe", 2, 1), cost, get_topology("local_cpu", num_devices=2, cores=2,
                                                                     contention=0.5), record=False)
    assert one.makespan == pytest.approx(6.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_message_host_time_is_charged_to_both_ends(name):
    """p=2, m=1: F0 -> F1 -> B1 -> B0 is one chain with two messages; each message's
    host time lengthens its sender's and its receiver's action, so the step grows by
    four of them."""
    sched = build_schedule(name, 2, 1)
    cost = UnitCost(2, forward=1.0, backward=2.0)
    base = simulate(sched, cost, get_topology("local_cpu", num_devices=2), record=False)
    host = simulate(sched, cost, get_topology("local_cpu", num_devices=2, message_host=0.25), record=False)
    assert host.makespan == pytest.approx(base.makespan + 4 * 0.25)
    with pytest.raises(ValueError, match="message_host"):
        get_topology("local_cpu", num_devices=2, message_host=-1.0)


class _Synced(UnitCost):
    """Unit costs plus the runtime's per-step synchronisation."""

    step_sync = 0.5


@pytest.mark.parametrize("name,virtual,synced", [("1f1b", 1, True), ("interleaved_1f1b", 2, True),
                                                 ("chimera", 1, True), ("pipedream", 1, False)])
def test_step_sync_is_charged_once_per_device_of_a_synchronous_step(name, virtual, synced):
    """A synchronous step synchronises each rank once before its first STEP, however
    many stages the rank holds (interleaving and Chimera hold two); an asynchronous
    schedule's STEPs update stage by stage and do not synchronise."""
    sched = build_schedule(name, 2, 4, virtual_stages=virtual)
    res = simulate(sched, _Synced(sched.num_stages, forward=1.0, backward=2.0, step=0.25),
                   get_topology("local_cpu", num_devices=2), record=True)
    per_device: dict[int, list[float]] = {}
    for a, s, e in zip(res.actions, res.start, res.end):
        if a.kind == "S":
            per_device.setdefault(sched.placement.device(a.pipe, a.stage), []).append(e - s)
    assert set(per_device) == {0, 1}
    for steps in per_device.values():
        extra = sum(steps) - 0.25 * len(steps)
        assert extra == pytest.approx(0.5 if synced else 0.0)
