"""pipeflow-search: the candidates it walks, the closed form that pre-filters them (its
memory is the simulator's, its times track the simulator's), the search's ranking and
what it says of candidates that do not fit, and the files the app writes (a training
config that composes and is the pick, candidate configs the sweep trains, summaries
pipeflow-compare pairs with measured runs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hydra import compose as hydra_compose, initialize_config_dir

from pipeflow.compare.runs import read_run
from pipeflow.compare.table import sim_key
from pipeflow.config import CONF_DIR, ConfigError, compose, prepare_training
from pipeflow.planning.search import (Candidate, NothingFits, Pricer, SearchSpace, candidates, default_schedules,
                                      pareto, search)
from pipeflow.config.groups.model import resolve_model
from pipeflow.planning.search.closed_form import Structure, priced_as
from pipeflow.schedules.periods import PERIODS
from pipeflow.planning.search.progress_line import duration
from pipeflow.schedules.data_parallel import replicate
from pipeflow.schedules.sharding import with_gathers
from pipeflow.sim.engine import simulate
from pipeflow.sim.device_memory import device_memory, library_workspace
from pipeflow.sim.device_walk import tapes
from pipeflow.sim.memory_peaks import split_periods
from pipeflow.sim.memory_terms import like_stage, term_value
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.registry import get_spec
from pipeflow.search import compose_search, prepare_search, register_search_configs, run_search
from pipeflow.topology.presets import build_topology

SYNC = default_schedules(False)
GIB = 2**30


def _pricer(model="gpt_tiny", topology=("cluster", {"nodes": 1}), devices=8, limit=None):
    cfg = compose("simulate", [f"model={model}"])
    spec = TransformerSpec.from_config(cfg.model)
    name, params = topology
    topo = build_topology({"name": name, **params}, devices)
    return spec, Pricer(spec, topo, 0.5, 2, 0.0, limit)


def _sizes(name: str) -> list[tuple[int, int, int]]:
    """(virtual_stages, segments, microbatches) a schedule is checked at, on 4 stages."""
    spec = get_spec(name)
    v = 2 if spec.virtual_stages else 1
    s = 2 if spec.segments else 1
    return [(v, s, m) for m in (8, 12)]


# ------------------------------------------------------------------------- candidates

def test_every_candidate_trains_the_global_batch_on_every_device():
    space = SearchSpace(devices=8, global_batch=16, n_layer=4, schedules=SYNC, microbatch_sizes=(1, 2, 4),
                        virtual_stages=(2,), segments=(2,))
    cands = list(candidates(space))
    assert len(cands) == len(set(cands)) > 100
    for c in cands:
        assert c.devices == 8 and c.global_batch == 16
        assert c.stages * c.virtual_stages <= 4
        assert (c.virtual_stages > 1) == get_spec(c.schedule).virtual_stages
        assert (c.segments > 1) == get_spec(c.schedule).segments
    assert {c.schedule for c in cands} == set(SYNC)
    assert space.skipped  # p = 8 has more stages than gpt_tiny's 4 layers
    # asynchronous schedules only when staleness is allowed
    assert not any(get_spec(n).asynchronous for n in SYNC)
    assert {"pipedream", "pipedream_2bw", "amdp"} <= set(default_schedules(True))


def test_a_candidates_overrides_are_a_training_run():
    c = Candidate("seq1f1b", 2, 1, 4, 2, 1, 2, "full", "parameters", "compute")
    cfg = compose("train", ["model=gpt_tiny", "logger=none", *c.overrides()])
    inputs = prepare_training(cfg)
    assert inputs.world_size == 2
    assert (cfg.pipeline.microbatches, cfg.pipeline.microbatch_size, cfg.pipeline.segments) == (4, 2, 2)
    assert (cfg.model.recompute, cfg.partition.name, cfg.schedule.split) == ("full", "parameters", "compute")
    sharded = Candidate("zb_v", 2, 2, 4, 1, 2, 1, "none", "uniform", "uniform", "full", "chunk")
    cfg = compose("train", ["model=gpt_tiny", "logger=none", *sharded.overrides()])
    inputs = prepare_training(cfg)
    assert inputs.world_size == 4 and (cfg.pipeline.shard, cfg.pipeline.gather) == ("full", "chunk")
    assert inputs.plan.schedule.shard == "full" and inputs.plan.schedule.gather == "chunk"
    assert sharded.label() == "zb_v p2xdp2 m4x1 v2 zero3-chunk"


def test_sharding_is_searched_where_there_are_replicas():
    """Each pipeline.shard level (full with each gather policy asked for) for candidates
    with data-parallel replicas; "none" alone without them."""
    space = SearchSpace(devices=4, global_batch=8, n_layer=4, schedules=["1f1b"], microbatch_sizes=(1,),
                        recompute=("none",), partitions=("uniform",), gathers=("step", "microbatch"))
    got = {(c.data_parallel, c.shard, c.gather) for c in candidates(space)}
    assert got == {(1, "none", "step"), *{(dp, sh, g) for dp in (2, 4) for sh, g in
                                          [("none", "step"), ("optimizer", "step"), ("gradients", "step"),
                                           ("full", "step"), ("full", "microbatch")]}}


# ------------------------------------------------------------------------- closed form

SHARDINGS = [("optimizer", "step"), ("gradients", "step"), ("full", "step"), ("full", "chunk"),
             ("full", "microbatch")]


def _whole(pricer, c):
    """(step time, bubble, peak bytes, device) of the candidate's whole schedule, every
    replica and every microbatch simulated and walked, as pipeflow-simulate does."""
    st, cost = pricer.structure(c), pricer.cost(c)
    sched = replicate(st.schedule, c.data_parallel) if c.data_parallel > 1 else st.schedule
    if c.shard != "none" and c.data_parallel > 1:
        sched = with_gathers(sched, c.gather) if c.shard == "full" else sched
        sched = dataclasses.replace(sched, shard=c.shard)
    res = simulate(sched, cost, pricer.topology, record=False, waits=False)
    mem = [m["peak_bytes"] for m in device_memory(sched, cost, res.per_device,
                                                  library_workspace(pricer.topology, sched.num_devices))]
    return res.makespan + pricer.tied_sync(c, st), res.bubble_ratio, max(mem), mem.index(max(mem))


@pytest.mark.parametrize("name", SYNC)
def test_search_prices_memory_and_time_as_the_whole_simulation(name):
    """Both prices against the whole schedule simulated and walked (every replica, every
    microbatch): the closed form's peak and the simulated phase's step time, bubble and
    peak, for any bytes per stage: with and without recomputation and the zero-bubble
    residual, and with 2 replicas each sharding level and gather policy (their
    reductions, shards, gathers: the first replica's walk, its slices priced for the
    replicas), at sizes below and past each schedule's periodic fill (where two small
    walks and, for the TIMED schedules, three small simulations stand for the whole)."""
    _, pricer = _pricer(model="gpt_small", devices=8)
    periodic = 0
    v, s, _ = _sizes(name)[0]
    for v, s, m in _sizes(name) + [(v, s, 30)]:
        for recompute in ("none", "full"):
            for dp, shard, gather in [(1, "none", "step"), (2, "none", "step"),
                                      *[(2, *x) for x in SHARDINGS if recompute == "none"]]:
                c = Candidate(name, 4, dp, m, 2, v, s, recompute, "parameters", "uniform", shard, gather)
                closed, simulated = pricer.closed_form(c), pricer.simulated(c)
                assert not isinstance(closed, str), closed
                step, bubble, peak, device = _whole(pricer, c)
                assert closed.peak_memory == pytest.approx(peak, rel=1e-9), c.label()
                assert simulated.peak_memory == pytest.approx(peak, rel=1e-9), c.label()
                assert closed.device % 4 == simulated.device % 4 == device % 4
                assert simulated.step_time == pytest.approx(step, rel=1e-9), c.label()
                assert simulated.bubble == pytest.approx(bubble, rel=1e-9, abs=1e-12), c.label()
                assert closed.walked  # (the search's simulated phase takes the closed form's memory then)
                assert pricer.simulated(c, closed).peak_memory == simulated.peak_memory
                periodic += pricer.periodic(c) is not None
    assert periodic or name not in PERIODS  # (every schedule with a rule meets it at m = 30)


@pytest.mark.parametrize("name", sorted(PERIODS))
def test_periodic_walks_repeat_one_block(name):
    """Past its rule's fill, one more period of microbatches inserts the same block of
    steps into every device's walk (and a replica's, under the sharding walks): the walk
    at k periods more is P + X (k times) + S, step by step."""
    spec = get_spec(name)
    checked = 0
    for p in (2, 4):
        for v in ((2,) if spec.virtual_stages else (1,)):
            for s in ((1, 3) if spec.segments else (1,)):
                # (the interleaved rules: m a multiple of the group or not; Chimera's m even)
                for m in {4 * p, 4 * p + 2} | ({4 * p + 1} if name != "chimera" else set()):
                    fill, q = PERIODS[name](p, v, s, m)
                    m0 = fill + (m - fill) % q
                    small, big = (Structure(name, p, x, v, s) for x in (m0, m0 + 2 * q))
                    for walk in (("plain",), ("gradients", ""), ("full", "chunk")):
                        index: dict = {}
                        parts = [split_periods(a, b) for a, b in zip(small.encoded_tapes(walk, index),
                                                                     big.encoded_tapes(walk, index))]
                        for k in (1, 3):
                            whole = Structure(name, p, m0 + k * q, v, s).encoded_tapes(walk, index)
                            assert all(np.array_equal(w, np.concatenate([b for b, again in blocks
                                                                         for b in [b] * (k if again else 1)]))
                                       for w, blocks in zip(whole, parts)), (name, p, v, s, m0, walk, k)
                            checked += 1
    assert checked


@pytest.mark.parametrize("name, p, m, v, s", [("1f1b", 3, 5, 1, 1), ("zb_v", 2, 6, 2, 1), ("chimera", 4, 6, 1, 1),
                                               ("seq1f1b_interleaved", 4, 5, 2, 3), ("gpipe", 1, 3, 1, 1)])
def test_one_pass_walks_zero2_beside_zero3(name, p, m, v, s):
    """A fully sharded replica's walk and its bare twin (the same lists without GATHER and
    FREE, under gradients) from one pass are the walks each alone gives, step by step:
    where receives are posted, where REDUCEs fall, the parameters and the step's buffers."""
    st = Structure(name, p, m, v, s)
    full_alone = tapes(st._replica(("full", "step")), replicas=2)
    bare_alone = tapes(st._replica(("gradients", "")), replicas=2)
    full, bare = tapes(st._replica(("full", "step")), replicas=2, bare="gradients")

    def steps(t):
        return t.named(), [(i, str(a)) for i, a in t.starts]

    assert [steps(t) for t in full] == [steps(t) for t in full_alone]
    assert [steps(t) for t in bare] == [steps(t) for t in bare_alone]
    assert any(len(a.rows()) != len(b.rows()) for a, b in zip(full, bare)) or p == 1
    with pytest.raises(ValueError, match="bare"):
        tapes(st._replica(("gradients", "")), replicas=2, bare="gradients")


def test_paired_walks_price_as_the_walks_alone():
    """A search over ZeRO-2 and ZeRO-3 walks both from one pass (StructureCache.pairs):
    every candidate's closed-form peak is the one the walks alone give, periodic or not."""
    (_, alone), (_, paired) = _pricer(model="gpt_small", devices=8), _pricer(model="gpt_small", devices=8)
    paired.structures.pairs = True
    seen = 0
    for name, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h2", 1)):
        for m in (3, 8, 21):
            for shard in ("full", "gradients", "none"):
                c = Candidate(name, 4, 2, m, 1, v, 1, "none", "uniform", shard=shard)
                a, b = alone.closed_form(c), paired.closed_form(c)
                if isinstance(a, str):
                    continue
                assert b.peak_memory == a.peak_memory and b.step_time == a.step_time, c.label()
                seen += 1
    assert seen >= 18


def test_a_period_that_does_not_hold_falls_back_to_the_stand_ins(monkeypatch):
    """A rule whose period is wrong for a schedule (Chimera repeats every p microbatches,
    not every two) fails the check (the walk two periods on is not the smaller one with
    blocks standing twice): the candidate is priced from two stand-in sizes instead."""
    _, pricer = _pricer(model="gpt_small", devices=8)
    monkeypatch.setitem(PERIODS, "chimera", lambda p, v, s, m: (p + 2, 2))
    c = Candidate("chimera", 4, 1, 30, 1, 1, 1, "none", "uniform")
    assert pricer.periodic(c) == (6, 2, 12)
    assert pricer.needs(c, pricer.cost(c)) is None  # (the walks at 6 and 10 differ by a unit of 4, not twice a block)
    closed, (_, _, peak, _) = pricer.closed_form(c), _whole(pricer, c)
    assert closed.peak_memory == pytest.approx(peak, rel=0.02)


def test_stage_kinds_price_every_term_alike():
    """Stages with the same layers, first or not, last or not, have the same bytes for
    every term of every walk: the search values each term once per kind of stage."""
    alike = 0  # stages priced as another's
    for model in ("gpt_small", "llama_tiny"):
        cfg = compose("simulate", [f"model={model}"])
        resolve_model(cfg)
        pricer = Pricer(TransformerSpec.from_config(cfg.model), build_topology({"name": "cluster", "nodes": 1}, 8))
        p = 4 if pricer.spec.n_layer >= 8 else 2
        for name, v, s in (("zb_h1", 1, 1), ("seq1f1b", 1, 3), ("zb_v", 2, 1)):
            for recompute, partition in (("none", "parameters"), ("selective", "uniform"), ("full", "parameters")):
                c = Candidate(name, p, 2, 8, 2, v, s, recompute, partition, "uniform", "full", "chunk")
                cost, st = pricer.cost(c), pricer.structure(c)
                kinds = cost.stage_kinds()
                alike += len(kinds) - len(set(kinds))
                for mem, walk in ((st.memory, None), (st.replicated("gradients", ""), "gradients"),
                                  (st.replicated("full", "chunk"), "full")):
                    for key in mem.terms:
                        key = priced_as(key, walk, 2) if walk else key
                        assert term_value(key, cost) == term_value(like_stage(key, kinds), cost), (model, key)
    assert alike > 10


def test_cost_models_of_one_shape_share_their_terms_bytes_exactly():
    """The pricer values a memory term once for every cost model of one shape (model,
    microbatch, segments, recomputation, tensor group) and kind of stage, whatever the
    stage count or partition: every walk's bytes as it prices them, after many cost
    models have filled what they share, are each cost model's own term by term."""
    for model in ("gpt_small", "llama_tiny"):
        cfg = compose("simulate", [f"model={model}"])
        resolve_model(cfg)
        pricer = Pricer(TransformerSpec.from_config(cfg.model), build_topology({"name": "cluster", "nodes": 1}, 8))
        shared = 0
        for name, v, s in (("zb_h1", 1, 1), ("seq1f1b", 1, 3), ("interleaved_1f1b", 2, 1)):
            for p, dp in ((2, 4), (4, 2), (8, 1)):
                for partition in ("uniform", "parameters"):
                    for recompute in ("none", "full"):
                        c = Candidate(name, p, dp, 2 * p + 2, 1, v, s, recompute, partition, "uniform",
                                      "optimizer" if dp > 1 else "none")
                        cost, st = pricer.cost(c), pricer.structure(c)
                        if isinstance(cost, str) or isinstance(st, str):
                            continue
                        before = sum(map(len, pricer._shared_terms.values()))  # (each shape's table)
                        mem = st.replicated(c.shard, c.gather)
                        got = pricer._values(cost, mem.terms, c, True)
                        shared += len(mem.terms) and sum(map(len, pricer._shared_terms.values())) == before
                        own = [term_value(priced_as(k, c.shard, dp), cost) for k in mem.terms]
                        assert list(got) == own, (model, c)
        assert shared > 3  # cost models whose every term another had valued


def test_closed_form_memory_extrapolates_past_6p_microbatches():
    """A schedule without a period rule (GPipe, ZB-H2) is walked at two smaller sizes
    past 6p microbatches and its peak extrapolated: near, where the peak saturates or
    grows linearly. One with a rule is exact at any size."""
    _, pricer = _pricer(model="gpt_small", devices=4)
    for name in ("1f1b", "gpipe", "zb_h2", "interleaved_1f1b"):
        v = 2 if get_spec(name).virtual_stages else 1
        c = Candidate(name, 4, 1, 40, 1, v, 1, "none", "uniform")
        assert Pricer.stand_in_sizes(4, 40) == (16, 8)
        assert (pricer.periodic(c) is not None) == (name in PERIODS)
        closed, simulated = pricer.closed_form(c), pricer.simulated(c)
        assert closed.peak_memory == pytest.approx(simulated.peak_memory, rel=1e-9 if name in PERIODS else 0.02), name
        assert closed.compute == pytest.approx(simulated.compute, rel=1e-6), name


@pytest.mark.parametrize("name", SYNC)
def test_closed_form_time_tracks_the_simulator(name):
    """The pre-filter's step time (bubble formula, messages, exposed all-reduce) stays
    near the simulator's on one node of A100s, so its top holds the simulator's top."""
    _, pricer = _pricer(model="gpt_small", devices=8)
    for v, s, m in _sizes(name):
        for dp in (1, 2):
            c = Candidate(name, 4, dp, m, 1, v, s, "none", "uniform")
            closed, simulated = pricer.closed_form(c), pricer.simulated(c)
            assert closed.compute == pytest.approx(simulated.compute, rel=1e-6), c.label()
            assert closed.step_time == pytest.approx(simulated.step_time, rel=0.12), c.label()


def test_a_schedules_size_rule_refuses_with_its_own_sentence():
    _, pricer = _pricer(devices=8)
    why = pricer.closed_form(Candidate("dualpipe_v", 4, 2, 6, 1, 2))
    assert isinstance(why, str) and "pipeline.microbatches=6" in why and "dualpipe_v" in why
    why = pricer.closed_form(Candidate("chimera", 4, 2, 3, 1))
    assert isinstance(why, str) and "chimera" in why


# ------------------------------------------------------------------------- the search

def _space(spec, devices=8, **kw):
    return SearchSpace(devices=devices, global_batch=kw.pop("global_batch", 32), n_layer=spec.n_layer,
                       schedules=kw.pop("schedules", SYNC), microbatch_sizes=(1, 2, 4), virtual_stages=(2,),
                       segments=(2, 4), **kw)


def test_the_search_ranks_by_the_simulator_and_says_what_does_not_fit():
    spec, pricer = _pricer(model="gpt_small", devices=8, limit=1.2 * GIB)
    result = search(_space(spec), pricer, simulate_top=6)
    assert result.considered == len(result.closed) + sum(result.refused.values())
    times = [q.step_time for q in result.ranked]
    assert times == sorted(times) and all(q.fits and q.how == "simulated" for q in result.ranked)
    # every schedule with a fitting candidate has its fastest simulated
    fitting = {q.candidate.schedule for q in result.closed if q.fits}
    assert {q.candidate.schedule for q in result.ranked} == fitting
    # the limit excludes some, each reported with by how much, the least over first
    assert result.out_of_memory and all(q.over > 0 for q in result.out_of_memory)
    overs = [q.over for q in result.out_of_memory]
    assert overs == sorted(overs)
    assert all(q.peak_memory == pytest.approx(q.memory_limit + q.over) for q in result.out_of_memory)
    front = pareto(result.ranked)
    assert front[0] is result.best
    # the console names the schedules with no candidate that fits, and the closest misses
    from pipeflow.planning.search.verdicts import format_search

    text = format_search(result, "gpt_small", "cluster", 8, 5)
    unfit = sorted({q.candidate.schedule for q in result.closed} - fitting)
    assert (f"no candidate fits: {', '.join(unfit)}" in text) == bool(unfit)
    assert result.out_of_memory[0].candidate.label() in text
    assert all(a.peak_memory > b.peak_memory for a, b in zip(front, front[1:]))


def test_a_budget_nothing_fits_names_the_smallest_requirement():
    spec, pricer = _pricer(model="gpt_small", devices=8, limit=0.05 * GIB)
    with pytest.raises(NothingFits) as err:
        search(_space(spec), pricer)
    spec, unlimited = _pricer(model="gpt_small", devices=8)
    least = min(q.peak_memory for q in search(_space(spec), unlimited).closed)
    assert f"{least / GIB:.3g} GiB" in str(err.value)
    assert "0.05 GiB" in str(err.value)


def test_staleness_brings_the_asynchronous_schedules():
    spec, pricer = _pricer(devices=4)
    space = _space(spec, devices=4, schedules=["1f1b", "pipedream", "pipedream_2bw", "amdp"], global_batch=8)
    result = search(space, pricer, simulate_top=4)
    stale = [q for q in result.closed if get_spec(q.candidate.schedule).asynchronous]
    assert stale and all(q.candidate.data_parallel == 1 for q in stale)  # one pipeline each
    assert {q.candidate.schedule for q in result.ranked} >= {"pipedream", "pipedream_2bw", "amdp"}
    assert all(q.step_time > 0 and q.fits for q in result.ranked)
    with pytest.raises(ConfigError, match="search.staleness=true"):
        prepare_search(compose_search([*CPU, "search.schedules=[1f1b,amdp]"]))


def test_two_workers_find_what_one_finds():
    spec, pricer = _pricer(devices=4)
    one = search(_space(spec, devices=4), pricer, simulate_top=4, workers=1)
    spec, pricer = _pricer(devices=4)
    two = search(_space(spec, devices=4), pricer, simulate_top=4, workers=2)
    assert [(q.candidate, q.step_time) for q in one.ranked] == [(q.candidate, q.step_time) for q in two.ranked]
    assert sorted((q.candidate.label(), q.step_time) for q in one.closed) == \
        sorted((q.candidate.label(), q.step_time) for q in two.closed)
    assert one.refused == two.refused



def test_a_search_that_lets_each_groups_caches_go_prices_as_one_that_keeps_them():
    """The search prices a group of candidates (stages x chunks, segments) at a time and
    then lets go of the group's cost models, structures and walks (Pricer.release): its
    closed forms, time and memory, are those of a pricer that kept everything."""
    spec, pricer = _pricer(devices=4)
    space = _space(spec, devices=4)
    result = search(space, pricer, simulate_top=4, workers=1)
    assert len(pricer.structures) > 1  # (the count of those built stays)
    spec, keeping = _pricer(devices=4)
    kept = {c: keeping.closed_form(c) for c in candidates(space)}
    assert len({(q.candidate.stages * q.candidate.virtual_stages, q.candidate.segments) for q in result.closed}) > 2
    for q in result.closed:
        own = kept[q.candidate]
        assert (q.step_time, q.peak_memory, q.device) == (own.step_time, own.peak_memory, own.device), q.candidate
    assert len(result.closed) == sum(not isinstance(q, str) for q in kept.values())
    # what the search's pricer holds after it is what its simulated phase built (for its
    # few candidates), not every group's
    assert len(pricer._costs) <= len(result.simulated) < len(keeping._costs)
    # and a release leaves no cache keyed by a cost model's, a structure's or a walk's id
    # (a new object may take a freed one's id): only what every group shares stays
    pricer.release()
    shared = {"_term_numbers", "_shared_tables", "_shared_terms", "_layers", "_specs", "_tensors"}
    for q in pricer._tensors.values():
        assert not {name for name, v in vars(q).items() if isinstance(v, dict) and v and name not in shared}
    assert not pricer._forms._costs and not pricer.structures._cache


# ------------------------------------------------------------------------- the app

CPU = ["model=gpt_tiny", "topology=local_cpu", "search.devices=4", "search.global_batch=8", "precision=fp32",
       "search.microbatch_sizes=[1,2]", "search.segments=[2]", "search.virtual_stages=[2]", "search.simulate=4",
       "search.write_top=3", "search.workers=1"]


def test_the_app_writes_a_training_config_of_its_pick(tmp_path):
    cfg = compose_search(CPU)
    result, files = run_search(cfg, tmp_path)
    for name in ("search.json", "candidates.csv", "best.yaml", "summary.json", "pareto.png"):
        assert (tmp_path / name).is_file(), name
    doc = json.loads((tmp_path / "search.json").read_text())
    assert doc["pick"]["label"] == result.best.candidate.label()
    assert doc["considered"] == result.considered and doc["priced"] == len(result.closed)
    # best.yaml is pipeflow-train --config-dir <out> --config-name best
    register_search_configs()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        best = hydra_compose("best", overrides=[f"hydra.searchpath=[file://{CONF_DIR}]", "logger=none"])
    c = result.best.candidate
    assert best.schedule.name == c.schedule and best.model.name == "gpt_tiny"
    assert (best.pipeline.stages, best.pipeline.data_parallel, best.pipeline.microbatches,
            best.pipeline.microbatch_size) == (c.stages, c.data_parallel, c.microbatches, c.microbatch_size)
    assert best.model.recompute == c.recompute and best.partition.name == c.partition
    assert prepare_training(best).world_size == 4
    # the sweep's candidates: sweeps/search_top.yaml with the output folder on the search path
    with initialize_config_dir(config_dir=str(CONF_DIR.parent / "sweeps"), version_base="1.3"):
        for n, q in enumerate(result.ranked[:3], 1):
            job = hydra_compose("search_top", overrides=[f"hydra.searchpath=[file://{CONF_DIR},file://{tmp_path}]",
                                                         f"+candidate=c{n}", "logger=none"])
            prepare_training(job)
            assert job.schedule.name == q.candidate.schedule
            assert job.pipeline.microbatches == q.candidate.microbatches
            # pipeflow-compare pairs the measured run with the search's prediction
            predicted = read_run(tmp_path / "predicted" / f"c{n}")
            assert predicted.kind == "simulated"
            measured = type(predicted)(path=tmp_path, kind="measured", status="finished",
                                       config=json.loads(json.dumps(_plain(job))), summary=None, rows=[])
            assert sim_key(measured) == sim_key(predicted)


def _plain(cfg):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("override, key", [
    ("cost=calibrated", "cost.name=calibrated"),
    ("search.schedules=[pipedream]", "search.staleness=true"),
    ("search.schedules=[bapp]", "search.schedules"),
    ("search.recompute=[sometimes]", "search.recompute"),
    ("search.memory_limit_gb=-1", "search.memory_limit_gb=-1"),
    ("search.microbatch_sizes=[0]", "search.microbatch_sizes"),
])
def test_bad_input_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        prepare_search(compose_search([*CPU, override]))
    assert key in str(err.value)


def test_local_cpu_needs_the_rank_count():
    with pytest.raises(ConfigError, match="search.devices"):
        prepare_search(compose_search(["model=gpt_tiny", "topology=local_cpu"]))


def test_a_search_none_of_whose_candidates_can_run_names_the_search_key_and_keeps_the_numbers():
    """Issue 76: every candidate refused printed its rules with each digit replaced
    ("e.g. n or n; ... (n, n, n, ...)") and no key the user set."""
    spec, pricer = _pricer(devices=4)
    space = SearchSpace(devices=4, global_batch=3, n_layer=spec.n_layer, schedules=["chimera", "amdp"],
                        microbatch_sizes=(1,))
    with pytest.raises(ValueError) as err:
        search(space, pricer)
    msg = str(err.value)
    assert msg.startswith("search.global_batch=3: none of the "), msg
    assert "pipeline.microbatches=3: schedule 'chimera' needs an even number of microbatches" in msg
    assert "e.g. 4 or 8" in msg and "e.g. n" not in msg and "(n, n" not in msg, msg
    assert msg.endswith("; change search.global_batch, search.microbatch_sizes or search.schedules"), msg
    assert "\n" not in msg


def test_a_search_whose_options_make_no_candidate_names_the_key_that_left_them_out():
    spec, pricer = _pricer(devices=8)
    space = SearchSpace(devices=8, global_batch=7, n_layer=spec.n_layer, schedules=["1f1b"], stages=[1],
                        microbatch_sizes=(2, 4))
    with pytest.raises(ValueError) as err:
        search(space, pricer)
    assert str(err.value) == ("search.global_batch=7: no combination of the search's options adds up (the global "
                              "batch does not divide into data_parallel x microbatch_size: 2 left out); change "
                              "search.global_batch, search.microbatch_sizes or search.schedules")


def test_the_app_refuses_a_budget_nothing_fits(tmp_path):
    with pytest.raises(ConfigError, match="search.memory_limit_gb=0.0001: no candidate fits"):
        run_search(compose_search([*CPU, "search.memory_limit_gb=0.0001"]), tmp_path)
    assert not (tmp_path / "best.yaml").exists()


# ------------------------------------------------------------------------- the host

def _calibration(path: Path, spec, mbs: int, rate: float, bandwidth: float, collective: float) -> str:
    """A calibration file whose times follow t = FLOPs / rate and bytes / bandwidth exactly."""
    from pipeflow.planning.cost import AnalyticCost
    from pipeflow.planning.machine_cost import FORMAT, VERSION

    layers = [1, 1, 1, 1]
    cost = AnalyticCost(spec, 4, microbatch_size=mbs, efficiency=1.0, dtype_bytes=4, layers_per_stage=layers)
    times = {f"{k}|{s}|0": cost.flops(k, s, 0) / rate for s in range(4) for k in "FBIW"}
    times.update({f"S|{s}|0": cost.stage_params(s) * 28 / bandwidth for s in range(4)})
    tied = 4.0 * spec.vocab_size * spec.n_embd
    doc = {"format": FORMAT, "version": VERSION,
           "config": {"model": spec.name, "schedule": "1f1b", "num_stages": 4, "segments": 1, "microbatch_size": mbs,
                      "layers_per_stage": layers, "world_size": 4},
           "times": times, "sync_s": 2e-4 + tied / collective,
           "host": {"cores": 2, "contention": 0.9, "latency": 1e-4, "bandwidth": 3e9, "message_host": 1e-3}}
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_host_is_fitted_from_calibrations(tmp_path):
    from pipeflow.planning.search.host import fitted_host

    spec = TransformerSpec.from_config(compose("simulate", ["model=gpt_tiny"]).model)
    files = [_calibration(tmp_path / f"c{b}.json", spec, b, 3e10, 7e9, 2e8) for b in (1, 8)]
    host = fitted_host(files, spec, efficiency=0.5, dtype_bytes=4)
    assert host["peak_flops"] * 0.5 == pytest.approx(3e10)  # the analytic cost divides by peak x efficiency
    assert host["memory_bandwidth"] == pytest.approx(7e9)
    assert host["collective_bandwidth"] == pytest.approx(2e8)
    assert (host["cores"], host["contention"], host["message_host"]) == (2, 0.9, 1e-3)
    # the search's topology takes them: an all-reduce at the collective rate, not the loopback's
    cfg = compose_search([*CPU, f"search.calibration=[{','.join(files)}]"])
    topo = prepare_search(cfg).pricer.topology
    assert topo.collective_bandwidth == pytest.approx(2e8) and topo.cores == 2
    assert topo.allreduce_time([0, 1], 2e8) == pytest.approx(1.0 + 2 * topo.route(0, 1).latency)
    other = TransformerSpec.from_config(compose("simulate", ["model=gpt_small"]).model)
    with pytest.raises(ValueError, match="search.calibration"):
        fitted_host(files, other, 0.5, 4)


# ------------------------------------------------------------------------- the console

def test_every_step_time_is_said_with_its_own_unit():
    """The console said "231.0s ms a step" and its "step (ms)" column held "231.0s"."""
    from dataclasses import replace

    from pipeflow.planning.search.verdicts import format_search, top_table

    assert [duration(t) for t in (0.0413, 0.000172, 2.5, 59.994, 231.04, 1234.5)] == [
        "41.3 ms", "0.172 ms", "2.50 s", "59.99 s", "231 s", "1,234 s"]
    spec, pricer = _pricer(devices=4)
    result = search(_space(spec, devices=4), pricer, simulate_top=4)

    def column(lines: list[str], head: str) -> list[str]:  # right-aligned: the cells end where the head does
        end = lines[0].index(head) + len(head)
        return [line[:end].rsplit("  ", 1)[-1].strip() for line in lines[1:]]

    lines = top_table(result, 5)
    assert "step time" in lines[0] and "(ms)" not in lines[0]
    assert all(v.endswith(" ms") for v in column(lines, "step time") + column(lines, "closed form")), lines
    scale = 231.0 / result.best.step_time  # the 70B pick: 231 s a step, and slower ones below it
    slow = replace(result, ranked=[replace(q, step_time=q.step_time * scale) for q in result.ranked])
    lines = top_table(slow, 5)
    assert all(v.endswith(" s") and "ms" not in v for v in column(lines, "step time")), lines
    pick = next(line for line in format_search(slow, "gpt_tiny", "cluster", 4, 5).splitlines()
                if line.startswith("pick"))
    assert ": 231 s a step, " in pick and " ms" not in pick, pick


def test_one_process_says_its_progress_between_candidates():
    """search.workers=1: a line after every candidate at search.progress=0, none when null."""
    spec, pricer = _pricer(devices=4)
    lines: list[str] = []
    result = search(_space(spec, devices=4), pricer, simulate_top=4, workers=1, progress_every=0, say=lines.append)
    closed = [line for line in lines if line.startswith("search: closed form ")]
    simulated = [line for line in lines if line.startswith("search: simulated ")]
    assert len(closed) == result.considered and len(simulated) == len(result.simulated)
    assert closed[0].startswith(f"search: closed form 1 of {result.considered:,} candidates (")
    assert simulated[-1].startswith(f"search: simulated {len(result.simulated)} of {len(result.simulated)} "
                                    f"candidates (100%), ")
    assert simulated[-1].endswith(f"; fastest that fits so far {duration(result.best.step_time)} a step: "
                                  f"{result.best.candidate.label()}")
    quiet: list[str] = []
    search(_space(spec, devices=4), pricer, simulate_top=4, workers=1, progress_every=None, say=quiet.append)
    assert quiet == []
