"""Every generator over the acceptance grid, the notation, and size errors."""

import pytest

from pipeflow.schedules import Action, Kind, validate
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.ir import Placement, StageGraph, parse_orders
from pipeflow.schedules.registry import build_schedule, schedule_names, specs

P_GRID = [2, 3, 4, 6, 8]


def allowed(name, p, m, v=2):
    if name == "chimera":
        return p % 2 == 0 and m % 2 == 0
    if name == "interleaved_1f1b":
        return m % p == 0
    return True


def grid():
    for name in ["gpipe", "1f1b", "zb_h1", "chimera", "interleaved_1f1b"]:
        for p in P_GRID:
            for m in range(1, 4 * p + 1):
                if allowed(name, p, m):
                    yield name, p, m


@pytest.mark.parametrize("name,p,m", list(grid()))
def test_generator_passes_validator(name, p, m):
    vs = [2, 3] if name == "interleaved_1f1b" else [1]
    for v in vs:
        s = build_schedule(name, p, m, virtual_stages=v, check=False)
        validate(s)
        # every compute action of every (stage, microbatch) exactly once, across all devices
        computes = [a for o in s.orders for a in o if a.is_compute]
        per_mb_stage = 3 if s.uses_split_backward() else 2
        assert len(computes) == s.num_stages * m * per_mb_stage
        assert len(set(computes)) == len(computes)


def _chain_specs():
    """Every registered schedule a chain of stages runs from its generator alone."""
    return [s for s in specs() if s.generator is not None and s.sized and not s.branch_aware]


@pytest.mark.parametrize("spec", _chain_specs(), ids=lambda s: s.name)
def test_every_registered_schedule_over_a_grid(spec):
    """Grows with the registry: each schedule, over stages 2..6 and microbatches 1..2p
    (2 chunks where it interleaves, 2 segments where it splits sequences), either refuses
    the sizes with a config-key error or generates a schedule the validator accepts;
    some sizes must be accepted, and it exports to torch exactly when its spec says so."""
    from pipeflow.schedules.export import check_exportable

    tried = accepted = 0
    for p in (2, 3, 4, 6):
        for m in range(1, 2 * p + 1):
            tried += 1
            try:
                s = build_schedule(spec.name, p, m, virtual_stages=2 if spec.virtual_stages else 1,
                                   segments=2 if spec.segments else 1, check=False)
            except ScheduleConfigError as err:
                assert str(err).startswith(("pipeline.", "schedule.")), err
                continue
            accepted += 1
            validate(s)
            try:
                check_exportable(s)
                exports = True
            except ValueError:
                exports = False
            assert exports == spec.exportable, (spec.name, p, m)
    assert accepted >= 4, f"{spec.name} accepted {accepted} of {tried} sizes"


def test_registry_names():
    from pipeflow.schedules.registry import BUILTIN

    assert BUILTIN == ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "chimera", "pipedream", "pipedream_2bw", "amdp",
                       "bapp", "seq1f1b", "seq1f1b_interleaved", "zb_h2", "interleaved_zb", "zb_v", "dualpipe_v",
                       "looped_bfs", "file")
    assert set(BUILTIN) <= set(schedule_names())


@pytest.mark.parametrize(
    "name,p,m,kw,key",
    [
        ("chimera", 3, 6, {}, "pipeline.stages=3"),
        ("chimera", 4, 3, {}, "pipeline.microbatches=3"),
        ("interleaved_1f1b", 4, 8, {"virtual_stages": 0}, "pipeline.virtual_stages=0"),
        ("1f1b", 4, 8, {"virtual_stages": 2}, "pipeline.virtual_stages=2"),
        ("gpipe", 4, 8, {"segments": 2}, "pipeline.segments=2"),
        ("gpipe", 0, 8, {}, "pipeline.stages=0"),
        ("1f1b", 4, 0, {}, "pipeline.microbatches=0"),
        ("nope", 4, 8, {}, "schedule.name=nope"),
    ],
)
def test_impossible_sizes_fail_clearly(name, p, m, kw, key):
    with pytest.raises(ScheduleConfigError) as e:
        build_schedule(name, p, m, **kw)
    assert str(e.value).startswith(key)
    if name == "nope":
        assert "gpipe" in str(e.value) and "chimera" in str(e.value)


@pytest.mark.parametrize("text", ["0F3", "12B0", "2I1", "2W1", "1:2F3s1", "3:0B12s4", "4R@0", "1:4S@7"])
def test_notation_round_trip(text):
    a = Action.parse(text)
    assert str(a) == text
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("bad", ["", "F3", "0X1", "0F", "0R", "0R3", "0F@1", "a:0F1", "0F1s"])
def test_notation_rejects_garbage(bad):
    with pytest.raises(ValueError):
        Action.parse(bad)


def test_schedule_format_parses_back():
    s = build_schedule("chimera", 4, 8)
    rows = [[c for c in line.split("|", 1)[1].split()] for line in s.format().splitlines()]
    assert parse_orders(rows) == s.orders


def test_1f1b_order_shape():
    s = build_schedule("1f1b", 4, 8)
    # stage r: p-r-1 warm-up forwards, then F/B alternation, then the drain
    for r, order in enumerate(s.compute_orders()):
        kinds = "".join(a.kind for a in order)
        warm = 4 - r - 1
        assert kinds.startswith("F" * warm + "FB")
        assert kinds.count("F") == kinds.count("B") == 8


def test_gpipe_and_interleaved_placement():
    s = build_schedule("interleaved_1f1b", 4, 8, virtual_stages=3)
    assert s.num_stages == 12 and s.num_devices == 4
    for dev in range(4):
        assert [st for _, st in s.placement.stages_on(dev)] == [dev, dev + 4, dev + 8]


def test_zb_h1_splits_backward_and_defers_weight_grads():
    p, m = 4, 8
    s = build_schedule("zb_h1", p, m)
    for r, order in enumerate(s.compute_orders()):
        assert not any(a.kind == Kind.B for a in order)
        kinds = [a.kind for a in order]
        # stage r holds back r weight gradients for the drain: after its last I come
        # that I's own W plus the r deferred ones
        last_i = max(i for i, k in enumerate(kinds) if k == Kind.I)
        assert kinds[last_i + 1 :] == [Kind.W] * (r + 1)


def test_chimera_two_directions_and_reduce():
    p = 4
    s = build_schedule("chimera", p, 8)
    assert s.placement.table == ((0, 1, 2, 3), (3, 2, 1, 0))
    assert set(s.pipe_of_microbatch[:2]) == {0} and set(s.pipe_of_microbatch[2:4]) == {1}
    for dev, order in enumerate(s.orders):
        reduces = [a for a in order if a.kind == Kind.REDUCE]
        steps = [a for a in order if a.kind == Kind.STEP]
        assert {(a.pipe, a.stage) for a in reduces} == set(s.placement.stages_on(dev))
        assert {(a.pipe, a.stage) for a in steps} == set(s.placement.stages_on(dev))
        # each REDUCE comes right after that stage's last backward on this device
        for r in reduces:
            pos = order.index(r)
            last_b = max(i for i, a in enumerate(order) if a.kind == Kind.B and (a.pipe, a.stage) == (r.pipe, r.stage))
            assert all(a.kind == Kind.REDUCE for a in order[last_b + 1 : pos + 1])


def test_stage_graph_dag():
    # two branches joined at a head: 0->1->4, 2->3->4, with an interaction edge 1->3
    g = StageGraph(5, ((0, 1), (1, 4), (2, 3), (3, 4), (1, 3)), branch=("v", "v", "t", "t", "h"))
    assert g.sources == (0, 2) and g.sinks == (4,)
    assert g.preds[3] == (2, 1) and not g.is_chain
    with pytest.raises(ValueError, match="cycle"):
        StageGraph(2, ((0, 1), (1, 0)))
    with pytest.raises(ValueError):
        Placement(2, ((0, 2),))


def test_a_schedule_is_frozen_and_what_code_reads_is_a_field():
    """Sharding, data parallelism and gathering make new schedules; the fields the runtime,
    the simulator and the summaries read (data_parallel, gather, shard, a plan's cut) are
    fields, and meta only describes."""
    import dataclasses

    from pipeflow.schedules.data_parallel import pipeline_shape, replicate
    from pipeflow.schedules.sharding import with_gathers

    one = build_schedule("1f1b", 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.shard = "full"
    dp = replicate(one, 2)
    full = dataclasses.replace(with_gathers(dp, "chunk"), shard="full")
    assert (one.data_parallel, dp.data_parallel, full.data_parallel) == (1, 2, 2)
    assert (one.gather, dp.gather, full.gather, full.shard, dp.shard) == (None, None, "chunk", "full", "none")
    assert "data_parallel" not in dp.meta and "gather" not in full.meta
    assert pipeline_shape(full, 2) == {"stages": 2, "data_parallel": 2} and not full.layers_per_stage
