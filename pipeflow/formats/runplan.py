"""The run plan: every fact of a training job, decided once from the composed config
(:func:`pipeflow.config.prepare_training`) and handed by the launcher to every rank
(under torchrun each process builds it the same way), which only instantiates modules,
optimizers and executors from it and reads its typed settings. A rank never reads the
config.

Plain and picklable:

- what runs: the validated schedule (and an asynchronous run's chunk and evaluation
  schedules), each lowered once for every device (:class:`Lowered`: the actions with
  the sends and receives the lowering pass derives, paired in each sender's order too,
  the tied weight's update plan, the stages' optimizer owners), the layers per stage (a
  profiled partition's too), the model's shape (the stages are built from it), segment
  lengths, precision, attention and recomputation, the tensor degree, the topology, and
  the model family's runtime adapter by import path;
- how to train: the ``optim``, ``trainer``, ``runtime`` and ``logger`` settings
  (:mod:`pipeflow.formats.settings`), the data set's arguments, the seed, the
  checkpoint to resume from;
- what the run records: ``record``, the resolved config as ``config.json`` and the W&B
  run keep it, and the summary's ``run_key`` and a checkpoint's records made of it once.
  Nothing is decided from the record.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from pipeflow.schedules.ir import Schedule, WeightPolicy
from pipeflow.schedules.lowering import check_pair_order, lower, order_pairs
from pipeflow.schedules.versions import tied_update_plan
from pipeflow.schedules.zero import zero_owners

from .settings import AdamWConfig, LocalRuntimeConfig, TrainerConfig


@dataclass
class AdapterRef:
    """A model family's runtime adapter: ``path`` ("module:Class", as
    :class:`pipeflow.families.FamilySpec` names it) and its arguments but the device."""

    path: str
    kwargs: dict[str, Any]

    def build(self, device) -> Any:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)(device=device, **self.kwargs)


@dataclass(frozen=True)
class Lowered:
    """A schedule as every rank runs it, worked out once: ``per_device``, each device's
    actions with the sends and receives the lowering pass derived
    (:func:`pipeflow.schedules.lowering.lower`); ``paired``, the same with each device's
    receives in the order their senders send them, checked (what ranks that match a
    pair's messages in order run: NCCL, ``runtime.p2p=ordered``;
    :func:`~pipeflow.schedules.lowering.order_pairs`); ``tied``, an asynchronous
    schedule's update plan of the weight its tied stages share (device -> (pipe, stage,
    update) -> the updates that STEP applies:
    :func:`~pipeflow.schedules.versions.tied_update_plan`); ``owners``, the device holding
    each replicated stage's optimizer state where the schedule reduces to an owner
    (:func:`~pipeflow.schedules.zero.zero_owners`)."""

    schedule: Schedule
    per_device: list
    paired: list
    tied: dict
    owners: dict

    @classmethod
    def of(cls, schedule: Schedule, tied_stages: tuple, completion: list | None = None) -> "Lowered":
        """``completion``: the schedule's dry-run order, where its validation ran it."""
        per_device = lower(schedule)
        paired = order_pairs(per_device)
        check_pair_order(paired)
        tied = tied_update_plan(schedule, tied_stages, completion) if schedule.policy != WeightPolicy.SYNC else {}
        return cls(schedule, per_device, paired, tied, zero_owners(schedule.placement) if schedule.zero else {})


@dataclass(frozen=True)
class RunPlan:
    schedule: Schedule  # validated before any process started
    layers_per_stage: list[int]  # (partition=profiled: the cut of the profile measured before the ranks start)
    adapter: AdapterRef
    precision: str  # fp32 | bf16 | fp16, resolved (never auto)
    attention: str  # sdpa | eager
    recompute: str  # none | selective | full
    lowered: Lowered  # the schedule, lowered once
    # the settings a rank reads (pipeflow.formats.settings), the data set's arguments
    optim: AdamWConfig
    trainer: TrainerConfig
    runtime: LocalRuntimeConfig
    logger: Any  # WandbLoggerConfig (its group, tags and run name filled in) or NoLoggerConfig
    data: dict
    seed: int
    microbatches: int  # per step, as configured (an asynchronous schedule's IR spans schedule.windows steps)
    stages: int  # pipeline.stages, as configured (a plan's schedule may replicate them)
    record: dict  # the resolved config: config.json, the W&B run's config (nothing reads a setting from it)
    run_key: dict  # which simulated runs predict this one (pipeflow.tracking.record.run_key)
    checkpoint_records: dict  # "model" and "training", as a checkpoint's meta records them
    spec: Any = None  # the model's shape (a TransformerSpec; None for a concurrent-branch model)
    topology: Any = None  # the devices and links the run is planned on (a Topology)
    resume: str | None = None  # the checkpoint folder to continue from (absolute)
    tied_stages: tuple = ()  # the stages holding copies of one tied weight (embedding and head)
    segment_lengths: list[int] | None = None  # tokens per sequence segment (segmented schedules)
    # asynchronous schedules: evaluation runs a forward-only 1F1B over pipe 0's replicas,
    # and a chunk of L steps without a flush runs the schedule generated for L windows
    eval_lowered: Lowered | None = None
    chunk_lowered: dict[int, Lowered] = field(default_factory=dict)
    # pipeline.tensor_parallel: each device of the schedule is this many ranks, which
    # split its stages (ranks device * T .. device * T + T - 1); sequence_parallel with it
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    compile: bool = False  # each transformer block compiled on its own (config.groups.compile)

    @property
    def world_size(self) -> int:
        """One rank per device of the schedule and tensor-parallel rank."""
        return self.schedule.num_devices * self.tensor_parallel

    @property
    def eval_schedule(self) -> Schedule | None:
        return self.eval_lowered.schedule if self.eval_lowered is not None else None

    def chunk(self, windows: int) -> Lowered:
        """A chunk of ``windows`` steps, lowered (an asynchronous run's last chunk may be
        shorter than its schedule's windows): one the plan holds."""
        if windows == self.schedule.windows:
            return self.lowered
        try:
            return self.chunk_lowered[windows]
        except KeyError:
            raise ValueError(f"the run plan has no schedule for a chunk of {windows} steps "
                             f"(it has {sorted({self.schedule.windows, *self.chunk_lowered})})") from None
