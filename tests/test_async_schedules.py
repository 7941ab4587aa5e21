"""Asynchronous schedules (PipeDream, PipeDream-2BW, AMDP): placement, validity,
admission, the weight versions each computation sees, config errors, and what the
simulator reports about them (staleness, weight versions kept, optimizer memory).
No timing assertions: timing rules are tested in test_sim.py and test_closed_forms.py."""

from __future__ import annotations

import pytest

from pipeflow.config import compose
from pipeflow.planning.cost import AnalyticCost
from pipeflow.planning.unit_cost import UnitCost
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.asynchronous import amdp_placement, mirror_groups
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.ir import Kind, Placement, WeightPolicy
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.versions import summarize, weight_versions
from pipeflow.schedules.zero import zero_owners
from pipeflow.sim import compile_schedule, simulate
from pipeflow.simulate import format_report, run_simulation
from pipeflow.topology import get_topology

SMALL_GPT = TransformerSpec("gpt-8L", n_layer=8, n_head=4, n_embd=256, vocab_size=1000, seq_len=64)


def free_links(n: int):
    return get_topology("local_cpu", num_devices=n, latency=0.0)


def sim(schedule, cost=None):
    cost = cost or UnitCost(schedule.num_stages, params=1.0)
    return simulate(schedule, cost, free_links(schedule.num_devices), record=False)


# ------------------------------------------------------------------ AMDP placement
def test_amdp_placement_d8_matches_the_paper():
    pl = amdp_placement(8)
    assert pl.num_pipes == 4 and pl.num_devices == 8

    def held(dev):
        pairs = pl.stages_on(dev)
        assert [pipe for pipe, _ in pairs] == [0, 1, 2, 3]
        return tuple(stage for _, stage in pairs)

    assert held(0) == (0, 3, 4, 7)
    assert held(1) == (1, 2, 5, 6)
    assert held(3) == (3, 0, 7, 4)
    assert held(7) == (7, 4, 3, 0)
    assert mirror_groups(pl) == [(0, 3, 4, 7), (1, 2, 5, 6)]


def test_amdp_placement_d4_follows_the_rule():
    d = 4
    pl = amdp_placement(d)
    assert pl.num_pipes == d // 2
    for j in range(d // 2):
        for i in range(d):
            expect = (2 * j + i) % d if j % 2 == 0 else (2 * j + 1 - i) % d
            assert pl.device(j, i) == expect
    for dev in range(d):  # every device holds d/2 distinct stages
        stages = [s for _, s in pl.stages_on(dev)]
        assert len(stages) == len(set(stages)) == d // 2


@pytest.mark.parametrize("d", [2, 4, 8])
def test_zero_owners_spread_one_stage_per_device_in_amdp(d):
    pl = amdp_placement(d)
    owners = zero_owners(pl)
    assert sorted(owners) == list(range(d))
    for stage, dev in owners.items():
        assert dev in {dv for _, dv in pl.replicas(stage)}
    assert sorted(owners.values()) == list(range(d))  # each device owns exactly one stage


def test_zero_owners_rule_fewest_owned_then_lowest_id():
    # stage 0 on {0, 1}, stage 1 on {0, 1}, stage 2 on {0, 2}
    pl = Placement(3, ((0, 0, 0), (1, 1, 2)))
    assert zero_owners(pl) == {0: 0, 1: 1, 2: 2}
    pl = Placement(2, ((0, 0, 0), (1, 1, 1)))
    assert zero_owners(pl) == {0: 0, 1: 1, 2: 0}


# ------------------------------------------------------------------ validity
@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("windows", [1, 3, 5])
@pytest.mark.parametrize("rounds", [1, 2])
def test_amdp_validates(d, windows, rounds):
    s = build_schedule("amdp", d, rounds * d, windows=windows, accumulation_rounds=rounds)
    assert s.policy == WeightPolicy.BOUNDED
    assert s.num_microbatches == rounds * d * windows
    assert s.microbatches_per_step == rounds * d and s.windows == windows
    assert set(s.update_of_microbatch) == set(range(windows))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("windows", [1, 2, 4])
def test_pipedream_and_2bw_validate(p, windows):
    for stash in (True, False):
        s = build_schedule("pipedream", p, p + 1, windows=windows, stash=stash)
        assert s.policy == (WeightPolicy.STASH if stash else WeightPolicy.NONE)
        assert s.num_microbatches == (p + 1) * windows
    for m in (p, 2 * p + 1):
        s = build_schedule("pipedream_2bw", p, m, windows=windows)
        assert s.policy == WeightPolicy.DOUBLE_BUFFER
        assert s.update_of_microbatch == tuple(mb // m for mb in range(m * windows))


# ------------------------------------------------------------------ admission
@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2])
def test_amdp_admits_at_most_two_minibatches_per_pipeline(d, rounds):
    s = build_schedule("amdp", d, rounds * d, windows=3)
    for order in s.orders:
        in_flight: dict[int, int] = {}
        for a in order:
            if a.stage != 0 or a.kind not in (Kind.F, Kind.B):
                continue
            in_flight[a.pipe] = in_flight.get(a.pipe, 0) + (1 if a.kind == Kind.F else -1)
            assert 0 <= in_flight[a.pipe] <= 2, (a, in_flight)


# ------------------------------------------------------------------ weight versions
@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_amdp_mismatch_bounded_and_only_in_a_windows_first_round(d, rounds):
    m = rounds * d
    s = build_schedule("amdp", d, m, windows=4)
    recs = weight_versions(s)
    assert len(recs) == s.num_microbatches * d
    assert summarize(recs)["max_mismatch"] <= 1
    assert min(r.mismatch for r in recs) == 0
    for r in recs:
        if r.mismatch:
            assert r.microbatch % m < d and r.update >= 1, r
        assert r.staleness == r.mismatch or r.staleness >= 0


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_pipedream_stash_staleness_is_p_minus_1_minus_i(p):
    s = build_schedule("pipedream", p, 2 * p, windows=3)
    recs = weight_versions(s)
    assert all(r.mismatch == 0 for r in recs)
    assert len(recs) == s.num_microbatches * p
    for r in recs:
        assert r.update == r.microbatch  # one update per microbatch
        if r.microbatch >= p - 1:  # steady state
            assert r.staleness == p - 1 - r.stage, r
        else:
            assert r.staleness == min(r.microbatch, p - 1 - r.stage), r


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipedream_without_stash_mismatches_on_stage_0(p):
    s = build_schedule("pipedream", p, 2 * p, windows=2, stash=False)
    recs = weight_versions(s)
    assert max(r.mismatch for r in recs if r.stage == 0) > 0
    assert all(r.mismatch == 0 for r in recs if r.stage == p - 1)  # the last stage runs B right after F


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 3])
def test_2bw_every_gradient_one_update_stale(p, extra):
    s = build_schedule("pipedream_2bw", p, p + extra, windows=4)
    recs = weight_versions(s)
    assert len(recs) == s.num_microbatches * p
    for r in recs:
        assert r.mismatch == 0
        assert r.staleness == (1 if r.update >= 1 else 0), r


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "chimera", "zb_h1"])
def test_sync_schedules_see_one_version(name):
    s = build_schedule(name, 4, 8)
    recs = weight_versions(s)
    assert recs and all(r.forward == r.backward == r.applied == 0 for r in recs)
    assert summarize(recs) == summarize([])
    r = sim(s)
    assert r.versions == [] and r.staleness == summarize([])
    assert "microbatches_per_step" not in r.summary()


# ------------------------------------------------------------------ config errors
@pytest.mark.parametrize(
    "name,stages,microbatches,params,key",
    [
        ("amdp", 3, 6, {}, "pipeline.stages"),
        ("amdp", 5, 10, {}, "pipeline.stages"),
        ("amdp", 4, 6, {}, "pipeline.microbatches"),
        ("amdp", 4, 8, {"accumulation_rounds": 3}, "accumulation_rounds"),
        ("amdp", 4, 8, {"accumulation_rounds": 0}, "schedule.accumulation_rounds"),
        ("amdp", 4, 8, {"windows": 0}, "schedule.windows"),
        ("amdp", 4, 8, {"zero": "yes"}, "schedule.zero"),
        ("pipedream_2bw", 4, 3, {}, "pipeline.microbatches"),
        ("pipedream", 4, 8, {"stash": 1}, "schedule.stash"),
        ("pipedream", 4, 8, {"zero": True}, "schedule.zero"),
        ("pipedream_2bw", 4, 8, {"stash": True}, "schedule.stash"),
        ("1f1b", 4, 8, {"zero": True}, "schedule.zero"),
        ("gpipe", 4, 8, {"windows": 2}, "schedule.windows"),
    ],
)
def test_config_errors_name_the_key(name, stages, microbatches, params, key):
    with pytest.raises(ScheduleConfigError) as info:
        build_schedule(name, stages, microbatches, **params)
    assert key in str(info.value)


# ------------------------------------------------------------------ simulator
def test_simulator_reports_amdp_staleness():
    s = build_schedule("amdp", 4, 8, windows=3)
    r = sim(s)
    summ = r.summary()
    assert summ["staleness"] == summarize(weight_versions(s))
    assert summ["staleness"]["max_mismatch"] == 1 and summ["staleness"]["mismatched"] > 0
    assert summ["microbatches_per_step"] == 8 and summ["windows"] == 3 and summ["updates"] == 3
    assert r.versions == weight_versions(s)
    # a precompiled schedule gives the same records
    cs = compile_schedule(s)
    cost = UnitCost(4, params=1.0)
    assert sim(cs, cost).versions == sim(cs, cost).versions == r.versions


@pytest.mark.parametrize("p", [2, 4, 8])
def test_weight_versions_kept_per_policy(p):
    stash = sim(build_schedule("pipedream", p, 2 * p, windows=2))
    nostash = sim(build_schedule("pipedream", p, 2 * p, windows=2, stash=False))
    two = sim(build_schedule("pipedream_2bw", p, p, windows=3))
    sync = sim(build_schedule("1f1b", p, 2 * p))
    # stash: stage i keeps up to p - i versions (UnitCost params=1: bytes = versions)
    assert [d.peak_weight_versions for d in stash.per_device] == [p - i for i in range(p)]
    assert [d.weight_bytes for d in stash.per_device] == [float(p - i) for i in range(p)]
    assert [d.peak_weight_versions for d in two.per_device] == [2] * p
    assert [d.weight_bytes for d in two.per_device] == [2.0] * p
    for r in (nostash, sync):
        assert [d.peak_weight_versions for d in r.per_device] == [1] * p
        assert [d.weight_bytes for d in r.per_device] == [1.0] * p
    if p > 2:
        assert stash.per_device[0].peak_weight_versions > two.per_device[0].peak_weight_versions == 2


def test_replicated_stages_count_every_replica():
    r = sim(build_schedule("chimera", 4, 8))
    assert [d.weight_bytes for d in r.per_device] == [2.0] * 4  # two stages per device
    a = sim(build_schedule("amdp", 8, 8, windows=2))
    assert [d.weight_bytes for d in a.per_device] == [4.0] * 8  # d/2 stages per device, one version
    assert [d.peak_weight_versions for d in a.per_device] == [1] * 8


@pytest.mark.parametrize("d", [4, 8])
def test_amdp_zero_shrinks_optimizer_memory_on_every_device(d):
    cost = AnalyticCost(SMALL_GPT, d)
    assert all(cost.model_state_bytes(s) > cost.param_bytes(s) for s in range(d))
    plain = sim(build_schedule("amdp", d, d, windows=2), cost)
    zero = sim(build_schedule("amdp", d, d, windows=2, zero=True), cost)
    owners = zero_owners(amdp_placement(d))
    for dp, dz in zip(plain.per_device, zero.per_device):
        assert 0 < dz.optimizer_bytes < dp.optimizer_bytes
        held = [s for _, s in amdp_placement(d).stages_on(dp.device)]
        extra = [cost.model_state_bytes(s) - cost.param_bytes(s) for s in held]
        assert dp.optimizer_bytes == pytest.approx(sum(extra))
        assert dz.optimizer_bytes == pytest.approx(
            sum(x for s, x in zip(held, extra) if owners[s] == dp.device))
        assert dz.weight_bytes == dp.weight_bytes  # sharding the optimizer keeps every weight
    # the timing does not depend on where the optimizer state lives
    assert zero.makespan == plain.makespan


def test_unit_cost_has_no_optimizer_state():
    r = sim(build_schedule("amdp", 4, 4, windows=2, zero=True))
    assert all(d.optimizer_bytes == 0.0 for d in r.per_device)


# ------------------------------------------------------------------ pipeflow-simulate
def test_simulate_app_reports_staleness(tmp_path):
    cfg = compose("simulate", ["schedule=amdp", "pipeline.stages=4", "pipeline.microbatches=8", "cost=unit",
                               "draw=false", "schedule.windows=3"])
    s = run_simulation(cfg, tmp_path)
    assert s["staleness"]["max_mismatch"] == 1
    assert s["windows"] == 3 and s["microbatches_per_step"] == 8 and s["updates"] == 3
    assert all("weight_bytes" in d and "optimizer_bytes" in d for d in s["per_device"])
    text = format_report(s)
    assert "staleness     max 1" in text and "mismatch      max 1" in text and "weight versions" in text

    cfg = compose("simulate", ["schedule=1f1b", "pipeline.stages=2", "pipeline.microbatches=4", "cost=unit",
                               "draw=false"])
    s = run_simulation(cfg, tmp_path / "sync")
    assert s["staleness"]["max_staleness"] == 0 and "windows" not in s
    assert "staleness" not in format_report(s)
