"""cost=calibrated with tensor parallelism (pipeline.tensor_parallel > 1), without ranks.

- A calibration file records the T and the sequence parallelism it was measured with;
  the simulator takes it for the same configuration (its times hold the tensor groups'
  collectives, nothing is added, the topology is the run's TensorTopology) and refuses
  another T or sequence parallelism, naming the key. A file from before the key is T = 1.
- The calibration's fits: a device's action time is the median over its tensor ranks,
  then over its replicas; the cores the TensorTopology sees follow from the devices'
  measured CPU use and slowdown; at T = 1 nothing changes.
- The fidelity benchmark's tensor case (2 stages x 2 tensor ranks) has the model and
  global batch of the other 4-rank cases and is left out at 2 ranks.
- (slow) A real calibration on 4 ranks: device by device, the file records T.
"""

from __future__ import annotations

import json

import pytest

from pipeflow.config import ConfigError, compose, prepare_simulation
from pipeflow.runtime.calibrate_fit import _contention, _device_times, _tensor_cores
from pipeflow.sim import simulate
from pipeflow.topology.tensor import TensorTopology

F, B = 0.030, 0.036


def calibration(tensor: int = 2, sequence: bool = True, legacy: bool = False) -> dict:
    config = {"model": "gpt_tiny", "schedule": "1f1b", "num_stages": 2, "segments": 1, "microbatch_size": 4,
              "layers_per_stage": [4, 4], "world_size": 2 * tensor, "threads_per_rank": 1}
    if not legacy:
        config.update(tensor_parallel=tensor, sequence_parallel=sequence)
    times = {}
    for s in (0, 1):
        times.update({f"F|{s}|0": F, f"B|{s}|0": B, f"I|{s}|0": B / 2, f"W|{s}|0": B / 2, f"S|{s}|0": 0.002})
    return {
        "format": "pipeflow-calibration", "version": 1, "config": config, "times": times,
        "activation_bytes": {"0|0": 1e6, "1|0": 1e6}, "param_bytes": {"0": 1e6, "1": 1e6},
        "message_bytes": {"0|1|0": 131072.0 / (tensor if sequence else 1)}, "sync_s": 0.01,
        "host": {"cores": 4, "contention": 0.75, "latency": 5e-5, "bandwidth": 3e9, "message_host": 3e-4},
    }


def simulate_cfg(path, tensor: int = 2, sequence: bool = True):
    over = ["model=gpt_tiny", "model.n_layer=8", "pipeline.stages=2", "pipeline.microbatches=8",
            "pipeline.microbatch_size=4", "schedule=1f1b", "cost=calibrated", f"cost.calibration={path}",
            "topology=local_cpu"]
    if tensor > 1:
        over += [f"pipeline.tensor_parallel={tensor}", f"pipeline.sequence_parallel={str(sequence).lower()}"]
    return compose("simulate", over)


def write(tmp_path, data: dict, name: str = "cal.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_tensor_calibration_prices_the_run_on_its_tensor_topology(tmp_path):
    path = write(tmp_path, calibration())
    inputs = prepare_simulation(simulate_cfg(path))
    assert isinstance(inputs.topology, TensorTopology) and inputs.topology.num_devices == 2
    # the file's cores are local_cpu's: the tensor topology sees cores // T of them
    assert inputs.topology.cores == 2 and inputs.topology.contention == pytest.approx(0.75)
    cost = inputs.cost
    assert cost.tensor_parallel == 2 and cost.sequence_parallel
    # the measured times as they are: the collectives are inside them, nothing is added
    dev = inputs.topology.devices[0]
    assert cost.compute_time("F", 0, 0, dev) == F and cost.compute_time("B", 1, 0, dev) == B
    res = simulate(inputs.schedule, cost, inputs.topology, record=False)
    assert res.makespan >= 8 * (F + B)


def test_a_calibration_of_another_tensor_split_is_refused(tmp_path):
    tp2 = write(tmp_path, calibration(), "tp2.json")
    with pytest.raises(ConfigError, match=r"pipeline.tensor_parallel=1: cost.calibration=.*tensor_parallel=2"):
        prepare_simulation(simulate_cfg(tp2, tensor=1))
    with pytest.raises(ConfigError, match=r"pipeline.sequence_parallel=false: .*sequence_parallel=true"):
        prepare_simulation(simulate_cfg(tp2, sequence=False))
    # a file from before the key was recorded: measured on one rank per device
    legacy = write(tmp_path, calibration(tensor=1, sequence=False, legacy=True), "legacy.json")
    assert prepare_simulation(simulate_cfg(legacy, tensor=1)).cost.tensor_parallel == 1
    with pytest.raises(ConfigError, match=r"pipeline.tensor_parallel=2: cost.calibration=.*tensor_parallel=1"):
        prepare_simulation(simulate_cfg(legacy))


def test_other_measured_models_still_refuse_tensor_parallelism():
    from pipeflow.planning.cost_models import build_cost_model

    with pytest.raises(ValueError, match="cost model 'unit' has no shape.*cost=calibrated"):
        build_cost_model({"name": "unit"}, 2, None, 4, tensor_parallel=2)


def test_a_devices_time_is_its_tensor_ranks_median_then_its_replicas():
    ranks = [{"alone": {"F|0|0": v}} for v in (1.0, 3.0, 10.0, 12.0)]
    # T = 2: devices (1, 3) and (10, 12) -> 2 and 11 -> 6.5; T = 1: the four ranks' median
    assert _device_times(ranks, 2) == {"F|0|0": 6.5}
    assert _device_times(ranks, 1) == {"F|0|0": 6.5}
    assert _device_times([{"alone": {"F|0|0": v}} for v in (1.0, 2.0, 9.0)], 1) == {"F|0|0": 2.0}


def test_tensor_devices_share_the_cores_they_keep_busy():
    # 2 devices of 2 ranks on 2 cores, each rank busy 70% alone (1.4 cores a device),
    # slowed 1.4x together: the host runs both at once (2), contention fits the rest
    assert _tensor_cores(1.4, 2, 2, 2, 0.7) == 2
    assert _contention(1.4, 2, 2) == pytest.approx(1 / 1.4)
    # slowed 2x or more together: one device at a time (cores // T)
    assert _tensor_cores(2.1, 2, 2, 2, 0.7) == 1
    # ranks busy all the time: T cores a device, never more devices than cores // T
    assert _tensor_cores(1.2, 2, 2, 2, 1.0) == 1
    # a host with cores for every device's ranks: cores // T
    assert _tensor_cores(1.1, 2, 8, 2, 1.0) == 4


def test_the_fidelity_benchmark_runs_the_tensor_case_on_4_ranks_only():
    from benchmarks import bench_fidelity as bench
    from pipeflow.config import prepare_training

    assert bench.MIN_RANKS["1f1b_tp2"] == 4 and bench.ranks_per_device("1f1b_tp2") == 2
    over = [*bench.base(4, 2, bench.ranks_per_device("1f1b_tp2")), *bench.CASES["1f1b_tp2"],
            *bench.sized("1f1b_tp2", 4)]
    tp = prepare_training(compose("train", over)).plan
    plain = prepare_training(compose("train", [*bench.base(4, 2), *bench.CASES["1f1b"], *bench.sized("1f1b", 4)])).plan
    # 2 stages x 2 tensor ranks: 4 ranks, the model and global batch of the other 4-rank cases
    assert tp.world_size == plain.world_size == 4 and tp.tensor_parallel == 2 and tp.sequence_parallel
    assert sum(tp.layers_per_stage) == sum(plain.layers_per_stage) == 8
    assert tp.schedule.num_microbatches == plain.schedule.num_microbatches
    # the 2-rank run leaves it out
    assert bench.results((2,), repeats=0, names=["1f1b_tp2"])["ranks"][2]["rows"] == {}


@pytest.mark.slow  # starts 4 ranks
def test_a_tensor_parallel_configuration_calibrates_device_by_device(tmp_path):
    import pipeline_runs
    from pipeflow.calibrate import calibrate

    tiny = [o for o in pipeline_runs.GPT_SMALL if not o.startswith("trainer.timeline_step")] + ["model.n_layer=4"]
    over = [*tiny, "schedule=1f1b", "pipeline.stages=2", "pipeline.tensor_parallel=2",
            "pipeline.sequence_parallel=true"]
    path = tmp_path / "tp.json"
    cal = calibrate(compose("train", over), path)
    assert cal["config"]["tensor_parallel"] == 2 and cal["config"]["sequence_parallel"] is True
    assert cal["config"]["world_size"] == 4 and cal["config"]["num_stages"] == 2
    for stage in (0, 1):
        assert cal["times"][f"F|{stage}|0"] > 0 and cal["times"][f"B|{stage}|0"] > 0
    # a rank's share of the message: its 1/T of the tokens (sequence parallel), fp32
    assert cal["message_bytes"] == {"0|1|0": 2 * 64 * 64 * 4.0 / 2}
    host = cal["host"]
    assert len(host["cpu_per_rank"]) == 4 and host["cores"] % 2 == 0 and len(host["link_points"]) == 3
    sim = ["model.n_layer=4", "model.n_embd=64", "model.n_head=4", "model.seq_len=64", "pipeline.stages=2",
           "pipeline.microbatches=4", "pipeline.microbatch_size=2", "schedule=1f1b", "cost=calibrated",
           f"cost.calibration={path}", "pipeline.tensor_parallel=2", "pipeline.sequence_parallel=true"]
    inputs = prepare_simulation(compose("simulate", sim))
    assert isinstance(inputs.topology, TensorTopology) and inputs.topology.cores == host["cores"] // 2
    assert simulate(inputs.schedule, inputs.cost, inputs.topology, record=False).makespan > 0
