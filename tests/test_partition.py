"""Layer partitioners: uniform against the cost model's split, by_parameters against a
brute force over every contiguous split, and the config front door."""

import itertools
import random

import pytest

from pipeflow.planning import TransformerSpec, embedding_params, head_params, layer_params
from pipeflow.planning.cost import AnalyticCost, uniform_layers
from pipeflow.planning.partitioners import by_parameters, partition_layers, uniform


def _loads(sizes, first_extra, last_extra, layers):
    out, i = [], 0
    for s, n in enumerate(layers):
        out.append(sum(sizes[i : i + n]) + (first_extra if s == 0 else 0) + (last_extra if s == len(layers) - 1 else 0))
        i += n
    return out


def _all_splits(n, stages):
    """Every composition of n into `stages` parts >= 1."""
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def test_uniform_matches_cost_model_split():
    for n_layer in range(1, 20):
        for stages in range(1, n_layer + 1):
            layers = uniform(n_layer, stages)
            assert layers == uniform_layers(n_layer, stages)
            assert sum(layers) == n_layer and min(layers) >= 1 and max(layers) - min(layers) <= 1
            assert layers == sorted(layers, reverse=True)  # the remainder goes to the first stages


def test_uniform_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"pipeline\.stages=5.*1 to 4"):
        uniform(4, 5)
    with pytest.raises(ValueError, match=r"pipeline\.stages=0"):
        uniform(4, 0)


def test_by_parameters_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        sizes = [rng.randint(0, 20) for _ in range(n)]
        first, last = rng.randint(0, 40), rng.randint(0, 40)
        layers = by_parameters(sizes, first, last, stages)
        assert len(layers) == stages and sum(layers) == n and min(layers) >= 1
        best = min(max(_loads(sizes, first, last, split)) for split in _all_splits(n, stages))
        assert max(_loads(sizes, first, last, layers)) == best


def test_by_parameters_equal_layers_no_extras_is_uniform():
    for n_layer in range(1, 14):
        for stages in range(1, n_layer + 1):
            assert by_parameters([7] * n_layer, 0, 0, stages) == uniform(n_layer, stages)


def test_by_parameters_is_deterministic_and_input_order_sensitive():
    sizes = [5, 1, 1, 1, 1, 5]
    a = by_parameters(sizes, 0, 0, 3)
    assert a == by_parameters(list(sizes), 0, 0, 3)
    # heavy ends get stages of their own
    assert a == [1, 4, 1]


def test_by_parameters_unloads_the_end_stages():
    # an embedding worth 3 layers and a head worth 2: the end stages get fewer layers
    layers = by_parameters([10] * 12, 30, 20, 4)
    assert layers[0] < layers[1] and layers[-1] < layers[2]
    # 170 parameters over 4 stages is at least 42.5 a stage, and loads are multiples of 10
    assert max(_loads([10] * 12, 30, 20, layers)) == 50
    assert max(_loads([10] * 12, 30, 20, uniform(12, 4))) == 60


def test_by_parameters_checks_inputs():
    with pytest.raises(ValueError, match=r"pipeline\.stages=4"):
        by_parameters([1, 2, 3], 0, 0, 4)
    with pytest.raises(ValueError, match=r"first_extra=-1"):
        by_parameters([1, 2, 3], -1, 0, 2)


def test_partition_layers_by_name():
    spec = TransformerSpec("gpt_small", n_layer=12, n_head=12, n_embd=768, vocab_size=50257, seq_len=1024)
    assert partition_layers("uniform", spec, 4) == [3, 3, 3, 3]
    layers = partition_layers("parameters", spec, 4)
    assert sum(layers) == 12
    # the largest stage by the cost model's own count is no larger than with the uniform split
    by_param = AnalyticCost(spec, 4, layers_per_stage=layers)
    even = AnalyticCost(spec, 4)
    biggest = max(by_param.stage_params(s) for s in range(4))
    assert biggest < max(even.stage_params(s) for s in range(4))
    assert biggest == max(_loads([layer_params(spec)] * 12, embedding_params(spec), head_params(spec), layers))


def test_partition_layers_unknown_name():
    spec = TransformerSpec("t", n_layer=4, n_head=2, n_embd=8, vocab_size=16, seq_len=8)
    with pytest.raises(ValueError, match=r"^partition\.name=foo: unknown partitioner; allowed values: uniform, parameters, profiled$"):
        partition_layers("foo", spec, 2)
