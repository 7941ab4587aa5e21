"""schedule=file (issue 17): a schedule read from torch's CSV (with or without
communication) or from pipeflow's own notation, its placement (V shapes included)
inferred, validated, simulated and trained like a generated one."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import pipeline_runs
from pipeflow.config import ConfigError, compose, prepare_simulation, prepare_training
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.export import to_torch_csv
from pipeflow.schedules.from_file import read_orders, schedule_from_orders
from pipeflow.schedules.ir import Kind
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import ScheduleError, validate
from pipeflow.sim.engine import simulate

slow = pytest.mark.slow  # starts ranks: make test-fast leaves these out


def torch_orders(name: str, p: int, m: int, v: int = 2, comms: bool = False) -> list[list[str]]:
    """torch 2.13's own orders for one of its schedules, as the cells its CSV holds."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(name, p, m, v, with_comms=comms)
    return [[str(a) if a is not None else "" for a in row] for row in ops]


def write_csv(path: Path, rows: list[list[str]]) -> Path:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def compute(schedule) -> list[list[tuple]]:
    return [[(a.kind, a.stage, a.microbatch, a.segment) for a in order if a.kind in Kind.COMPUTE]
            for order in schedule.orders]


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_torch_csv_and_pipeflows_notation_read_back_what_was_written(name, v):
    sched = build_schedule(name, 4, 8, v)
    for text in (to_torch_csv(sched), sched.format()):
        back = schedule_from_orders(read_orders(text))
        validate(back)
        assert compute(back) == compute(sched)
        assert back.placement == sched.placement and back.num_microbatches == 8


def test_segments_and_the_closing_come_back_from_pipeflows_notation():
    sched = build_schedule("seq1f1b", 2, 4, segments=2)
    back = schedule_from_orders(read_orders(sched.format()))
    assert back.num_segments == 2 and compute(back) == compute(sched)
    assert [a for a in back.orders[0] if not a.is_compute] == [a for a in sched.orders[0] if not a.is_compute]


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_a_v_shape_is_read_from_torchs_csv_with_communication(name):
    """torch's lowered CSV (SEND/RECV, UNSHARD/RESHARD cells; DualPipeV's OVERLAP_F_B
    cells read as their forward, then their backward): device d holds stages d and 2p-1-d,
    and the compute is the compute-only file's."""
    p = 4
    plain = schedule_from_orders(read_orders("\n".join(",".join(r) for r in torch_orders(name, p, 8))))
    lowered = schedule_from_orders(read_orders("\n".join(",".join(r) for r in torch_orders(name, p, 8, comms=True))))
    validate(lowered)
    assert lowered.placement.table[0] == (0, 1, 2, 3, 3, 2, 1, 0)
    assert compute(lowered) == compute(plain) and lowered.meta["virtual_stages"] == 2
    counted = {k: sum(a.kind == k for o in lowered.orders for a in o) for k in "FBIW"}
    assert counted["F"] == 8 * 2 * p and counted["B"] + counted["I"] == 8 * 2 * p and counted["W"] == counted["I"]


def test_bad_files_are_refused_with_a_sentence(tmp_path):
    with pytest.raises(ScheduleConfigError, match=r"runs stage 1 on devices \[0, 1\]; a stage lives on one device"):
        schedule_from_orders(read_orders("0F0,1F0,1B0,0B0\n1F1,1B1"))
    with pytest.raises(ScheduleConfigError, match=r"never runs stage\(s\) \[1\]"):
        schedule_from_orders(read_orders("0F0,0B0\n2F0,2B0"))
    with pytest.raises(ScheduleConfigError, match=r"device 1, cell 2: cannot parse action '1X0'"):
        read_orders("0F0,0B0\n1F0,1X0")
    # a backward before the forward it needs: the validator's own sentence
    with pytest.raises(ScheduleError):
        validate(schedule_from_orders(read_orders("0F0,0B0\n1B0,1F0")))
    path = write_csv(tmp_path / "s.csv", [["0F0", "0B0"], ["1F0", "1B0"]])
    with pytest.raises(ConfigError, match=rf"^pipeline\.microbatches=4: schedule\.path={path} has 1 microbatches; "
                                          r"set pipeline\.microbatches=1"):
        prepare_simulation(compose("simulate", ["schedule=file", f"schedule.path={path}", "pipeline.stages=2",
                                                "pipeline.microbatches=4"]))
    with pytest.raises(ConfigError, match=r"schedule\.path=null: schedule 'file' needs a file"):
        prepare_simulation(compose("simulate", ["schedule=file", "pipeline.stages=2"]))


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble", "LoopedBFS"])
def test_torchs_schedules_simulate_from_their_files(name, tmp_path):
    path = write_csv(tmp_path / f"{name}.csv", torch_orders(name, 4, 8))
    inputs = prepare_simulation(compose("simulate", ["schedule=file", f"schedule.path={path}", "pipeline.stages=4",
                                                     "pipeline.microbatches=8", "pipeline.virtual_stages=2",
                                                     "model=gpt_small", "cost=unit"]))
    res = simulate(inputs.schedule, inputs.cost, inputs.topology)
    assert inputs.schedule.name == "file" and res.makespan > 0 and 0 <= res.bubble_ratio < 0.5


# ------------------------------------------------------------------------ on ranks

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null", "trainer.steps=5", "runtime.dump_grads=true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return pipeline_runs.train(tmp_path_factory.mktemp("ref"), [*SMALL, "pipeline.stages=1"],
                               tied=pipeline_runs.GPT_TIED)


@slow
@pytest.mark.parametrize("name,p", [("ZBVZeroBubble", 2), ("DualPipeV", 2), ("ZBVZeroBubble", 4)])
def test_torchs_own_v_schedules_train_from_their_csv(name, p, reference, tmp_path):
    """torch's ZBV and DualPipeV, written to CSV by torch, trained by pipeflow's runtime:
    the single-device gradients and losses."""
    path = write_csv(tmp_path / "s.csv", torch_orders(name, p, 4))
    run = pipeline_runs.train(tmp_path / "run", [*SMALL, "schedule=file", f"schedule.path={path}",
                                                 f"pipeline.stages={p}", "pipeline.virtual_stages=2"],
                              tied=pipeline_runs.GPT_TIED)
    assert run["schedule"].placement.table[0][p - 1] == run["schedule"].placement.table[0][p]  # the V's turn
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)


def test_a_train_config_reads_the_file_before_any_rank_starts(tmp_path):
    path = write_csv(tmp_path / "s.csv", torch_orders("ZBVZeroBubble", 2, 4))
    inputs = prepare_training(compose("train", ["schedule=file", f"schedule.path={path}", "pipeline.stages=2",
                                                "pipeline.virtual_stages=2", "logger=none"]))
    assert inputs.world_size == 2 and inputs.schedule.num_stages == 4
