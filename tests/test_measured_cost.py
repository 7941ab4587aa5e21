"""MeasuredCost: per-stage times read off a timeline, fed back to the simulator.

- A hand-made timeline in which an action's event includes its wait for the message it
  needs (a runtime that starts the clock before waiting) gives back the durations and
  the message time it was built with.
- A simulated run's timeline, read back, gives the cost model's own durations and link
  time, and simulating with them reproduces the run's makespan; the same after moving
  every event's start back to when its device became free (waits inside events).
"""

from __future__ import annotations

import pytest

from pipeflow.planning.cost import AnalyticCost
from pipeflow.planning.unit_cost import UnitCost
from pipeflow.planning.measured import MeasuredCost
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.registry import build_schedule
from pipeflow.sim import simulate
from pipeflow.formats.timeline import Event, Timeline
from pipeflow.topology import get_topology
from pipeflow.topology.topology import Device

CPU = Device("cpu", 1e11, 8 * 2**30, 2e10)
GPT = TransformerSpec("gpt_test", n_layer=8, n_head=4, n_embd=256, vocab_size=1000, seq_len=256)


def ev(device, name, start, end, stream="compute"):
    """An event from its action notation, e.g. ev(0, "1B0", 3, 5)."""
    from pipeflow.schedules.ir import Action

    a = Action.parse(name)
    return Event(device, name, a.kind, a.stage, a.microbatch, a.pipe, a.segment, start, end, stream)


def hand_made() -> Timeline:
    """1F1B, 2 stages, 2 microbatches, timed from before each wait.

    True costs: F = 2 (stage 0) and 3 (stage 1), B = 4 and 5, S = 0.5, every message 1,
    and 0.25 of synchronisation before the optimizer step. Stage 1's first forward starts
    at 0 and waits for 0F0 (ends 2) + 1 inside its event; stage 0's backwards wait for
    1B0 (ends 11) and 1B1 (ends 19) + 1 inside theirs."""
    return Timeline(
        [
            ev(0, "0F0", 0, 2), ev(0, "0F1", 2, 4), ev(0, "0B0", 4, 16), ev(0, "0B1", 16, 24),
            ev(0, "0S@0", 24.25, 24.75),
            ev(1, "1F0", 0, 6), ev(1, "1B0", 6, 11), ev(1, "1F1", 11, 14), ev(1, "1B1", 14, 19),
            ev(1, "1S@0", 24.25, 24.75),
        ],
        num_devices=2,
        source="measured",
    )


def test_hand_made_timeline_gives_its_durations_back():
    cost = MeasuredCost.from_timeline(hand_made(), 2)
    assert cost.message_time == pytest.approx(1.0)
    assert cost.step_overhead == pytest.approx(0.25) and cost.step_sync == pytest.approx(0.25)
    expected = {("F", 0): 2, ("F", 1): 3, ("B", 0): 4, ("B", 1): 5, ("S", 0): 0.5, ("S", 1): 0.5}
    assert cost.times == pytest.approx(expected)
    assert cost.samples[("F", 1)] == 2 and cost.samples[("B", 0)] == 2
    assert [cost.compute_time(k, s, 0, CPU) for k, s in [("F", 1), ("B", 0)]] == pytest.approx([3, 4])
    # replayed by the simulator: the measured makespan (no link time: messages are fixed)
    sim = simulate(build_schedule("1f1b", 2, 2), cost, get_topology("local_cpu", num_devices=2))
    assert sim.makespan == pytest.approx(hand_made().makespan)
    d = cost.describe()
    assert d["name"] == "measured" and d["times"]["1F"] == pytest.approx(3) and d["message_samples"] >= 1


def test_naive_means_would_be_wrong():
    """The point of the dependency-aware reading: plain event means count the waits."""
    tl = hand_made()
    naive_b0 = sum(e.duration for e in tl.events if e.name in ("0B0", "0B1")) / 2
    assert naive_b0 == 10  # 12 and 8, against a true backward of 4
    assert MeasuredCost.from_timeline(tl, 2).times[("B", 0)] == pytest.approx(4)


def test_a_message_still_in_flight_at_the_start_is_not_taken_for_compute():
    """1F1 starts 0.5 after 0F1 ended, but its message takes 1: it hides 0.5 of waiting.
    Taken as a clean forward it would make the forward 3.25 and the message 0.75; the
    reclassification with the message time found settles at the true 3 and 1."""
    tl = Timeline(
        [
            ev(0, "0F0", 0, 2), ev(0, "0F1", 8.5, 10.5), ev(0, "0F2", 10.5, 12.5),
            ev(1, "1F0", 0, 6), ev(1, "1B0", 6, 11), ev(1, "1F1", 11, 14.5), ev(1, "1F2", 14.5, 17.5),
        ],
        num_devices=2,
        source="measured",
    )
    cost = MeasuredCost.from_timeline(tl, 2)
    assert cost.message_time == pytest.approx(1.0)
    assert cost.times[("F", 1)] == pytest.approx(3.0)


def test_fixed_or_missing_message_time():
    tl = hand_made()
    assert MeasuredCost.from_timeline(tl, 2, message_time=1.0).times[("B", 0)] == pytest.approx(4)
    # message_time=None: no correction for transit (the waits shrink by the message
    # time only), and the topology's links price message_bytes
    c = MeasuredCost.from_timeline(tl, 2, message_time=None, message_bytes=1e6)
    assert c.message_time is None and c.message_bytes(0, 1, 0) == 1e6
    assert c.times[("B", 0)] == pytest.approx(5)  # from the producer's end: 1 of transit included


def analytic(p: int, layers=None) -> AnalyticCost:
    return AnalyticCost(GPT, p, microbatch_size=2, layers_per_stage=layers)


CASES = [
    ("gpipe", 4, 8, 1, [1, 2, 3, 2]),
    ("1f1b", 4, 8, 1, [3, 1, 2, 2]),
    ("1f1b", 2, 4, 1, None),
    ("zb_h1", 3, 6, 1, [2, 3, 3]),
    ("interleaved_1f1b", 2, 4, 2, None),
]


def _simulated(name, p, m, v, layers):
    sched = build_schedule(name, p, m, v)
    cost = analytic(sched.num_stages, layers)
    topo = get_topology("local_cpu", num_devices=sched.num_devices)
    return sched, cost, topo, simulate(sched, cost, topo, record=True)


def as_runtime_records(tl: Timeline) -> Timeline:
    """The same run as a runtime that starts the clock before waiting records it: every
    compute action is timed from when its device is free, its wait inside the event."""
    out = []
    by_device: dict[int, list[Event]] = {}
    for e in tl.events:
        if e.stream == "compute":
            by_device.setdefault(e.device, []).append(e)
    for d, evs in by_device.items():
        evs.sort(key=lambda e: e.start)
        free = 0.0
        for e in evs:
            out.append(Event(d, e.name, e.kind, e.stage, e.microbatch, e.pipe, e.segment, free, e.end))
            free = e.end
    return Timeline(out, tl.num_devices, source="measured")


@pytest.mark.parametrize("name,p,m,v,layers", CASES)
@pytest.mark.parametrize("style", ["simulated", "runtime"])
def test_simulated_run_reproduces_its_makespan(name, p, m, v, layers, style):
    sched, cost, topo, ref = _simulated(name, p, m, v, layers)
    tl = ref.timeline if style == "simulated" else as_runtime_records(ref.timeline)
    measured = MeasuredCost.from_timeline(tl, sched.num_stages)
    # one message costs the route's latency plus its bytes over the bandwidth
    route = topo.route(0, 1)
    link = route.latency + cost.message_bytes(0, 1, 0) / route.bandwidth
    assert measured.message_time == pytest.approx(link, rel=1e-9)
    for (kind, stage), t in measured.times.items():
        assert t == pytest.approx(cost.compute_time(kind, stage, 0, topo.devices[0]), rel=1e-9), (kind, stage)
    kinds = {k for k, _ in measured.times}
    assert kinds == ({"F", "I", "W", "S"} if name == "zb_h1" else {"F", "B", "S"})
    replay = simulate(sched, measured, topo, record=False)
    assert replay.makespan == pytest.approx(ref.makespan, rel=1e-9)
    assert replay.bubble_ratio == pytest.approx(ref.bubble_ratio, rel=1e-6)


def test_message_bytes_over_the_topology_reproduce_it_too():
    sched, cost, topo, ref = _simulated("1f1b", 4, 8, 1, [3, 1, 2, 2])
    measured = MeasuredCost.from_timeline(
        ref.timeline, 4, message_time=None, message_bytes=cost.message_bytes(0, 1, 0)
    )
    # priced by the links, the simulated waits are not transit-corrected, but a simulated
    # event never waits inside itself, so nothing needs correcting
    replay = simulate(sched, measured, topo, record=False)
    assert replay.makespan == pytest.approx(ref.makespan, rel=1e-9)


def test_unit_costs_in_their_own_units():
    sched = build_schedule("1f1b", 3, 5)
    cost = UnitCost(3, forward=1.0, backward=2.5, step=0.5, comm=0.25)
    ref = simulate(sched, cost, get_topology("local_cpu", num_devices=3), record=True)
    measured = MeasuredCost.from_timeline(ref.timeline, 3)
    assert measured.time_unit == "units" and measured.message_time == pytest.approx(0.25)
    assert measured.times[("B", 2)] == pytest.approx(2.5) and measured.times[("S", 0)] == pytest.approx(0.5)
    assert simulate(sched, measured, get_topology("local_cpu", num_devices=3)).makespan == pytest.approx(ref.makespan)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no compute events"):
        MeasuredCost.from_timeline(Timeline([], 2), 2)
    with pytest.raises(ValueError, match="stage 1, but num_stages=1"):
        MeasuredCost.from_timeline(hand_made(), 1)
    with pytest.raises(ValueError, match="no forward of stage"):
        MeasuredCost.from_timeline(hand_made(), 3)
    with pytest.raises(ValueError, match="message_time='auto'"):
        MeasuredCost.from_timeline(hand_made(), 2, message_time="auto")
    cost = MeasuredCost.from_timeline(hand_made(), 2)
    with pytest.raises(ValueError, match="no time for W on stage 1.*holds B, F, S"):
        cost.compute_time("W", 1, 0, CPU)
    with pytest.raises(ValueError, match="time_unit='units' with message_time=None"):
        MeasuredCost(2, {("F", 0): 1.0}, message_time=None, time_unit="units")
    with pytest.raises(ValueError, match="stages are 0 to 1"):
        MeasuredCost(2, {("F", 2): 1.0})
