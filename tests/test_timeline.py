"""The timeline format: Chrome-trace export, lossless round trip, foreign traces, PNG."""

import json
import struct

import pytest

from pipeflow.planning.cost import UnitCost
from pipeflow.schedules.common import finish_sync
from pipeflow.schedules.ir import F, I, W, Placement, StageGraph
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import validate
from pipeflow.sim import Event, Timeline, draw_timeline, simulate
from pipeflow.topology import get_topology


def simulated(name="1f1b", p=3, m=4, **cost):
    sched = build_schedule(name, p, m)
    topo = get_topology("local_cpu", num_devices=p, bandwidth=4.0, latency=0.125)
    return simulate(sched, UnitCost(p, message=2.0, **cost, comm=None), topo, record=True)


def rich_timeline() -> Timeline:
    """Two pipes, split backward, REDUCE, STEP and transfers: every event kind."""
    placement = Placement(2, ((0, 1), (1, 0)))
    orders = [
        [F(0, 0, 0), F(1, 1, 1), I(1, 1, 1), I(0, 0, 0), W(1, 1, 1), W(0, 0, 0)],
        [F(0, 1, 1), F(1, 0, 0), I(1, 0, 0), I(0, 1, 1), W(1, 0, 0), W(0, 1, 1)],
    ]
    sched = validate(finish_sync("rich", StageGraph.chain(2), placement, orders, 2, pipe_of_microbatch=(0, 1)))
    topo = get_topology("local_cpu", num_devices=2, bandwidth=4.0, latency=0.1)
    cost = UnitCost(2, message=1.0, params=2.0, step=0.3, residual=0.5, comm=None)
    return simulate(sched, cost, topo, record=True).timeline


def test_timeline_holds_every_action_and_transfer():
    r = simulated()
    tl = r.timeline
    compute = tl.select(stream="compute")
    assert len(compute) == sum(len(o) for o in build_schedule("1f1b", 3, 4).orders)
    assert {e.name for e in compute} >= {"0F0", "2B3", "1S@0"}
    comm = tl.select(stream="comm")
    assert len(comm) == 2 * 2 * 4  # activation + gradient per boundary per microbatch
    assert all(e.nbytes == 2.0 and abs(e.dst - e.src) == 1 for e in comm)
    assert tl.source == "simulated" and tl.time_unit == "units"  # unit costs keep their own unit
    assert tl.meta["schedule"] == "1f1b" and tl.meta["makespan"] == r.makespan
    assert tl.busy() == pytest.approx([d.busy for d in r.per_device])
    assert tl.makespan == pytest.approx(r.makespan)


def test_chrome_trace_shape():
    tl = rich_timeline()
    trace = tl.to_chrome_trace()
    json.dumps(trace)  # JSON-able as is
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ms = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert len(xs) == len(tl.events)
    procs = {e["pid"]: e["args"]["name"] for e in ms if e["name"] == "process_name"}
    assert procs == {0: "device 0", 1: "device 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ms if e["name"] == "thread_name"}
    assert threads[(0, 0)] == "compute"  # compute on top
    assert {name.split(" ")[0] for name in threads.values()} == {"compute", "collective", "comm"}
    by_name = {(x["pid"], x["name"]): x for x in xs}
    for e in tl.events:
        x = by_name[(e.device, e.name)]
        assert x["ts"] == pytest.approx(e.start * 1e6)
        assert x["dur"] == pytest.approx((e.end - e.start) * 1e6)
        assert threads[(x["pid"], x["tid"])].split(" ")[0] == e.stream
        for key in ("kind", "stage", "microbatch", "pipe", "segment"):
            assert x["args"][key] == getattr(e, key)
    # no two events overlap on one Chrome thread (viewers cannot draw that)
    lanes: dict = {}
    for x in xs:
        lanes.setdefault((x["pid"], x["tid"]), []).append((x["ts"], x["ts"] + x["dur"]))
    for spans in lanes.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-6


def test_overlapping_events_get_separate_lanes():
    events = [
        Event(0, "0F0->1F0", "F", 0, 0, 0, 0, 0.0, 2.0, "comm", 0, 1, 1.0),
        Event(0, "0F1->1F1", "F", 0, 1, 0, 0, 1.0, 3.0, "comm", 0, 1, 1.0),
        Event(0, "0F2->1F2", "F", 0, 2, 0, 0, 2.5, 4.0, "comm", 0, 1, 1.0),
    ]
    trace = Timeline(events, 2).to_chrome_trace()
    tids = [e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert tids[0] != tids[1] and tids[2] == tids[0]


@pytest.mark.parametrize("make", [lambda: simulated().timeline, rich_timeline])
def test_save_load_round_trip(tmp_path, make):
    tl = make()
    tl.meta["note"] = {"nested": [1, 2.5, "x"]}
    path = tl.save(tmp_path / "sub" / "timeline.json")
    back = Timeline.load(path)
    assert back.events == tl.events  # exact, floats included
    assert (back.num_devices, back.time_unit, back.source, back.meta) == (
        tl.num_devices, tl.time_unit, tl.source, tl.meta)
    assert back.to_chrome_trace() == tl.to_chrome_trace()


def test_measured_timeline_in_milliseconds_round_trips(tmp_path):
    events = [Event(1, "1F0", "F", 1, 0, 0, 0, 10.0, 12.5, extra={"rank": 1})]
    tl = Timeline(events, num_devices=2, time_unit="ms", source="measured", meta={"run": "x"})
    x = [e for e in tl.to_chrome_trace()["traceEvents"] if e["ph"] == "X"][0]
    assert (x["ts"], x["dur"]) == (10000.0, 2500.0)
    back = Timeline.load(tl.save(tmp_path / "m.json"))
    assert back.events == events and back.source == "measured" and back.time_unit == "ms"


def test_foreign_chrome_trace_is_read():
    trace = {
        "traceEvents": [
            {"name": "thread_name", "ph": "M", "pid": 3, "tid": 7, "args": {"name": "comm"}},
            {"name": "fwd", "ph": "X", "pid": 3, "tid": 1, "ts": 100.0, "dur": 50.0},
            {"name": "send", "ph": "X", "pid": 3, "tid": 7, "ts": 150.0, "dur": 5.0},
            {"name": "ignored", "ph": "i", "pid": 3, "tid": 1, "ts": 0.0},
        ]
    }
    tl = Timeline.from_chrome_trace(trace)
    assert [(e.name, e.device, e.stream, e.start, e.end) for e in tl.events] == [
        ("fwd", 3, "compute", 100.0, 150.0),
        ("send", 3, "comm", 150.0, 155.0),
    ]
    assert tl.num_devices == 4 and tl.time_unit == "us" and tl.source == "measured"


def test_bad_inputs_are_explained(tmp_path):
    with pytest.raises(ValueError, match="time_unit='h'"):
        Timeline([], 1, time_unit="h")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        Timeline.from_chrome_trace({"events": []})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a JSON timeline"):
        Timeline.load(bad)


def test_merge_concatenates_ranks():
    a = Timeline([Event(0, "0F0", "F", 0, 0, 0, 0, 0.0, 1.0)], 1, source="measured", meta={"a": 1})
    b = Timeline([Event(1, "1F0", "F", 1, 0, 0, 0, 1.0, 2.0)], 2, source="measured", meta={"b": 2})
    m = Timeline.merge([a, b])
    assert [e.device for e in m.events] == [0, 1] and m.num_devices == 2 and m.meta == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="different time units"):
        Timeline.merge([a, Timeline([], 1, time_unit="ms")])


# --------------------------------------------------------------------- PNG
def _png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return len(data), width, height


@pytest.mark.parametrize("make", [lambda: simulated().timeline, rich_timeline])
def test_gantt_png(tmp_path, make):
    path = draw_timeline(make(), tmp_path / "out" / "gantt.png", title="test chart")
    nbytes, width, height = _png_size(path)
    assert nbytes > 10_000 and width >= 800 and height >= 200


def test_gantt_png_large_timeline_uses_fast_path(tmp_path):
    from pipeflow.sim import gantt

    r = simulated("1f1b", 8, 256)
    assert len(r.timeline.select(stream="compute")) > gantt.DETAIL_LIMIT
    nbytes, width, height = _png_size(draw_timeline(r.timeline, tmp_path / "big.png"))
    assert nbytes > 10_000 and height > 300


def test_gantt_differs_by_kind(tmp_path):
    """F and B of the same microbatch are drawn differently (shade, hatch)."""
    import matplotlib.image as mpimg

    f_only = Timeline([Event(0, "0F0", "F", 0, 0, 0, 0, 0.0, 1.0)], 1)
    b_only = Timeline([Event(0, "0B0", "B", 0, 0, 0, 0, 0.0, 1.0)], 1)
    a = mpimg.imread(draw_timeline(f_only, tmp_path / "f.png", title=""))
    b = mpimg.imread(draw_timeline(b_only, tmp_path / "b.png", title=""))
    assert a.shape == b.shape
    assert abs(a - b).sum() > 1000  # large areas differ, not just the legend text
