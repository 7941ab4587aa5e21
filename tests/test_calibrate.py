"""Calibration (pipeflow.runtime.calibration_run) on real CPU ranks, and cost=calibrated.

What is checked is the structure a real calibration must have, not how fast anything
was: every action of every stage the schedule runs has a time, the message and
parameter bytes are those of the model, the saved activations are counted, the host
model is within its bounds, and a simulation with ``cost=calibrated`` takes the file's
times and host. Segmented and branched configurations calibrate through the same code.
"""

from __future__ import annotations

import json

import pytest

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation
from pipeflow.calibrate import calibrate
from pipeflow.sim import simulate

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

TINY = [o for o in pipeline_runs.GPT_SMALL if not o.startswith("trainer.timeline_step")] + ["model.n_layer=4"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calibration.json"
    calibrate(compose("train", [*TINY, "schedule=1f1b", "pipeline.stages=2"]), path)
    return path, json.loads(path.read_text())


def test_calibration_has_every_action_of_every_stage(chain):
    _, cal = chain
    assert cal["config"]["num_stages"] == 2 and cal["config"]["world_size"] == 2
    for stage in (0, 1):
        for kind in "FBIWS":
            assert cal["times"][f"{kind}|{stage}|0"] >= 0.0
        assert cal["times"][f"F|{stage}|0"] > 0.0 and cal["times"][f"B|{stage}|0"] > 0.0
        assert cal["activation_bytes"][f"{stage}|0"] > 0  # autograd kept something for the backward
    # stage 0 is fed token ids: no input gradient to compute, its I is (almost) nothing
    # and its W is the whole backward; the last stage's I does the activation chain
    assert cal["times"]["I|0|0"] < cal["times"]["I|1|0"]
    # one hidden state per message: microbatch 2 x seq 64 x n_embd 64 x fp32
    assert cal["message_bytes"] == {"0|1|0": 2 * 64 * 64 * 4.0}
    assert set(cal["param_bytes"]) == {"0", "1"} and all(v > 0 for v in cal["param_bytes"].values())
    host = cal["host"]
    assert host["cores"] >= 1 and 0 < host["contention"] <= 1
    assert host["latency"] >= 0 and host["bandwidth"] > 0 and len(host["link_points"]) == 3
    assert host["message_host"] > 0  # posting a gloo message takes the rank some time
    assert cal["sync_s"] > 0
    # a gloo all-reduce over both ranks at 1 and 8 MiB, its rate in the ring's terms
    (b1, t1), (b2, t2) = host["collective_points"]
    assert (b1, b2) == (4.0 * 2**18, 4.0 * 2**21) and 0 < t1 < t2
    assert host["collective_bandwidth"] == pytest.approx(0.5 * (b2 - b1) / (t2 - t1))


def test_calibrated_simulation_uses_the_file(chain):
    path, cal = chain
    cfg = compose("simulate", ["model.n_layer=4", "model.n_embd=64", "model.n_head=4", "model.seq_len=64",
                               "pipeline.stages=2", "pipeline.microbatches=4", "pipeline.microbatch_size=2",
                               "schedule=gpipe", "cost=calibrated", f"cost.calibration={path}"])
    inputs = prepare_simulation(cfg)
    assert inputs.topology.cores == cal["host"]["cores"]
    assert inputs.topology.contention == pytest.approx(cal["host"]["contention"])
    assert inputs.topology.message_host == pytest.approx(cal["host"]["message_host"])
    assert inputs.topology.collective_bandwidth == pytest.approx(cal["host"]["collective_bandwidth"])
    res = simulate(inputs.schedule, inputs.cost, inputs.topology)
    # GPipe: every F and B is priced by the file; each device's STEP adds the step's synchronisation
    assert inputs.cost.step_sync == cal["sync_s"]
    for (start, end), a in zip(zip(res.start, res.end), res.actions):
        if a.kind == "S":
            assert end - start >= cal["times"][f"S|{a.stage}|0"] + cal["sync_s"] - 1e-12
    work = sum(cal["times"][f"{k}|{s}|0"] for k in "FB" for s in (0, 1)) * 4
    assert res.makespan > work / 2  # two devices cannot do the work in less than half of it


def test_calibration_of_another_layout_is_refused(chain):
    path, _ = chain
    cfg = compose("simulate", ["model.n_layer=4", "pipeline.stages=4", "schedule=1f1b", "cost=calibrated",
                               f"cost.calibration={path}"])
    with pytest.raises(ConfigError, match="cost.*it measured 2 stages"):
        prepare_simulation(cfg)
    cfg = compose("simulate", ["schedule=1f1b", "cost=calibrated", "cost.calibration=/nonexistent.json"])
    with pytest.raises(ConfigError, match="no such file"):
        prepare_simulation(cfg)


def test_a_calibration_prices_only_runs_that_compile_as_it_did(chain):
    """An eager calibration (compile: none) prices compile=false alone: compile=true is
    refused, naming what the file's blocks ran as."""
    path, cal = chain
    assert cal["config"]["compile"] == "none"
    over = ["model.n_layer=4", "pipeline.stages=2", "schedule=1f1b", "cost=calibrated", f"cost.calibration={path}"]
    prepare_simulation(compose("simulate", over))
    with pytest.raises(ConfigError, match="compile=true: cost.calibration=.* timed blocks run as 'none' and this "
                                          "1f1b run's would run as 'blocks'"):
        prepare_simulation(compose("simulate", [*over, "compile=true"]))


def test_segments_and_branches_calibrate(tmp_path):
    seg = calibrate(compose("train", [*TINY, "schedule=seq1f1b", "pipeline.stages=2", "pipeline.segments=2"]),
                    tmp_path / "seg.json")
    for stage in (0, 1):
        for s in (0, 1):
            assert seg["times"][f"F|{stage}|{s}"] > 0 and seg["times"][f"B|{stage}|{s}"] > 0
    assert not any(k.startswith(("I|", "W|")) for k in seg["times"])  # segments run full backwards
    cbm = calibrate(compose("train", ["model=cbm_tiny", "data=image_text", "pipeline.microbatches=4",
                                      "pipeline.microbatch_size=2", "schedule=bapp", "pipeline.stages=2",
                                      "logger=none"]), tmp_path / "cbm.json")
    stages = cbm["config"]["num_stages"]
    assert stages > 2  # the branched stage graph: two chains and a head
    assert all(f"F|{s}|0" in cbm["times"] for s in range(stages))
