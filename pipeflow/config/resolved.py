"""What a composed config resolves to, decided once at the start of preparation
(:func:`resolve`): the schedule's spec and the schedule, the model family and shape, the
tensor and sequence degrees, the topology, the precision and the segment lengths. The
checks and the run plan read this one frozen value; nothing derives it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from pipeflow.families import FamilySpec
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.ir import Schedule
from pipeflow.schedules.spec import ScheduleSpec
from pipeflow.topology.topology import Topology

from .assembly import branched_schedule, generate_schedule, model_spec, run_topology, simulation_segments, \
    split_segments
from .groups.precision import resolve_precision
from .tensor_degree import check_tensor_parallel, tensor_degree


@dataclass(frozen=True)
class Resolved:
    """One run's facts, each decided once (:func:`resolve`)."""

    schedule_spec: ScheduleSpec  # schedule.name's (a user's generator loaded and registered)
    family: FamilySpec  # model.family's
    schedule: Schedule  # generated, not yet validated
    spec: TransformerSpec | None  # the model's shape; None for a concurrent-branch model
    tensor: int  # pipeline.tensor_parallel: ranks per schedule device
    sequence: bool  # pipeline.sequence_parallel
    topology: Topology  # the run's devices; with tensor > 1 seen as its tensor groups
    precision: str  # fp32 | bf16 | fp16 (auto resolved, and written back into the config)
    segments: list[int] | None  # tokens per sequence segment (segmented schedules), else None
    parts: list | None = None  # a concurrent-branch model: what each of its stages holds


def resolve(cfg: DictConfig, sched: ScheduleSpec, family: FamilySpec, priced: bool = False) -> Resolved:
    """The run ``cfg`` names (its model resolved, its pipeline checked), or ConfigError
    naming the key: the schedule generated, the model's shape checked against its stages,
    the segments cut (``priced``: as pipeflow-simulate's cost group prices them), the
    tensor degree checked against both, then the topology and the precision it sets."""
    tensor, sequence = tensor_degree(cfg)
    spec = lengths = parts = None
    if family.branched:
        check_tensor_parallel(tensor, sequence, None, None, None)  # (refuses T > 1)
        schedule, parts = branched_schedule(cfg, sched)
    else:
        schedule = generate_schedule(cfg, sched)
        spec = model_spec(cfg, schedule)
        lengths = split_segments(cfg, spec, tensor if sequence else 1) if sched.segments else None
        if priced:
            lengths = simulation_segments(cfg, schedule, lengths)
        check_tensor_parallel(tensor, sequence, schedule, spec, lengths)
    topology = run_topology(cfg, schedule, tensor)
    return Resolved(sched, family, schedule, spec, tensor, sequence, topology, resolve_precision(cfg, topology),
                    lengths, parts)
