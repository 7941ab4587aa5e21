"""The profiled partitioner and cost model: the DP against a brute force over every
contiguous split, the memory limit, the JSON file, the profiler on gpt_tiny, and the
config front door."""

import itertools
import random

import pytest

from pipeflow.config import ConfigError, compose, prepare_training, prepare_simulation
from pipeflow.planning import TransformerSpec
from pipeflow.planning.cost_models import build_cost_model
from pipeflow.planning.machine_cost import ProfiledCost
from pipeflow.planning.partitioners import partition_layers
from pipeflow.planning.layer_profile import LayerProfile, ModelProfile, partition_profile, stage_costs

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out


def make_profile(block_times, emb=(1, 0, 0), head=(1, 0, 0), acts=None, params=None, n_embd=8, seq_len=16):
    """A hand-made profile: integer times (so float comparisons are exact), F = B = time / 2."""
    n = len(block_times)
    acts = acts or [10] * n
    params = params or [5] * n
    units = [LayerProfile("embedding", "embedding", emb[0] / 2, emb[0] / 2, emb[1], emb[2])]
    for i, (t, a, p) in enumerate(zip(block_times, acts, params)):
        units.append(LayerProfile(f"block.{i}", "block", t / 2, t / 2, a, p))
    units.append(LayerProfile("head", "head", head[0] / 2, head[0] / 2, head[1], head[2]))
    return ModelProfile("toy", n, n_embd, 64, seq_len, 2, units)


def all_splits(n, stages):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def brute_force(profile, stages, limit):
    """The documented objective: smallest slowest stage, then smallest sum of squared
    stage times, then the lexicographically largest split (more blocks earlier)."""
    best = None
    for layers in all_splits(profile.n_layer, stages):
        times, mem = stage_costs(profile, layers)
        if limit is not None and max(mem) > limit:
            continue
        key = (max(times), sum(t * t for t in times), [-x for x in layers])
        if best is None or key < best[0]:
            best = (key, layers)
    return None if best is None else best[1]


def test_dp_matches_brute_force_on_random_instances():
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        prof = make_profile(
            [rng.randint(1, 9) for _ in range(n)],
            emb=(rng.randint(0, 6), rng.randint(0, 5), rng.randint(0, 40)),
            head=(rng.randint(0, 20), rng.randint(0, 30), rng.randint(0, 40)),
            acts=[rng.randint(0, 20) for _ in range(n)],
            params=[rng.randint(0, 10) for _ in range(n)],
        )
        limit = rng.choice([None, rng.randint(20, 400)])
        expected = brute_force(prof, stages, limit)
        if expected is None:
            with pytest.raises(ValueError, match=r"partition\.memory_limit="):
                partition_profile(prof, stages, limit)
            continue
        got = partition_profile(prof, stages, limit)
        assert got == expected, (n, stages, limit)
        checked += 1
    assert checked > 150  # most instances have a split that fits


def test_heavy_head_moves_blocks_to_earlier_stages():
    prof = make_profile([2] * 8, head=(8, 0, 0))
    # embedding 1, blocks 2, head 8: uniform [4, 4] gives 9 vs 16, [6, 2] 13 vs 12, [7, 1] 15 vs 10
    assert partition_profile(prof, 2) == [6, 2]
    spec = TransformerSpec(name="toy", n_layer=8, n_head=2, n_embd=8, vocab_size=64, seq_len=16)
    assert partition_layers("profiled", spec, 2, {"profile": prof, "memory_limit": None}) == [6, 2]


def test_memory_limit_is_respected_and_reported():
    # per block, stage 0 of 2 keeps 2 microbatches in flight: 2 x 10 + 4 x 5 parameter bytes = 40;
    # the last stage one: 10 + 20 = 30
    prof = make_profile([1, 1, 1, 1, 1, 1], head=(20, 0, 0))
    free = partition_profile(prof, 2)
    assert free == [5, 1]  # the head is slow: everything else goes first
    limit = 130  # stage 0 with 5 blocks needs 200 bytes, with 3 blocks 120; the last with 3 blocks 90
    capped = partition_profile(prof, 2, limit)
    assert max(stage_costs(prof, capped)[1]) <= limit
    assert capped == [3, 3]
    with pytest.raises(ValueError, match=r"partition\.memory_limit=50: .*smallest possible peak stage memory is 120 bytes, 70 bytes"):
        partition_profile(prof, 2, 50)  # the best is [2, 4] or [3, 3]: 120 bytes


def test_profile_round_trips_through_json(tmp_path):
    prof = make_profile([3, 1, 4], emb=(1, 2, 3), head=(5, 9, 2))
    path = prof.save(tmp_path / "p.json")
    back = ModelProfile.load(path)
    assert back == prof
    path.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="pipeflow-profile"):
        ModelProfile.load(path)


@pytest.fixture(scope="module")
def tiny_profile():
    from pipeflow.models.profiler import profile_model

    model = {"name": "gpt_tiny_big_vocab", "family": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 64,
             "n_inner": None, "vocab_size": 8192, "n_positions": 64, "seq_len": 64}
    return profile_model(model, microbatch_size=2, warmup=1, repeats=3)


def test_profiler_measures_every_unit(tiny_profile):
    prof = tiny_profile
    assert [u.name for u in prof.units] == ["embedding", "block.0", "block.1", "head"]
    for u in prof.units:
        assert u.forward_s > 0 and u.backward_s > 0 and u.param_bytes > 0
        assert u.activation_bytes > 0
    # the fp32 logits alone (2 x 64 x 8192 x 4 bytes) are kept for the loss's backward
    assert prof.head.activation_bytes >= 2 * 64 * 8192 * 4
    # an 8192-word head outweighs a 64-wide block
    assert prof.head.time_s > max(b.time_s for b in prof.blocks)
    assert prof.head.param_bytes > prof.blocks[0].param_bytes


def test_profiled_cost_sums_units(tiny_profile, tmp_path):
    path = tiny_profile.save(tmp_path / "profile.json")
    cost = ProfiledCost(2, profile=str(path), layers_per_stage=[1, 1])
    units = tiny_profile.units
    assert cost.compute_time("F", 0, 0, None) == pytest.approx(units[0].forward_s + units[1].forward_s)
    assert cost.compute_time("B", 1, 0, None) == pytest.approx(units[2].backward_s + units[3].backward_s)
    assert cost.activation_bytes(1, 0) == units[2].activation_bytes + units[3].activation_bytes
    assert cost.message_bytes(0, 1, 0) == 2 * 64 * 64 * 4
    assert cost.describe()["layers_per_stage"] == [1, 1]
    with pytest.raises(ValueError, match=r"cost\.profile=null"):
        build_cost_model({"name": "profiled", "profile": None, "layers_per_stage": None}, 2, None, 2)
    with pytest.raises(ValueError, match=r"cost\.layers_per_stage=\[2, 1\]"):
        ProfiledCost(2, profile=str(path), layers_per_stage=[2, 1])


def test_simulate_config_with_profiled_cost(tmp_path):
    prof = make_profile([2, 2, 2, 2], head=(8, 0, 0), n_embd=128, seq_len=128)
    prof.microbatch_size = 1
    path = prof.save(tmp_path / "profile.json")
    cfg = compose("simulate", ["cost=profiled", f"cost.profile={path}", "pipeline.stages=2", "model=gpt_tiny"])
    inputs = prepare_simulation(cfg)
    assert inputs.cost.layers_per_stage == (3, 1)
    bad = compose("simulate", ["cost=profiled", "pipeline.stages=2"])
    with pytest.raises(ConfigError, match=r"cost\.profile"):
        prepare_simulation(bad)


def train_overrides(*extra):
    return ["partition=profiled", "logger=none", "pipeline.stages=2", *extra]


def test_training_config_with_profiled_partition(tmp_path):
    # no profile yet: pipeflow-train profiles before launching, so the config is fine
    inputs = prepare_training(compose("train", train_overrides()))
    assert inputs.world_size == 2
    prof = make_profile([1, 1, 1, 1], head=(10, 0, 0))
    path = prof.save(tmp_path / "profile.json")
    prepare_training(compose("train", train_overrides(f"partition.profile={path}")))
    with pytest.raises(ConfigError, match=r"^partition\.memory_limit=-1: "):
        prepare_training(compose("train", train_overrides("partition.memory_limit=-1")))
    with pytest.raises(ConfigError, match=r"^partition\.memory_limit=10: no split"):
        prepare_training(compose("train", train_overrides(f"partition.profile={path}", "partition.memory_limit=10")))
    with pytest.raises(ConfigError, match=r"^partition\.profile=.*nope\.json: no such file"):
        prepare_training(compose("train", train_overrides(f"partition.profile={tmp_path}/nope.json")))
    wrong = make_profile([1, 1, 1])
    wrong_path = wrong.save(tmp_path / "three.json")
    with pytest.raises(ConfigError, match=r"partition\.profile=.*model\.n_layer=4"):
        prepare_training(compose("train", train_overrides(f"partition.profile={wrong_path}")))
