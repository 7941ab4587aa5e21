"""pipeflow-search's tensor dimension (issue 35): the tensor degrees it tries (inside a
node, where the model's heads and width split), candidates that train as
pipeflow-train runs them, their prices equal to the whole simulation of the run on
the topology's tensor groups, and the report's best candidate of each degree."""

from __future__ import annotations

import pytest

from pipeflow.config import compose, prepare_training
from pipeflow.planning.search import Candidate, SearchSpace, candidates, search
from pipeflow.planning.search.verdicts import format_search, tensor_table
from pipeflow.search import compose_search, prepare_search

from test_search import _pricer, _whole


def test_tensor_degrees_are_searched_inside_a_node_where_the_model_splits():
    """gpt_7b on 2 nodes of 8: 1, 2, 4 and 8 (with sequence parallelism), not 16 (a group
    would span the nodes); every candidate uses every GPU."""
    inputs = prepare_search(compose_search(["model=gpt_7b", "topology=cluster", "topology.nodes=2",
                                            "search.tensor_parallel=[1,2,4,8,16]", "search.global_batch=32",
                                            "search.schedules=[1f1b]"]))
    space = inputs.space
    assert list(space.tensors) == [(1, False), (2, True), (4, True), (8, True)]
    assert [k for k in space.skipped if k.startswith("pipeline.tensor_parallel=16: ")
            and "a tensor-parallel group is 16 devices of one node" in k]  # the run's own refusal
    cands = list(candidates(space))
    assert {c.tensor_parallel for c in cands} == {1, 2, 4, 8}
    for c in cands:
        assert c.devices == 16 and c.global_batch == 32 and c.sequence_parallel == (c.tensor_parallel > 1)
    # llama3_8b's 8 key/value heads take 8 ranks; its 32 heads do not split into 3
    inputs = prepare_search(compose_search(["model=llama3_8b", "search.tensor_parallel=[3,8]"]))
    assert list(inputs.space.tensors) == [(8, True)]
    assert [k for k in inputs.space.skipped if k.startswith("pipeline.tensor_parallel=3: model 'llama3_8b' has 32 "
                                                           "attention heads")]


def test_a_tensor_parallel_candidate_is_a_training_run():
    c = Candidate("zb_h1", 2, 1, 4, 2, tensor_parallel=2, sequence_parallel=True)
    assert c.label() == "zb_h1 p2xtp2-sp m4x2"
    cfg = compose("train", ["model=gpt_tiny", "logger=none", *c.overrides()])
    inputs = prepare_training(cfg)
    assert inputs.world_size == c.devices == 4
    assert (inputs.plan.tensor_parallel, inputs.plan.sequence_parallel) == (2, True)


@pytest.mark.parametrize("name, v, s", [("1f1b", 1, 1), ("zb_h1", 1, 1), ("interleaved_1f1b", 2, 1),
                                        ("seq1f1b", 1, 2)])
def test_a_tensor_parallel_candidate_prices_as_the_whole_simulation(name, v, s):
    """2 stages x 2 replicas of tensor groups of 2 (8 GPUs of a node): the closed form's
    peak and the simulated phase's step time and peak are those of the whole run
    simulated and walked on the topology seen as tensor groups (pipeflow.topology.tensor)."""
    _, pricer = _pricer(model="gpt_small", devices=8)
    for sp in (False, True):
        c = Candidate(name, 2, 2, 8, 2, v, s, "none", "parameters", tensor_parallel=2, sequence_parallel=sp)
        closed, simulated = pricer.closed_form(c), pricer.simulated(c)
        assert not isinstance(closed, str), closed
        mine = pricer.for_tensor(2)
        assert mine.topology.num_devices == 4 and mine.topology.tensor_parallel == 2
        step, _, peak, _ = _whole(mine, c)
        assert closed.peak_memory == pytest.approx(peak, rel=1e-9) == simulated.peak_memory
        assert simulated.step_time == pytest.approx(step, rel=1e-9), c.label()
        # a tensor rank holds about half the stage: less than the same pipeline unsplit on 4 GPUs
        whole = pricer.closed_form(Candidate(name, 2, 2, 8, 2, v, s, "none", "parameters"))
        assert closed.peak_memory < whole.peak_memory


def test_the_report_shows_the_fastest_of_each_tensor_degree():
    """A search over 1, 2 and 4 on a node of 8: one row per degree, each the fastest
    simulated candidate of that degree; the pick is one of them."""
    spec, pricer = _pricer(model="gpt_small", devices=8)
    space = SearchSpace(devices=8, global_batch=16, n_layer=spec.n_layer, schedules=["1f1b", "zb_h1"],
                        microbatch_sizes=(1, 2), recompute=("none",), partitions=("uniform",), shards=("none",),
                        tensors=((1, False), (2, True), (4, True)))
    result = search(space, pricer, simulate_top=4)
    rows = tensor_table(result)[1:]
    assert [r.split()[0] for r in rows] == ["1", "2", "4"]
    for t in (1, 2, 4):
        fastest = min((q for q in result.ranked if q.candidate.tensor_parallel == t), key=lambda q: q.step_time)
        assert any(fastest.candidate.label() in r for r in rows)
    assert "the fastest of each tensor-parallel degree" in format_search(result, "gpt_small", "cluster", 8, 5)
