"""The simulator's multi-branch view: busy time per branch, every idle gap with what it
waited for (interaction, head, chain, reduce, stream, drain), and the timeline, Chrome
trace, Gantt picture and pipeflow-simulate report that show them."""

import json

import pytest

from pipeflow.models.cbm import cbm_stage_graph
from pipeflow.planning.unit_cost import UnitCost
from pipeflow.schedules.common import finish_sync
from pipeflow.schedules.ir import B, F, Placement, StageGraph
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import validate
from pipeflow.sim import draw_timeline, simulate
from pipeflow.sim.engine import WAIT_KINDS, Wait, classify_edge
from pipeflow.formats.timeline import Timeline
from pipeflow.simulate import format_report
from pipeflow.topology import get_topology

# a small concurrent-branch model: 4 vision and 3 text blocks, one interaction depth
CBM = {
    "name": "cbm_test",
    "family": "cbm",
    "vision": {"n_layer": 4, "n_embd": 16, "n_head": 2, "image_size": 8, "patch_size": 4, "channels": 1},
    "text": {"n_layer": 3, "n_embd": 16, "n_head": 2, "vocab_size": 258, "seq_len": 8},
    "interaction_layers": [2],
}


def free_links(n: int):
    return get_topology("local_cpu", num_devices=n, latency=0.0)


def cbm_graph(vision: int = 2, text: int = 2) -> StageGraph:
    return cbm_stage_graph(CBM, vision, text)[0]


def run(schedule, cost=None, topology=None, record=True):
    cost = cost or UnitCost(schedule.num_stages)
    return simulate(schedule, cost, topology or free_links(schedule.num_devices), record=record)


def check_waits_cover_idle(r):
    """Waits tile each compute stream's idle time exactly, each ends when its action starts."""
    times = r.times()
    by_device: dict[int, list[Wait]] = {}
    for w in r.waits:
        assert w.kind in WAIT_KINDS and w.end > w.start
        by_device.setdefault(w.device, []).append(w)
        if w.action is None:
            assert w.kind == "drain" and w.end == r.makespan
        else:
            assert times[w.action][0] == w.end  # the action started when the wait ended
            assert w.cause is not None and w.cause_device >= 0
            assert w.message == (w.kind in ("interaction", "head", "chain"))
    for d in r.per_device:
        waits = by_device.get(d.device, [])
        assert sum(w.duration for w in waits) == pytest.approx(d.idle, abs=1e-9)
        assert sum(d.idle_by_cause.values()) == pytest.approx(d.idle, abs=1e-9)
        assert list(d.idle_by_cause) == list(WAIT_KINDS)
        for a, b in zip(waits, waits[1:]):
            assert a.end <= b.start  # in time order, no overlap


# ------------------------------------------------------------------ busy per branch
@pytest.mark.parametrize("name,p,m", [("1f1b", 3, 4), ("gpipe", 2, 3), ("chimera", 4, 4), ("zb_h1", 3, 5)])
def test_busy_by_branch_sums_to_busy_and_waits_cover_idle(name, p, m):
    graph = cbm_graph()
    assert set(graph.branch) == {"vision", "text", "head"}
    sched = build_schedule(name, p, m, graph=graph)
    cost = UnitCost(graph.num_stages, forward=1.0, backward=2.0, weight=1.0, step=0.25)
    r = run(sched, cost)
    for d in r.per_device:
        assert list(d.busy_by_branch) == ["vision", "text", "head"]
        assert sum(d.busy_by_branch.values()) == pytest.approx(d.busy, abs=1e-9)
    # every stage's work lands on its own branch: F + B per microbatch plus the STEP
    per_stage = m * 3.0 + 0.25 * sched.placement.num_pipes
    for label in ("vision", "text", "head"):
        n = sum(1 for b in graph.branch if b == label)
        assert sum(d.busy_by_branch[label] for d in r.per_device) == pytest.approx(n * per_stage)
    check_waits_cover_idle(r)


def test_record_false_keeps_busy_by_branch_and_skips_waits():
    sched = build_schedule("1f1b", 3, 4, graph=cbm_graph())
    fast, full = run(sched, record=False), run(sched, record=True)
    assert fast.waits == [] and fast.timeline is None
    assert all(d.idle_by_cause == {} for d in fast.per_device)
    assert [d.busy_by_branch for d in fast.per_device] == [d.busy_by_branch for d in full.per_device]
    assert fast.makespan == full.makespan


def test_unlabelled_graphs_have_no_branches_but_waits_still_cover_idle():
    r = run(build_schedule("1f1b", 3, 4))
    assert all(d.busy_by_branch == {} for d in r.per_device)
    assert r.branches == ()
    check_waits_cover_idle(r)
    # a chain's messages are chain edges; 1F1B's only other idle is the drain
    assert {w.kind for w in r.waits} <= {"chain", "drain"}
    assert "busy_by_branch" not in r.summary() and "idle_by_cause" not in r.summary()
    assert all("idle_by_cause" not in d for d in r.summary()["per_device"])
    # the timeline is unchanged for chains: no wait events, no branch labels
    assert not r.timeline.select(stream="wait") and "branch" not in r.timeline.meta


# --------------------------------------------------------------- interaction waits
def tiny_branched():
    """v0 (vision) and t0 (text) feed v1 (vision, an interaction from t0); v1 and t0 feed
    the head. Stages: 0 = v0, 1 = t0, 2 = v1, 3 = head."""
    return StageGraph(4, ((0, 2), (1, 2), (2, 3), (1, 3)), branch=("vision", "text", "vision", "head"))


def test_classify_edge():
    br = tiny_branched().branch
    assert classify_edge(br, 0, 2) == "chain"
    assert classify_edge(br, 1, 2) == "interaction"
    assert classify_edge(br, 2, 3) == classify_edge(br, 1, 3) == "head"
    assert classify_edge((), 0, 1) == "chain"


def test_waiting_on_an_interaction_gradient_is_reported():
    """Device 0 holds v0 and v1, device 1 holds t0 and the head (F = 1, B = 2):

    d0: 0F0 [0,1]  2F0 [1,2]  ........ 2B0 [5,7]  0B0 [7,9]
    d1: 1F0 [0,1]  ..  3F0 [2,3]  3B0 [3,5]  ..... 1B0 [7,9]

    d1's 3F0 waits on v1's activation (into the head), d0's 2B0 on the head's gradient,
    and d1's 1B0 on v1's gradient across the interaction edge t0 -> v1."""
    graph = tiny_branched()
    placement = Placement.single([0, 1, 0, 1])
    orders = [[F(0, 0), F(2, 0), B(2, 0), B(0, 0)], [F(1, 0), F(3, 0), B(3, 0), B(1, 0)]]
    sched = validate(finish_sync("hand", graph, placement, orders, 1))
    r = run(sched, UnitCost(4, forward=1.0, backward=2.0))
    assert r.makespan == 9.0
    got = [(w.device, w.start, w.end, str(w.action), str(w.cause), w.cause_device, w.kind, w.message)
           for w in r.waits]
    assert got == [
        (0, 2.0, 5.0, "2B0", "3B0", 1, "head", True),
        (1, 1.0, 2.0, "3F0", "2F0", 0, "head", True),
        (1, 5.0, 7.0, "1B0", "2B0", 0, "interaction", True),
    ]
    assert r.per_device[1].idle_by_cause["interaction"] == 2.0
    assert r.per_device[0].busy_by_branch == {"vision": 6.0, "text": 0.0, "head": 0.0}
    assert r.per_device[1].busy_by_branch == {"vision": 0.0, "text": 3.0, "head": 3.0}
    check_waits_cover_idle(r)
    s = r.summary()
    assert s["idle_by_cause"]["interaction"] == 2.0 and s["busy_by_branch"]["head"] == 3.0
    assert s["per_device"][1]["idle_by_cause"]["head"] == 1.0
    json.dumps(s)


def test_waiting_on_an_interaction_activation_and_ties_go_to_the_interaction():
    """v1 (device 2) needs v0 (device 0, a chain edge) and t0 (device 1, an interaction):
    both arrive at 1, and the gap is charged to the interaction; a late t0 is too."""
    graph = tiny_branched()
    placement = Placement.single([0, 1, 2, 2])
    orders = [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)], [F(2, 0), F(3, 0), B(3, 0), B(2, 0)]]
    sched = validate(finish_sync("tie", graph, placement, orders, 1))
    r = run(sched)
    first = r.waits[[w.device for w in r.waits].index(2)]
    got = (first.start, first.end, str(first.action), first.kind, str(first.cause))
    assert got == (0.0, 1.0, "2F0", "interaction", "1F0")
    # a 0.5 message delay on the interaction edge only (t0 -> v1), via a per-class cost
    class Late(UnitCost):
        def message_bytes(self, src, dst, seg):
            return 1.0 if (src, dst) == (1, 2) else 0.0

    topo = get_topology("local_cpu", num_devices=3, latency=0.0, bandwidth=2.0)
    r = simulate(sched, Late(4, comm=None), topo, record=True)
    w = next(w for w in r.waits if w.device == 2)
    assert (w.start, w.end, w.kind, str(w.cause), w.message) == (0.0, 1.5, "interaction", "1F0", True)
    check_waits_cover_idle(r)


def test_a_step_waiting_for_its_all_reduce_is_a_reduce_wait():
    graph = cbm_graph()
    sched = build_schedule("chimera", 4, 4, graph=graph)
    topo = get_topology("local_cpu", num_devices=4, latency=0.0, bandwidth=1.0)
    r = simulate(sched, UnitCost(graph.num_stages, params=50.0, step=0.5), topo, record=True)
    check_waits_cover_idle(r)
    reduce_waits = [w for w in r.waits if w.kind == "reduce"]
    assert reduce_waits and all(w.action.kind == "S" and w.cause.kind == "R" for w in reduce_waits)
    assert all(not w.message for w in reduce_waits)


# --------------------------------------------------------------- timeline and picture
def test_timeline_carries_branches_and_wait_events(tmp_path):
    sched = build_schedule("chimera", 4, 4, graph=cbm_graph())
    r = run(sched)
    tl = r.timeline
    assert tl.meta["branch"] == list(sched.graph.branch)
    waits = tl.select(stream="wait")
    assert len(waits) == len(r.waits)
    for e, w in zip(waits, r.waits):
        assert (e.device, e.start, e.end) == (w.device, w.start, w.end)
        assert e.extra["cause_kind"] == w.kind
    assert tl.busy() == pytest.approx([d.busy for d in r.per_device])  # waits are not busy time
    trace = tl.to_chrome_trace()
    xs = [x for x in trace["traceEvents"] if x["ph"] == "X" and x["cat"] == "wait"]
    assert len(xs) == len(waits)
    assert all(x["args"]["cause_kind"] in WAIT_KINDS and "cause" in x["args"] for x in xs)
    threads = {x["args"]["name"] for x in trace["traceEvents"] if x["name"] == "thread_name"}
    assert "wait" in threads
    back = Timeline.load(tl.save(tmp_path / "timeline.json"))
    assert back.events == tl.events and back.meta == tl.meta


def test_gantt_colours_by_branch_and_marks_interaction_waits(tmp_path):
    graph = tiny_branched()
    placement = Placement.single([0, 1, 0, 1])
    orders = [[F(0, 0), F(2, 0), B(2, 0), B(0, 0)], [F(1, 0), F(3, 0), B(3, 0), B(1, 0)]]
    r = run(validate(finish_sync("hand", graph, placement, orders, 1)))
    tl = r.timeline
    assert any(e.extra["cause_kind"] == "interaction" for e in tl.select(stream="wait"))
    with_band = draw_timeline(tl, tmp_path / "branches.png")
    plain = Timeline([e for e in tl.events if e.stream != "wait"], tl.num_devices, tl.time_unit, meta=tl.meta)
    without = draw_timeline(plain, tmp_path / "no_waits.png")
    unlabelled = Timeline(plain.events, tl.num_devices, tl.time_unit,
                          meta={k: v for k, v in tl.meta.items() if k != "branch"})
    by_mb = draw_timeline(unlabelled, tmp_path / "by_microbatch.png")
    pics = [open(p, "rb").read() for p in (with_band, without, by_mb)]
    assert all(b[:8] == b"\x89PNG\r\n\x1a\n" for b in pics)
    assert len(set(pics)) == 3  # the band and the branch colours both change the picture


def test_gantt_of_a_cbm_schedule(tmp_path):
    r = run(build_schedule("1f1b", 3, 4, graph=cbm_graph()))
    path = draw_timeline(r.timeline, tmp_path / "cbm.png")
    assert open(path, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------- report
def test_report_shows_branches_and_idle_causes():
    sched = build_schedule("1f1b", 3, 4, graph=cbm_graph())
    r = run(sched)
    s = {
        "schedule": "1f1b", "stages": 3, "microbatches": 4, "virtual_stages": 1, "segments": 1,
        "model": {"name": "cbm_test"}, "topology": {"name": "local_cpu"}, "cost": {"name": "unit"},
        "makespan": r.makespan, "bubble_ratio": r.bubble_ratio, "per_device": r.summary()["per_device"],
    }
    text = format_report(s)
    assert "busy vision" in text and "busy text" in text and "busy head" in text
    header = next(line for line in text.splitlines() if "busy vision" in line)
    kinds = [c.split()[1] for c in header.split("  ") if c.strip().startswith("idle ")]
    assert kinds and kinds == [k for k in WAIT_KINDS if k in kinds]  # in the simulator's order
    assert "idle causes:" in text
    # chain models print no branch table
    chain = run(build_schedule("1f1b", 3, 4)).summary()["per_device"]
    assert "busy vision" not in format_report({**s, "per_device": chain}) and "idle causes" not in format_report(
        {**s, "per_device": chain})


def test_pipeflow_simulate_writes_the_branch_view(tmp_path):
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    overrides = ["model=cbm_tiny", "schedule=1f1b", "pipeline.stages=3", "pipeline.microbatches=4", "draw=false"]
    s = run_simulation(compose("simulate", overrides), tmp_path)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(s))
    assert set(on_disk["busy_by_branch"]) == {"vision", "text", "head"}
    assert list(on_disk["idle_by_cause"]) == list(WAIT_KINDS)
    for d in on_disk["per_device"]:
        assert sum(d["busy_by_branch"].values()) == pytest.approx(d["busy"], abs=1e-12)
        assert sum(d["idle_by_cause"].values()) == pytest.approx(d["idle"], abs=1e-12)
    assert on_disk["idle_by_cause"]["interaction"] > 0  # grouped 1F1B waits across the branches
    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert any(x.get("cat") == "wait" for x in trace["traceEvents"])
    assert "busy vision" in format_report(s)
