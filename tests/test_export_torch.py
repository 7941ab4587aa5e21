"""Schedules exported to PyTorch pipelining's CSV are accepted by torch's own runtime.

torch loads each file into a real ``_PipelineScheduleRuntime`` (which validates it and
lowers it with send/recv actions) and its dry-run simulator must run the lowered lists
to completion. No real multi-process group is needed for that: rank 0 joins a "fake"
process group of the right size, which is all construction and loading look at. Two
cases are then run for real, one process per rank over gloo, to check the gradients.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _ComputationType,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from pipeflow.schedules.export import to_torch_csv, torch_csv_rows, write_torch_csv
from pipeflow.schedules.ir import Kind, StageGraph, WeightPolicy, parse_orders
from pipeflow.schedules.registry import build_schedule

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

COMPUTE = {
    _ComputationType.FORWARD,
    _ComputationType.FULL_BACKWARD,
    _ComputationType.BACKWARD_INPUT,
    _ComputationType.BACKWARD_WEIGHT,
    _ComputationType.OVERLAP_F_B,  # DualPipeV's overlapped pairs, one cell each
}
# torch's dry run models compute and point-to-point messages only; the FSDP
# (UNSHARD/RESHARD) and data-parallel (REDUCE_GRAD) actions its lowering also adds
# are outside it.
SIMULATED = COMPUTE | {
    _ComputationType.SEND_F,
    _ComputationType.RECV_F,
    _ComputationType.SEND_B,
    _ComputationType.RECV_B,
}


def _cases():
    for p in (2, 4):
        for m in (1, p, 2 * p + 1):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            yield "zb_h1", p, m, 1
        # whole rounds of p microbatches (Megatron), and torch's flexible rounds (issue 17)
        for m in (p, 2 * p, p - 1, p + 2, 2 * p + 2):
            yield "interleaved_1f1b", p, m, 2
        for m in (p, 2 * p):  # issue 17: a V (device d holds stages d and 2p-1-d), breadth first
            yield "zb_v", p, m, 2
            yield "looped_bfs", p, m, 2
            yield "interleaved_zb", p, m, 2
            yield "zb_h2", p, m, 1
        for m in (2 * p, 3 * p):  # DualPipeV needs two microbatches per stage of the V
            yield "dualpipe_v", p, m, 2
    # issue 17's acceptance sizes for its new schedules
    for p, m in ((4, 16), (8, 16)):
        for name, v in (("zb_h2", 1), ("interleaved_zb", 2), ("zb_v", 2), ("dualpipe_v", 2), ("looped_bfs", 2)):
            yield name, p, m, v


CASES = list(_cases())


def _cell(a) -> str:
    return f"{a.stage}{a.kind}{a.microbatch}"


@pytest.fixture
def fake_group():
    """Join a fake process group as rank 0 of ``world_size``; always torn down."""

    def init(world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_torch_runtime_loads_validates_and_simulates(tmp_path, fake_group, name, p, m, v):
    sched = build_schedule(name, p, m, virtual_stages=v)
    path = tmp_path / "schedule.csv"
    write_torch_csv(sched, path)

    fake_group(sched.num_devices)
    stages = [
        PipelineStage(nn.Linear(4, 4), stage, sched.num_stages, torch.device("cpu"))
        for _pipe, stage in sched.placement.stages_on(0)
    ]
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=lambda out, target: out.sum())
    runtime._load_csv(str(path))  # torch's validation; raises on a malformed schedule

    # torch infers the stage -> rank map from the file; it must be our placement
    assert runtime.stage_index_to_group_rank == {s: sched.placement.device(0, s) for s in range(sched.num_stages)}

    lowered = runtime.pipeline_order_with_comms
    paired = set(sched.overlap_partner()) | set(sched.overlap_partner().values())
    assert sorted(lowered) == list(range(sched.num_devices))
    for rank, order in enumerate(sched.compute_orders()):
        compute = [str(a) for a in lowered[rank] if a.computation_type in COMPUTE]
        assert compute == torch_csv_rows(sched)[rank], f"rank {rank}: torch reordered or lost compute actions"
        assert [c for c in compute if "OVERLAP" not in c] == [_cell(a) for a in order if a not in paired]
    sends = sum(
        a.computation_type in (_ComputationType.SEND_F, _ComputationType.SEND_B) for r in lowered.values() for a in r
    )
    # one activation and one gradient message per microbatch per pipeline edge between
    # two ranks (a V's turn, stages p-1 and p, stays on one rank)
    edges = sum(sched.placement.device(0, s) != sched.placement.device(0, s + 1) for s in range(sched.num_stages - 1))
    assert sends == 2 * m * edges

    # torch's dry run knows no OVERLAP_F_B (its stage index is -1): it gets the pair's halves
    to_simulate = {r: [x for a in acts if a.computation_type in SIMULATED for x in (a.sub_actions or (a,))]
                   for r, acts in lowered.items()}
    expected = {r: sorted(map(str, acts)) for r, acts in to_simulate.items()}
    stage_to_rank = runtime.stage_index_to_group_rank
    timeline = _simulate_comms_compute(to_simulate, lambda s: stage_to_rank[s], sched.num_stages)
    done = {r: sorted(str(a) for a in steps if a is not None) for r, steps in timeline.items()}
    assert done == expected, "torch's dry run did not run every action"


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_csv_round_trips_through_our_parser(name, p, m, v):
    sched = build_schedule(name, p, m, virtual_stages=v)
    text = to_torch_csv(sched)
    rows = list(csv.reader(io.StringIO(text)))
    assert len(rows) == sched.num_devices
    if sched.overlapped:  # (F;B)OVERLAP_F_B cells: schedule=file's reader takes them
        from pipeflow.schedules.from_file import read_schedule_text

        orders, pairs = read_schedule_text(text)
        assert orders == sched.compute_orders() and set(pairs) == set(sched.overlapped)
        return
    assert parse_orders(rows) == sched.compute_orders()


def test_reduce_and_step_are_dropped():
    sched = build_schedule("1f1b", 2, 3)
    assert any(a.kind == Kind.STEP for order in sched.orders for a in order)
    cells = [c for row in csv.reader(io.StringIO(to_torch_csv(sched))) for c in row]
    assert all(re.fullmatch(r"\d+[FBIW]\d+", c) for c in cells), cells
    assert len(cells) == sum(len(order) for order in sched.compute_orders())


def test_two_pipeline_schedule_is_refused(tmp_path):
    sched = build_schedule("chimera", 4, 4)
    assert sched.placement.num_pipes == 2
    path = tmp_path / "chimera.csv"
    with pytest.raises(ValueError, match="2 pipeline replicas"):
        write_torch_csv(sched, path)
    assert not path.exists()


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(num_segments=2), "segments"),
        (dict(policy=WeightPolicy.STASH), "synchronous"),
        (dict(graph=StageGraph(4, ((0, 1), (0, 2), (1, 3), (2, 3)))), "chain"),
    ],
    ids=["segments", "async", "branches"],
)
def test_schedules_torch_cannot_run_are_refused(change, reason):
    sched = dataclasses.replace(build_schedule("1f1b", 4, 4), **change)
    with pytest.raises(ValueError, match=reason):
        to_torch_csv(sched)


SHARDED = [("gpipe", 2, 4, 1, "none", None), ("1f1b", 2, 4, 1, "gradients", None), ("1f1b", 4, 8, 1, "full", "step"),
           ("interleaved_1f1b", 2, 4, 2, "full", "chunk"), ("zb_h1", 2, 4, 1, "full", "microbatch"),
           ("zb_v", 2, 4, 2, "full", "chunk"), ("dualpipe_v", 2, 4, 2, "full", "microbatch")]


@pytest.mark.parametrize("name,p,m,v,shard,gather", SHARDED, ids=[f"{c[0]}-{c[4]}-{c[5]}" for c in SHARDED])
def test_a_data_parallel_schedule_exports_its_replica_with_its_reductions_and_gathers(
        tmp_path, fake_group, name, p, m, v, shard, gather):
    """2 replicas, exported as the first one's ranks in torch's compute_comms format: torch
    loads it as written (validating the stage -> rank map), each of our GATHER, FREE and
    REDUCE is its UNSHARD, RESHARD and REDUCE_GRAD in our place, and its dry run runs the
    compute and the messages to the end (it has no cases for the other three)."""
    from pipeflow.config.assembly import sharded
    from pipeflow.schedules.data_parallel import replicate

    sched = sharded(replicate(build_schedule(name, p, m, virtual_stages=v), 2), shard, gather or "step")
    path = tmp_path / "schedule.csv"
    write_torch_csv(sched, path)
    fake_group(p)
    stages = [PipelineStage(nn.Linear(4, 4), stage, sched.num_stages, torch.device("cpu"))
              for _pipe, stage in sched.placement.stages_on(0)]
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=lambda out, target: out.sum())
    runtime._load_csv(str(path), format="compute_comms")
    assert runtime.stage_index_to_group_rank == {s: sched.placement.device(0, s) for s in range(sched.num_stages)}
    lowered = runtime.pipeline_order_with_comms
    kinds = {Kind.GATHER: "UNSHARD", Kind.FREE: "RESHARD", Kind.REDUCE: "REDUCE_GRAD"}
    for rank in range(p):
        ours = [f"{a.stage}{kinds[a.kind]}" for a in sched.orders[rank] if a.kind in kinds]
        assert [str(a) for a in lowered[rank] if str(a).endswith(tuple(kinds.values()))] == ours
        assert (shard == "full") == any(a.kind == Kind.GATHER for a in sched.orders[rank])
        compute = [str(a) for a in lowered[rank] if a.computation_type in COMPUTE]
        second = {b for _f, b in sched.overlapped}  # (a pair is one OVERLAP_F_B cell)
        assert len(compute) == len([a for a in sched.orders[rank] if a.kind in Kind.COMPUTE and a not in second])
    to_simulate = {r: [x for a in acts if a.computation_type in SIMULATED for x in (a.sub_actions or (a,))]
                   for r, acts in lowered.items()}
    timeline = _simulate_comms_compute(to_simulate, lambda s: runtime.stage_index_to_group_rank[s], sched.num_stages)
    assert {r: sorted(str(a) for a in steps if a is not None) for r, steps in timeline.items()} == \
        {r: sorted(map(str, acts)) for r, acts in to_simulate.items()}


# ------------------------------------------------------------------ torch runs it for real

WIDTH = 8


def _chain(num_stages: int) -> list[nn.Module]:
    """One linear layer per stage, the same weights in every process."""
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH) for _ in range(num_stages)]


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2 * m, WIDTH, generator=g), torch.randn(2 * m, WIDTH, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _rank_main(rank, world, port, csv_path, held, num_stages, m, out):
    """One rank: build this rank's stages, load the CSV into torch's runtime, step once."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layers = _chain(num_stages)
        stages = [PipelineStage(layers[s], s, num_stages, torch.device("cpu")) for s in held[rank]]
        runtime = _PipelineScheduleRuntime(stages, m, loss_fn=_mse)
        runtime._load_csv(csv_path)
        x, y = _batch(m)
        inputs = (x,) if 0 in held[rank] else ()
        target = {"target": y} if num_stages - 1 in held[rank] else {}
        runtime.step(*inputs, **target)
        torch.save({s: layers[s].weight.grad for s in held[rank]}, os.path.join(out, f"grads{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,p,m,v", [("zb_h1", 2, 4, 1), ("interleaved_1f1b", 2, 4, 2)])
def test_torch_executes_the_csv_and_gets_the_unpipelined_gradients(tmp_path, name, p, m, v):
    """One process per rank over gloo on the loopback interface: torch walks our CSV
    with real tensors, and the weight gradients equal those of the same batch run
    through the unsplit model (loss averaged over microbatches, as torch scales it)."""
    sched = build_schedule(name, p, m, virtual_stages=v)
    path = tmp_path / "schedule.csv"
    write_torch_csv(sched, path)
    held = [[s for _pipe, s in sched.placement.stages_on(r)] for r in range(p)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(p, port, str(path), held, sched.num_stages, m, str(tmp_path)), nprocs=p, join=True)

    got = {}
    for r in range(p):
        got.update(torch.load(tmp_path / f"grads{r}.pt"))
    layers = _chain(sched.num_stages)
    x, y = _batch(m)
    loss = sum(_mse(torch.nn.Sequential(*layers)(xm), ym) for xm, ym in zip(x.chunk(m), y.chunk(m))) / m
    loss.backward()
    assert sorted(got) == list(range(sched.num_stages))
    for s, layer in enumerate(layers):
        torch.testing.assert_close(got[s], layer.weight.grad, msg=f"stage {s}")


@pytest.mark.parametrize("p,m", [(4, 3), (4, 6), (4, 10), (2, 3), (8, 12), (4, 8)])
def test_flexible_interleaving_is_torchs_action_for_action(p, m):
    """interleaved_1f1b with m not a multiple of p: torch 2.13's ScheduleInterleaved1F1B
    runs m // p rounds of m // rounds microbatches; pipeflow's orders are its orders."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    theirs = [[str(a) for a in row if a is not None] for row in get_schedule_ops("Interleaved1F1B", p, m, 2)]
    ours = [[_cell(a) for a in order] for order in build_schedule("interleaved_1f1b", p, m, virtual_stages=2)
            .compute_orders()]
    assert ours == theirs
