"""Seq1F1B and Seq1F1B-I: the order rule, equivalence with 1F1B / interleaved 1F1B at one
segment, the validator over the grid, closed forms in the simulator, the split driving
the analytic cost, and the config path (schedule.split, segment_lengths, summary.json)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeflow.config import ConfigError, compose, prepare_simulation, segment_lengths
from pipeflow.planning.cost import AnalyticCost
from pipeflow.planning.unit_cost import UnitCost
from pipeflow.planning.seqsplit import split_sequence
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules import Kind
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.registry import build_schedule, get_spec
from pipeflow.schedules.seq1f1b import unit_group_size
from pipeflow.sim.engine import simulate
from pipeflow.simulate import run_simulation
from pipeflow.topology.presets import get_topology

P_GRID = [2, 3, 4, 8]
S_GRID = [1, 2, 4]
GPT_7B = TransformerSpec("gpt_7b", n_layer=32, n_head=32, n_embd=4096, vocab_size=50304, seq_len=32768,
                         n_inner=16384)


def interleaved_ok(p: int, m: int, s: int) -> bool:
    return (m * s) % unit_group_size(p, s) == 0


def grid():
    for p in P_GRID:
        for s in S_GRID:
            for m in sorted({1, 2, 3, p, p + 1, 2 * p}):
                yield p, s, m


def compute_units(order):
    """(kind, stage, microbatch, segment) of the compute actions, in order."""
    return [(a.kind, a.stage, a.microbatch, a.segment) for a in order if a.is_compute]


# ------------------------------------------------------------------------- generators


def test_registered_with_segments_split_and_chunks():
    assert get_spec("seq1f1b").segments and get_spec("seq1f1b_interleaved").segments
    assert get_spec("seq1f1b_interleaved").virtual_stages and not get_spec("seq1f1b").virtual_stages
    assert list(get_spec("seq1f1b").options) == ["split"] == list(get_spec("seq1f1b_interleaved").options)


@pytest.mark.parametrize("p,s,m", list(grid()))
def test_generators_pass_the_validator(p, s, m):
    sched = build_schedule("seq1f1b", p, m, segments=s)  # build_schedule validates
    assert sched.num_segments == s and sched.num_stages == p
    computes = [a for o in sched.orders for a in o if a.is_compute]
    assert len(computes) == len(set(computes)) == 2 * p * m * s
    for v in (1, 2, 3):  # any m: the groups share the microbatches as evenly as they can
        sched = build_schedule("seq1f1b_interleaved", p, m, virtual_stages=v, segments=s)
        computes = [a for o in sched.orders for a in o if a.is_compute]
        assert len(computes) == len(set(computes)) == 2 * p * v * m * s
        assert sched.num_segments == s and sched.num_stages == p * v


@pytest.mark.parametrize("p", P_GRID)
def test_one_segment_is_exactly_1f1b_and_interleaved_1f1b(p):
    for m in range(1, 3 * p + 1):
        assert build_schedule("seq1f1b", p, m).orders == build_schedule("1f1b", p, m).orders
        for v in (1, 2, 3):
            ours = build_schedule("seq1f1b_interleaved", p, m, virtual_stages=v)
            assert ours.orders == build_schedule("interleaved_1f1b", p, m, virtual_stages=v).orders
            assert ours.placement == build_schedule("interleaved_1f1b", p, m, virtual_stages=v).placement


@pytest.mark.parametrize("p,s,m", list(grid()))
def test_seq1f1b_order_rule(p, s, m):
    sched = build_schedule("seq1f1b", p, m, segments=s, check=False)
    for r, order in enumerate(sched.compute_orders()):
        units = compute_units(order)
        fwd = [(mb, seg) for k, _, mb, seg in units if k == Kind.F]
        bwd = [(mb, seg) for k, _, mb, seg in units if k == Kind.B]
        # forwards microbatch by microbatch, segments in order; backwards oldest
        # microbatch first, segments in reverse
        assert fwd == [(mb, seg) for mb in range(m) for seg in range(s)]
        assert bwd == [(mb, seg) for mb in range(m) for seg in reversed(range(s))]
        # (p-r-1)+(s-1) warm-up forwards (at most m*s), then F/B alternation, then the drain
        warm = min(p - r - 1 + s - 1, m * s)
        kinds = "".join(k for k, *_ in units)
        steady = m * s - warm
        assert kinds == "F" * warm + "FB" * steady + "B" * warm
        assert all(st == r for _, st, _, _ in units)


@pytest.mark.parametrize("p,s,m", [(p, s, m) for p, s, m in grid() if interleaved_ok(p, m, s)])
@pytest.mark.parametrize("v", [2, 3])
def test_seq1f1b_interleaved_order_rule(p, s, m, v):
    sched = build_schedule("seq1f1b_interleaved", p, m, virtual_stages=v, segments=s, check=False)
    n = unit_group_size(p, s)
    assert n % s == 0 and p <= n < p + s  # the smallest multiple of s that is >= p
    for r, order in enumerate(sched.compute_orders()):
        units = compute_units(order)
        kinds = "".join(k for k, *_ in units)
        total = m * s * v
        warm = min((v - 1) * n + 2 * (p - r - 1) + (s - 1), total)
        assert kinds == "F" * warm + "FB" * (total - warm) + "B" * warm
        for c in range(v):
            stage = c * p + r  # chunk c of device r
            fwd = [(mb, seg) for k, st, mb, seg in units if k == Kind.F and st == stage]
            bwd = [(mb, seg) for k, st, mb, seg in units if k == Kind.B and st == stage]
            assert fwd == [(mb, seg) for mb in range(m) for seg in range(s)]
            assert bwd == [(mb, seg) for mb in range(m) for seg in reversed(range(s))]
    if p % s == 0:  # the paper's warm-up, (v-1)*p + 2*(p-r-1) + (s-1)
        assert n == p


def test_split_is_checked_and_kept_in_meta():
    assert build_schedule("seq1f1b", 4, 8, segments=4).meta["split"] == "uniform"
    s = build_schedule("seq1f1b_interleaved", 4, 8, virtual_stages=2, segments=2, split="compute")
    assert s.meta == {"virtual_stages": 2, "split": "compute"}
    # the split does not change the order
    assert build_schedule("seq1f1b", 4, 8, segments=4, split="compute").orders == \
        build_schedule("seq1f1b", 4, 8, segments=4).orders


@pytest.mark.parametrize(
    "name,p,m,kw,key",
    [
        ("seq1f1b", 4, 8, {"segments": 2, "split": "even"}, "schedule.split=even"),
        ("seq1f1b_interleaved", 4, 8, {"segments": 2, "virtual_stages": 2, "split": "x"}, "schedule.split=x"),
        ("seq1f1b", 4, 8, {"segments": 0}, "pipeline.segments=0"),
        ("seq1f1b", 0, 8, {"segments": 2}, "pipeline.stages=0"),
        ("seq1f1b", 4, 0, {"segments": 2}, "pipeline.microbatches=0"),
        ("seq1f1b", 4, 8, {"virtual_stages": 2}, "pipeline.virtual_stages=2"),
        ("seq1f1b_interleaved", 4, 8, {"virtual_stages": 0, "segments": 2}, "pipeline.virtual_stages=0"),
        ("1f1b", 4, 8, {"split": "compute"}, "schedule.split=compute"),
        ("1f1b", 4, 8, {"segments": 2}, "pipeline.segments=2"),
    ],
)
def test_bad_sizes_and_options_name_the_key(name, p, m, kw, key):
    with pytest.raises(ScheduleConfigError) as e:
        build_schedule(name, p, m, **kw)
    assert str(e.value).startswith(key)
    if key == "pipeline.segments=2":
        assert "seq1f1b" in str(e.value)  # points to the segmented schedules


# -------------------------------------------------------------------------- simulator


def _unit(name, p, m, **kw):
    s = build_schedule(name, p, m, **kw)
    return simulate(s, UnitCost(s.num_stages, comm=0.0), get_topology("local_cpu", s.num_devices), record=False)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_unit_cost_bubble_and_memory_closed_forms(p):
    m = 2 * p
    base = _unit("1f1b", p, m)
    for s in (2, 4):
        r = _unit("seq1f1b", p, m, segments=s)
        # equal segments: the bubble falls from (p-1)/(m+p-1) to (p-1)/(m*s+p-1)
        assert r.bubble_ratio == pytest.approx((p - 1) / (m * s + p - 1), abs=1e-12)
        assert r.bubble_ratio < base.bubble_ratio
        # stage r keeps (p-r-1+s)/s microbatches' activations instead of p-r
        assert [d.peak_live_microbatches for d in r.per_device] == [(p - k - 1 + s) / s for k in range(p)]
        ri = _unit("seq1f1b_interleaved", p, m, segments=s, virtual_stages=2)
        assert ri.bubble_ratio == pytest.approx((p - 1) / (2 * m * s + p - 1), abs=1e-12)


def test_compute_split_evens_out_segment_times_under_analytic_cost():
    dev = get_topology("dgx_a100_8", 4).devices[0]
    spread = {}
    for split in ("uniform", "compute"):
        lengths = split_sequence(split, GPT_7B.seq_len, 4, GPT_7B)
        cost = AnalyticCost(GPT_7B, 4, segment_lengths=lengths)
        times = [cost.compute_time("F", 1, seg, dev) for seg in range(4)]
        spread[split] = max(times) / min(times)
        # unequal segments cost unequal time, activation memory and message bytes
        if split == "compute":
            assert cost.message_bytes(0, 1, 0) > cost.message_bytes(0, 1, 3)
            assert cost.activation_bytes(1, 0) != cost.activation_bytes(1, 3)
    # within 3%: the split's FLOP model spreads the embedding and output FLOPs over every
    # token, while the first and last stage alone run them
    assert spread["compute"] < 1.03 < 1.5 < spread["uniform"]

    # and the pipeline runs faster with the compute split
    topo = get_topology("dgx_a100_8", 4)
    makespan = {}
    for split in ("uniform", "compute"):
        sched = build_schedule("seq1f1b", 4, 8, segments=4, split=split)
        cost = AnalyticCost(GPT_7B, 4, segment_lengths=split_sequence(split, GPT_7B.seq_len, 4, GPT_7B))
        makespan[split] = simulate(sched, cost, topo, record=False).makespan
    assert makespan["compute"] < makespan["uniform"]


# ----------------------------------------------------------------------------- config


def test_schedule_config_files_default_to_the_uniform_split():
    for name in ("seq1f1b", "seq1f1b_interleaved"):
        cfg = compose("simulate", [f"schedule={name}"])
        assert cfg.schedule.split == "uniform"
    assert "split" not in compose("simulate", ["schedule=1f1b"]).schedule  # each schedule has its own keys


def test_segment_lengths_from_plain_dicts():
    model = {"name": "gpt_7b", "family": "gpt", "n_layer": 32, "n_head": 32, "n_embd": 4096, "n_inner": 16384,
             "vocab_size": 50304, "n_positions": 32768, "seq_len": 32768}
    cfg = {"schedule": {"name": "seq1f1b", "split": "compute"}, "pipeline": {"segments": 4}, "model": model}
    assert segment_lengths(cfg) == [11021, 8421, 7087, 6239]
    cfg["schedule"]["split"] = None  # null: uniform
    assert segment_lengths(cfg) == [8192] * 4
    cfg["schedule"] = {"name": "seq1f1b_interleaved", "split": "uniform"}
    assert segment_lengths(cfg) == [8192] * 4
    assert segment_lengths({**cfg, "schedule": {"name": "1f1b"}}) is None
    with pytest.raises(ConfigError, match=r"^pipeline\.segments=40000: more segments"):
        segment_lengths({**cfg, "pipeline": {"segments": 40000}})
    with pytest.raises(ConfigError, match=r"^schedule\.split=halves: unknown"):
        segment_lengths({**cfg, "schedule": {"name": "seq1f1b", "split": "halves"}})


def test_simulate_summary_lists_segment_lengths(tmp_path: Path):
    over = ["schedule=seq1f1b", "pipeline.segments=4", "schedule.split=compute", "model=gpt_7b", "cost=analytic",
            "topology=dgx_a100_8", "draw=false"]
    s = run_simulation(compose("simulate", over), tmp_path)
    spec = TransformerSpec.from_config(compose("simulate", over).model)
    want = split_sequence("compute", spec.seq_len, 4, spec)
    assert s["segment_lengths"] == want == s["cost"]["segment_lengths"]
    assert sum(want) == spec.seq_len and want[0] > want[-1]
    assert (tmp_path / "summary.json").read_text().count('"segment_lengths"') == 2

    plain = run_simulation(compose("simulate", ["schedule=1f1b", "cost=unit", "draw=false"]), tmp_path / "b")
    assert plain["segment_lengths"] is None


def test_simulate_config_errors_name_the_key():
    def prep(*over):
        return prepare_simulation(compose("simulate", list(over)))

    with pytest.raises(ConfigError, match=r"^schedule\.split=halves"):
        prep("schedule=seq1f1b", "pipeline.segments=2", "schedule.split=halves")
    # each schedule's schema has its own keys: Hydra refuses the key, and our check the forced one
    with pytest.raises(Exception, match=r"schedule\.split"):
        prep("schedule=1f1b", "schedule.split=compute")
    with pytest.raises(ConfigError, match=r"^schedule\.split=compute: schedule '1f1b' has no option"):
        prep("schedule=1f1b", "+schedule.split=compute")
    with pytest.raises(ConfigError, match=r"^pipeline\.segments=2: sequence segments need causal"):
        prep("schedule=seq1f1b", "pipeline.segments=2", "model=bert_tiny")
    with pytest.raises(ConfigError, match=r"^pipeline\.segments=2: cost model 'profiled'"):
        prep("schedule=seq1f1b", "pipeline.segments=2", "cost=profiled")
    with pytest.raises(ConfigError, match=r"^cost\.segment_lengths=\[64, 64\]: 2 lengths for pipeline\.segments=4"):
        prep("schedule=seq1f1b", "pipeline.segments=4", "cost.segment_lengths=[64,64]")
    # an explicit list with one length per segment wins over the split
    inputs = prep("schedule=seq1f1b", "pipeline.segments=2", "cost.segment_lengths=[100,28]")
    assert inputs.segment_lengths == [100, 28] and inputs.cost.segment_lengths == (100, 28)
