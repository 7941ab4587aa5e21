"""What one rank holds, instantiated from the run plan (:class:`pipeflow.formats.runplan.RunPlan`):
its stages' modules and optimizers and the executors that run the plan's schedules.
Nothing is decided here: the plan says what runs, and its settings how.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device_paths import cuda_path
from ..formats.runplan import RunPlan
from ..schedules.ir import Schedule, WeightPolicy
from .async_executor import AsyncExecutor
from .executor import Executor, Groups, StageState
from .mesh import RankMesh, build_mesh
from .optimizer import make_optimizer
from .mixed_precision import Precision
from .sharded import ShardedAdamW


@dataclass
class RankSetup:
    """What one rank holds: its stages (modules and optimizers) and the executor that runs them."""

    schedule: Schedule
    layers_per_stage: list[int]
    adapter: object  # GPTAdapter, BertAdapter, HFCausalAdapter or CBMAdapter: see pipeflow.runtime.adapters
    stages: dict[tuple[int, int], StageState]
    executor: Executor
    # asynchronous schedules: evaluation runs a forward-only 1F1B over pipe 0's replicas,
    # and a chunk of L steps runs the schedule generated for L windows
    eval_executor: Executor | None = None
    chunk_executors: dict | None = None
    make_chunk: object = None
    device: torch.device = torch.device("cpu")  # where the stages compute

    @property
    def is_async(self) -> bool:
        return self.schedule.policy != WeightPolicy.SYNC

    def chunk_executor(self, windows: int) -> "AsyncExecutor":
        if windows not in self.chunk_executors:
            self.chunk_executors[windows] = self.make_chunk(windows)
        return self.chunk_executors[windows]

    @property
    def steps_per_chunk(self) -> int:
        """The most steps one chunk runs without a flush: a synchronous step is a chunk of one."""
        return self.schedule.windows if self.is_async else 1

    @property
    def evaluator(self) -> Executor:
        return self.eval_executor or self.executor

    def fresh_executor(self, windows: int) -> Executor:
        """The executor of a chunk of ``windows`` steps without a flush (a synchronous
        step: the one executor), its step's meters reset."""
        ex = self.chunk_executor(windows) if self.is_async else self.executor
        ex.meter.reset_step()
        ex.sent_bytes = 0
        return ex


def build_rank(plan: RunPlan, rank: int, device: torch.device, on_grads=None) -> RankSetup:
    """Instantiate this rank's share of the job the run plan describes: its stages'
    modules and optimizers (``plan.optim``) and the executors that run the plan's
    schedules, each lowered once for the job (:class:`~pipeflow.formats.runplan.Lowered`).
    Needs the process group (it creates groups). Nothing is decided here."""
    precision = Precision(plan.precision, device.type, plan.runtime.loss_scale)
    # NCCL ignores tags (and CPU ranks match in order too where they take CUDA's message path)
    p2p = "ordered" if cuda_path("staging", device) else plan.runtime.p2p
    schedule, layers = plan.schedule, plan.layers_per_stage
    adapter = plan.adapter.build(device)
    # the device mesh: with tensor parallelism this rank is tensor rank t of its device,
    # which it runs the schedule of (pipeflow.runtime.mesh)
    mesh, adapter.tensor = _mesh(plan, rank, device)
    rank = mesh.device
    groups = Groups(schedule, plan.tied_stages, mesh if mesh.tensor > 1 else None)
    stages = {(pipe, stage): _stage(plan, adapter, groups, pipe, stage, rank)
              for pipe, stage in schedule.placement.stages_on(rank)}
    clip = plan.optim.grad_clip
    common = dict(grad_clip=clip, precision=precision, p2p=p2p)
    if schedule.policy == WeightPolicy.SYNC:
        executor = Executor(plan.lowered, rank, stages, adapter, groups, on_grads=on_grads, mesh=mesh, **common)
        return RankSetup(schedule, layers, adapter, stages, executor, device=device)
    # runtime.dump_grads: the first update's gradients, kept (a copy) for the dump only
    dump = plan.runtime.dump_grads

    def make_chunk(windows: int) -> AsyncExecutor:
        return AsyncExecutor(plan.chunk(windows), rank, stages, adapter, groups, keep_first_grads=dump, **common)

    executor = make_chunk(schedule.windows)
    # evaluation after a flush: every mirror replica holds the same weights, so pipe 0's
    # replicas run the plan's forward-only 1F1B
    eval_stages = {(0, s): st for (pipe, s), st in stages.items() if pipe == 0}
    eval_executor = Executor(plan.eval_lowered, rank, eval_stages, adapter, groups, grad_clip=None,
                             precision=precision, p2p=p2p)
    return RankSetup(schedule, layers, adapter, stages, executor, eval_executor,
                     {schedule.windows: executor}, make_chunk, device)


def _stage(plan: RunPlan, adapter, groups: Groups, pipe: int, stage: int, rank: int) -> StageState:
    """One stage of this rank: its module and its optimizer (owner-based sharding: a
    replicated stage's optimizer state on its owner alone, the other replicas keeping
    state for their tied copies only; ZeRO-1/2/3: this replica's slice)."""
    schedule, optim = plan.schedule, plan.optim
    module = adapter.build_stage(stage)
    if plan.compile:  # compile=true: each block compiled on its own (config.groups.compile)
        from ..models.regional import compile_blocks

        # (the zero-bubble split: each weight product eager, its W deferred)
        compile_blocks(module, eager_products=schedule.uses_split_backward())
    graph = schedule.graph  # sources read the batch, sinks compute the loss
    st = StageState(pipe, stage, module, first=not graph.preds[stage], last=not graph.succs[stage])
    st.params = [p for p in module.parameters() if p.requires_grad]
    st.tied = module.tied_parameters() if hasattr(module, "tied_parameters") else []
    replicated = len({d for _, d in schedule.placement.replicas(stage)}) > 1
    owners = plan.lowered.owners
    if owners and replicated and owners[stage] != rank:
        st.optimizer = make_optimizer(module, optim, params=list(st.tied)) if st.tied else None
    elif schedule.shard != "none" and replicated:
        st.optimizer = ShardedAdamW(module, optim, st.params, st.tied, groups.replica_group[stage],
                                    scatter=schedule.shard == "gradients", full=schedule.shard == "full")
    else:
        st.optimizer = make_optimizer(module, optim)
    return st


def _mesh(plan: RunPlan, rank: int, device: torch.device):
    """This rank's place in the device mesh and its tensor group (None without tensor parallelism)."""
    if plan.tensor_parallel == 1:
        return RankMesh(1, rank, 0), None
    return build_mesh(rank, plan.schedule.num_devices, plan.tensor_parallel, plan.sequence_parallel,
                      plan.spec.n_head, plan.spec.n_kv_head)
