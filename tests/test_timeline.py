"""The timeline format: Chrome-trace export, lossless round trip, foreign traces, PNG."""

import dataclasses
import gzip
import json
import math
import random
import struct

import pytest

from pipeflow.planning.unit_cost import UnitCost
from pipeflow.schedules.common import finish_sync
from pipeflow.schedules.ir import F, I, W, Placement, StageGraph
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import validate
from pipeflow.sim import Event, Timeline, draw_timeline, simulate
from pipeflow.formats.timeline import STREAMS, timeline_file
from pipeflow.formats.trace import FIELDS
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
        args = x["args"]
        # a compute event's kind is its category; fields at their default are left out
        assert args.get("kind", x["cat"]) == e.kind
        assert (x["cat"] == e.kind) if e.stream == "compute" else (x["cat"] == e.stream and args["kind"] == e.kind)
        assert (args["stage"], args["microbatch"]) == (e.stage, e.microbatch)
        for key, default in (("pipe", 0), ("segment", 0), ("src", -1), ("dst", -1), ("nbytes", 0.0), ("version", -1)):
            assert args.get(key, default) == getattr(e, key)
            assert (key in args) == (getattr(e, key) != default)
        assert "start" not in args and "end" not in args  # exact in otherData's columns
    # no two events overlap on one Chrome thread (viewers cannot draw that), in the
    # whole nanoseconds the viewers count
    lanes: dict = {}
    for x in xs:
        ns = round(x["ts"] * 1000)
        lanes.setdefault((x["pid"], x["tid"]), []).append((ns, ns + round(x["dur"] * 1000)))
    for spans in lanes.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end


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


def _greedy_tids(events):
    """The lane rule written out plainly: events in (start, position) order take the first
    lane of their (device, stream) free by their start; tids count the streams of a
    device in STREAMS order, then their lanes."""
    lanes, lane_of = {}, {}
    for i in sorted(range(len(events)), key=lambda i: (events[i].start, i)):
        e = events[i]
        ends = lanes.setdefault((e.device, e.stream), [])
        k = next((k for k, t in enumerate(ends) if t <= e.start), len(ends))
        ends[k:k + 1] = [e.end]
        lane_of[i] = k
    rank = {s: r for r, s in enumerate(STREAMS)}
    first, nxt = {}, {}
    for (d, s), ends in sorted(lanes.items(), key=lambda kv: (kv[0][0], rank.get(kv[0][1], 99), kv[0][1])):
        first[(d, s)] = nxt.get(d, 0)
        nxt[d] = first[(d, s)] + len(ends)
    return [first[(e.device, e.stream)] + lane_of[i] for i, e in enumerate(events)]


def test_lanes_match_the_plain_greedy_rule():
    rng = random.Random(7)
    events = []
    for i in range(400):
        start = rng.choice([rng.uniform(0, 50), float(rng.randint(0, 50))])  # ties included
        stream = rng.choice(["compute", "comm", "comm", "collective", "wait", "custom"])
        events.append(Event(rng.randrange(3), f"e{i}", "F", 0, i, 0, 0, start, start + rng.choice([0.0, 0.5, 3.0]),
                            stream))
    # and one stream that never overlaps, listed in time order (one lane)
    events += [Event(3, f"c{i}", "F", 0, i, 0, 0, float(i), i + 1.0) for i in range(20)]
    xs = [x for x in Timeline(events, 4).to_chrome_trace()["traceEvents"] if x["ph"] == "X"]
    assert [x["tid"] for x in xs] == _greedy_tids(events)
    assert {x["tid"] for x in xs if x["pid"] == 3} == {0}


def test_back_to_back_events_never_overlap_in_the_viewers_nanoseconds():
    """ts and dur are cut to whole nanoseconds on one grid: an event that starts where
    the previous one ends starts at or after its displayed end (rounding the start and
    the duration each on their own would put about one in eight a nanosecond early)."""
    rng = random.Random(3)
    bounds = sorted(rng.uniform(0, 0.5) for _ in range(2001))
    events = [Event(0, f"0F{i}", "F", 0, i, 0, 0, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    xs = [x for x in Timeline(events, 1).to_chrome_trace()["traceEvents"] if x["ph"] == "X"]
    assert {x["tid"] for x in xs} == {0}  # one lane: they never overlap
    ends = [round(x["ts"] * 1000) + round(x["dur"] * 1000) for x in xs]
    starts = [round(x["ts"] * 1000) for x in xs]
    assert all(start >= end for end, start in zip(ends, starts[1:]))
    assert all(0 <= e.start * 1e6 - x["ts"] < 0.0011 for x, e in zip(xs, events))


def test_written_text_is_strict_json_and_compact(tmp_path):
    tl = rich_timeline()
    path = tl.save(tmp_path / "t.json")

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    trace = json.loads(open(path).read(), parse_constant=no_constants)
    assert trace == tl.to_chrome_trace()
    # the viewers read displayTimeUnit and otherData first; exactTimes, last, they skip
    assert list(trace) == ["displayTimeUnit", "otherData", "traceEvents", "exactTimes"]
    assert trace["exactTimes"]["encoding"] == "base64 float64 little-endian shuffled"
    compute = [x for x in trace["traceEvents"] if x["ph"] == "X" and x["cat"] in "FBIWS"]
    # nothing at its default: a compute event's args are its stage and microbatch (and version)
    assert compute and all(set(x["args"]) <= {"stage", "microbatch", "version", "pipe"} for x in compute)


def test_save_gzipped_loads_back_equal_under_either_name(tmp_path):
    tl = rich_timeline()
    tl.meta["note"] = "gzipped"
    path = tl.save(tmp_path / "timeline.json", compress=True)
    assert path == str(tmp_path / "timeline.json.gz")
    assert open(path, "rb").read(2) == b"\x1f\x8b" and not (tmp_path / "timeline.json").exists()
    assert json.loads(gzip.decompress(open(path, "rb").read())) == tl.to_chrome_trace()  # gunzip gives the trace
    for name in ("timeline.json", "timeline.json.gz"):
        back = Timeline.load(tmp_path / name)
        assert back.events == tl.events and back.meta == tl.meta
    assert Timeline.load(tmp_path).events == tl.events  # a run folder
    assert timeline_file(tmp_path) == tmp_path / "timeline.json.gz"
    # saving the plain form removes the gzipped one, and the other way round
    tl.save(tmp_path / "timeline.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json"]
    tl.save(tmp_path / "timeline.json.gz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json.gz"]


def test_compress_none_gzips_only_above_the_threshold(tmp_path, monkeypatch):
    from pipeflow.formats import trace as trace_module

    tl = simulated().timeline
    size = len("".join(tl._trace_pieces()))
    monkeypatch.setattr(trace_module, "COMPRESS_ABOVE", size)
    assert tl.save(tmp_path / "a" / "timeline.json", compress=None).endswith("timeline.json")
    monkeypatch.setattr(trace_module, "COMPRESS_ABOVE", size - 1)
    path = tl.save(tmp_path / "b" / "timeline.json", compress=None)
    assert path.endswith("timeline.json.gz")
    assert Timeline.load(path).events == tl.events
    with pytest.raises(FileNotFoundError, match="neither timeline.json nor timeline.json.gz"):
        timeline_file(tmp_path)


def test_awkward_events_round_trip(tmp_path):
    events = [
        Event(0, 'quote " back\\slash é', "F", 0, 0, 0, 0, 0.1, 0.30000000000000004),
        Event(1, "to infinity", "B", 1, 2, 3, 4, 1.0, math.inf, "comm", 1, 0, 12.5, 7, extra={"a": [1, 2]}),
        Event(0, "wait 0F1", "F", 0, 1, 0, 0, 0.5, 0.75, "wait", 1, 0,
              extra={"cause_kind": "chain", "pipe": 9, "start": -1.0}),  # keys that name event fields
        Event(2, "odd stream", "W", 2, 0, 0, 0, 2.0, 2.5, "prefetch"),
    ]
    tl = Timeline(events, num_devices=3, time_unit="ms", source="measured", meta={"ünï": "cödé"})
    for compress in (False, True):
        back = Timeline.load(tl.save(tmp_path / f"t{compress}.json", compress=compress))
        assert back.events == events and back.meta == tl.meta and back.time_unit == "ms"
    wait = [x for x in tl.to_chrome_trace()["traceEvents"] if x.get("name") == "wait 0F1"][0]
    assert wait["args"]["cause_kind"] == "chain" and "pipe" not in wait["args"]  # shown, never over a field


def test_traces_of_earlier_versions_load(tmp_path):
    """Every field and the exact times in each event's args, no exactTimes."""
    trace = {
        "traceEvents": [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "comm"}},
            {"name": "0F0->1F0", "cat": "comm", "ph": "X", "pid": 0, "tid": 1, "ts": 100000.0, "dur": 200000.0,
             "args": {"kind": "F", "stage": 0, "microbatch": 0, "pipe": 0, "segment": 0, "stream": "comm",
                      "src": 0, "dst": 1, "nbytes": 8.0, "version": -1, "start": 0.1, "end": 0.30000000000000004}},
        ],
        "otherData": {"format": "pipeflow.timeline/1", "num_devices": 2, "time_unit": "s", "source": "simulated",
                      "meta": {}},
    }
    (tmp_path / "timeline.json").write_text(json.dumps(trace))
    (e,) = Timeline.load(tmp_path / "timeline.json").events
    assert e == Event(0, "0F0->1F0", "F", 0, 0, 0, 0, 0.1, 0.30000000000000004, "comm", 0, 1, 8.0)


def test_simulated_timeline_is_written_from_its_columns():
    """The simulator's timeline keeps its events as columns until they are read: the
    trace is the same before and after, and so are the events to a rebuilt timeline."""
    tl = rich_timeline()
    assert tl._columns is not None
    text = "".join(tl._trace_pieces())
    assert tl.column("stream").count("comm") == 4 and tl._columns is not None  # still not made
    events = tl.events
    assert tl._columns is None and tl.events is events
    assert "".join(tl._trace_pieces()) == text
    plain = Timeline(list(events), tl.num_devices, tl.time_unit, tl.source, tl.meta)
    assert plain == tl and "".join(plain._trace_pieces()) == text
    events[0].name = "renamed"  # a change to the events shows in what is written
    assert '"name":"renamed"' in "".join(tl._trace_pieces())
    moved = dataclasses.replace(tl, meta={"moved": True})
    assert moved.events == events and moved.meta == {"moved": True}
    with pytest.raises(ValueError, match="columns of different lengths"):
        Timeline.from_columns({**{f: [] for f in FIELDS}, "name": ["x"]}, 1)


def test_bad_gzip_is_explained(tmp_path):
    bad = tmp_path / "timeline.json.gz"
    bad.write_bytes(b"\x1f\x8b" + b"not really gzip")
    with pytest.raises(ValueError, match="is not a JSON timeline"):
        Timeline.load(bad)


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


@pytest.mark.parametrize("compress", [False, True])
def test_a_trace_written_beside_is_the_trace_save_writes(tmp_path, compress):
    """pipeflow-simulate compresses and writes its trace on a thread while it walks the
    memory (Timeline.save_beside): the same file, and an error reaches the caller."""
    sched = build_schedule("1f1b", 4, 8)
    tl = simulate(sched, UnitCost(4), get_topology("local_cpu", num_devices=4)).timeline
    here = tl.save(tmp_path / "a" / "timeline.json", compress=compress)
    beside = tl.save_beside(tmp_path / "b" / "timeline.json", compress=compress).result()
    read = (lambda p: gzip.open(p).read()) if compress else (lambda p: open(p, "rb").read())
    assert beside.endswith(".gz") == compress and read(beside) == read(here)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError):
        tl.save_beside(tmp_path / "file" / "timeline.json").result()
