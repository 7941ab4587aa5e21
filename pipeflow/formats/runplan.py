"""The run plan: everything the up-front check decided about a training job, built once
from the composed config (:func:`pipeflow.config.prepare_training`), handed by the
launcher to every rank (under torchrun each process builds it the same way), which only
instantiates modules, optimizers and executors from it.

Plain and picklable: the validated schedule (and an asynchronous run's chunk and
evaluation schedules), layers per stage, segment lengths, the precision and attention,
and the model family's runtime adapter by import path with its arguments. The planner
and BAPP's coordinator ran once, before it was built; a rank never reads the config to
decide what to run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any

from pipeflow.schedules.ir import Schedule


@dataclass
class AdapterRef:
    """A model family's runtime adapter: ``path`` ("module:Class", as
    :class:`pipeflow.families.FamilySpec` names it) and its arguments but the device."""

    path: str
    kwargs: dict[str, Any]

    def build(self, device) -> Any:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)(device=device, **self.kwargs)


@dataclass
class RunPlan:
    schedule: Schedule  # validated before any process started
    layers_per_stage: list[int]
    adapter: AdapterRef
    precision: str  # fp32 | bf16 | fp16, resolved (never auto)
    attention: str  # sdpa | eager
    segment_lengths: list[int] | None = None  # tokens per sequence segment (segmented schedules)
    # asynchronous schedules: evaluation runs a forward-only 1F1B over pipe 0's replicas,
    # and a chunk of L steps without a flush runs the schedule generated for L windows
    eval_schedule: Schedule | None = None
    chunk_schedules: dict[int, Schedule] = field(default_factory=dict)
    # pipeline.tensor_parallel: each device of the schedule is this many ranks, which
    # split its stages (ranks device * T .. device * T + T - 1); sequence_parallel with it
    tensor_parallel: int = 1
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        """One rank per device of the schedule and tensor-parallel rank."""
        return self.schedule.num_devices * self.tensor_parallel

    def chunk_schedule(self, windows: int) -> Schedule:
        """The schedule of a chunk of ``windows`` steps (an asynchronous run's last chunk
        may be shorter than its schedule's windows): one the plan holds."""
        if windows == self.schedule.windows:
            return self.schedule
        try:
            return self.chunk_schedules[windows]
        except KeyError:
            raise ValueError(f"the run plan has no schedule for a chunk of {windows} steps "
                             f"(it has {sorted({self.schedule.windows, *self.chunk_schedules})})") from None

    def with_layers(self, layers: list[int]) -> "RunPlan":
        """The same plan with the model cut as ``layers`` (a partition measured after the
        check: partition=profiled without a profile)."""
        return replace(self, layers_per_stage=list(layers),
                       adapter=AdapterRef(self.adapter.path, {**self.adapter.kwargs, "layers_per_stage": list(layers)}))
