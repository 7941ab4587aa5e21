"""What an executor works on: one stage's state on this rank, a step's statistics, the
messages in flight, and the process groups every rank creates in the same order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..schedules.ir import Schedule
from .device import new_group as one_group


@dataclass
class StageState:
    """One (pipe, stage) held by this rank: its module and what is in flight."""

    pipe: int
    stage: int
    module: torch.nn.Module
    first: bool
    last: bool
    optimizer: torch.optim.Optimizer | None = None
    params: list = field(default_factory=list)
    tied: list = field(default_factory=list)  # this stage's copies of the tied embedding
    saved: dict = field(default_factory=dict)  # (mb, seg) -> (input leaf or None, output or loss)
    kv: dict = field(default_factory=dict)  # Seq1F1B: mb -> seg -> (own K/V per block, prefix leaves, holds)
    kv_grad: dict = field(default_factory=dict)  # (mb, seg) -> per block (dK, dV) from later segments
    pending_w: dict = field(default_factory=dict)  # (mb, seg) -> what W needs after I (PendingWeight)
    accumulators: frozenset | None = None  # the parameters' autograd accumulators, held for I (zero bubble)
    tensor_reduced: bool = False  # tensor parallelism: this step's partial gradients summed


@dataclass
class StepStats:
    loss: float  # the iteration's loss (sum of the normalised microbatch losses over the last stages)
    grad_norm: float  # before clipping
    busy: float  # seconds of compute on this rank
    events: list  # timeline events of this rank when recorded
    loss_scale: float | None = None  # fp16: the scale this step's backward ran with
    skipped: bool = False  # fp16: the gradients overflowed, so no update was applied


@dataclass
class Messages:
    """The messages of one walk: received or being received (``inbox``: buffer and its
    pending work), produced for another rank (``outbox``) or for a stage on this rank
    (``local``), and the sends in flight (with their tensors, alive until sent)."""

    inbox: dict = field(default_factory=dict)
    outbox: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)


class Groups:
    """Process groups every rank creates in the same order: one per replicated stage and one
    for the ranks holding copies of the tied embedding."""

    def __init__(self, schedule: Schedule, tied_stages: tuple[int, ...], mesh=None):
        placement = schedule.placement
        # over devices; with tensor parallelism each device's ranks of this one's tensor rank
        new_group = one_group if mesh is None else mesh.new_group
        self.replica_group: dict[int, object] = {}
        for stage in range(schedule.num_stages):
            devices = sorted({d for _, d in placement.replicas(stage)})
            if len(devices) > 1:
                self.replica_group[stage] = new_group(devices)
        tied_devices = sorted({d for s in tied_stages for _, d in placement.replicas(s)})
        self.tied_devices = tied_devices
        self.tied_group = new_group(tied_devices) if len(tied_devices) > 1 else None


def sync_tied(copies: list, group) -> None:
    """Give every copy of the tied embedding this rank holds the sum of all copies' gradients,
    over ``group`` (the ranks holding one) too; summed in place into the first copy's."""
    if not copies or (group is None and len(copies) == 1):
        return
    grads = [p.grad for p in copies if p.grad is not None]
    # in place: a sum and a clone per copy held two more 50k-row gradients (294 MiB at GPT-2 small)
    total = grads[0] if grads else torch.zeros_like(copies[0])
    for g in grads[1:]:
        total += g
    if group is not None:
        dist.all_reduce(total, group=group)
    for p in copies:
        if p.grad is None:
            p.grad = total.clone()
        elif p.grad is not total:
            p.grad.copy_(total)
