"""What a simulation returns: per-device statistics, the waits that explain idle time, and
:class:`SimResult` with its summary; see :mod:`pipeflow.sim.engine`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..schedules.ir import Action
from ..schedules.versions import VersionRecord, summarize
from ..formats.timeline import Timeline


# what an idle gap of a compute stream waited for (see the module doc), in tie-break order
# ("reduce": a collective, a REDUCE's or, with pipeline.shard=full, a GATHER's)
WAIT_KINDS = ("interaction", "head", "chain", "reduce", "stream", "drain")


# --------------------------------------------------------------------------- results
@dataclass
class DeviceStats:
    device: int
    busy: float  # compute-stream time (F, B, I, W, STEP)
    idle: float  # makespan - busy
    utilization: float  # busy / makespan
    peak_activation_bytes: float
    peak_live_microbatches: float  # (microbatch, stage, segment) in flight / segments
    sent_bytes: float  # point-to-point activations and gradients sent
    recv_bytes: float
    collective_bytes: float  # gradient bytes this device all-reduced
    num_actions: int
    peak_weight_versions: int = 0  # most weight versions one of its replicas keeps at once
    weight_bytes: float = 0.0  # peak over time of the weight bytes of all its replicas' versions
    optimizer_bytes: float = 0.0  # gradients and optimizer state (model state beyond the weights)
    # branch label -> compute time of this device's actions on stages of that branch (every
    # label of the graph, in the graph's order); empty for an unlabelled graph
    busy_by_branch: dict[str, float] = field(default_factory=dict)
    # wait kind (WAIT_KINDS) -> idle time charged to it; sums to ``idle``. Filled only
    # with record=True (empty otherwise)
    idle_by_cause: dict[str, float] = field(default_factory=dict)


class Wait(NamedTuple):
    """One idle gap of a device's compute stream: ``action`` waited from ``start`` to ``end``
    for ``cause``, the dependency that resolved last (on ``cause_device``; ``message``: whether
    it arrived as a message); ``kind`` is one of :data:`WAIT_KINDS`. A ``drain`` wait (after
    the last action) has no action and no cause."""

    device: int
    start: float
    end: float
    action: Action | None
    cause: Action | None
    cause_device: int
    kind: str
    message: bool = False

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "start": self.start,
            "end": self.end,
            "action": None if self.action is None else str(self.action),
            "cause": None if self.cause is None else str(self.cause),
            "cause_device": self.cause_device,
            "kind": self.kind,
            "message": self.message,
        }


_BRANCH_VIEW = ("busy_by_branch", "idle_by_cause")


@dataclass
class SimResult:
    schedule: str
    num_devices: int
    num_stages: int
    num_microbatches: int
    makespan: float
    bubble_ratio: float
    per_device: list[DeviceStats]
    p2p_bytes: float  # total point-to-point payload
    collective_bytes: float  # total gradient bytes all-reduced, summed over members
    timeline: Timeline | None = None
    topology: str = ""
    cost: object = None  # cost.describe()
    # achieved times, indexed like ``actions`` (device by device, in list order). For a
    # REDUCE, start/end are the collective's; ``issued`` holds when the device issued it.
    actions: list[Action] = field(default_factory=list, repr=False)
    start: list[float] = field(default_factory=list, repr=False)
    end: list[float] = field(default_factory=list, repr=False)
    issued: dict[Action, float] = field(default_factory=dict, repr=False)
    # weight version each forward and backward saw (empty for synchronous schedules: all 0)
    versions: list[VersionRecord] = field(default_factory=list, repr=False)
    staleness: dict = field(default_factory=lambda: summarize([]))
    # asynchronous schedules: microbatches per update window, windows simulated, updates
    microbatches_per_step: int | None = None
    windows: int | None = None
    updates: int = 1
    # every idle gap of every compute stream and its cause (record=True only), device by
    # device in time order; see :class:`Wait`
    waits: list[Wait] = field(default_factory=list, repr=False)
    branches: tuple[str, ...] = ()  # the graph's branch labels per stage (empty: unlabelled)

    @property
    def peak_activation_bytes(self) -> float:
        return max((d.peak_activation_bytes for d in self.per_device), default=0.0)

    def times(self) -> dict[Action, tuple[float, float]]:
        """Action -> (start, end)."""
        return {a: (s, e) for a, s, e in zip(self.actions, self.start, self.end)}

    def time_of(self, action: Action | str) -> tuple[float, float]:
        a = Action.parse(action) if isinstance(action, str) else action
        try:
            i = self.actions.index(a)
        except ValueError:
            raise KeyError(f"{a} is not an action of schedule {self.schedule!r}") from None
        return self.start[i], self.end[i]

    def summary(self) -> dict:
        """JSON-able metrics (no per-action times); for a branched graph each device's
        ``busy_by_branch`` and (with record=True) ``idle_by_cause`` and their sums too."""
        branched = bool(self.branches)
        cost = self.cost
        if not isinstance(cost, (dict, str, int, float, type(None))):
            cost = str(cost)
        out = {
            "schedule": self.schedule,
            "topology": self.topology,
            "cost": cost,
            "num_devices": self.num_devices,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "peak_activation_bytes": self.peak_activation_bytes,
            "p2p_bytes": self.p2p_bytes,
            "collective_bytes": self.collective_bytes,
            "staleness": dict(self.staleness),
            "per_device": [
                {k: dict(v) if isinstance(v, dict) else v
                 for k, v in vars(d).items() if branched or k not in _BRANCH_VIEW}
                for d in self.per_device
            ],
        }
        by_branch: dict[str, float] = {}
        by_cause: dict[str, float] = {}
        for d in self.per_device if branched else ():
            for k, v in d.busy_by_branch.items():
                by_branch[k] = by_branch.get(k, 0.0) + v
            for k, v in d.idle_by_cause.items():
                by_cause[k] = by_cause.get(k, 0.0) + v
        if by_branch:
            out["busy_by_branch"] = by_branch  # summed over devices
        if by_cause:
            out["idle_by_cause"] = by_cause
        if self.microbatches_per_step is not None:
            out["microbatches_per_step"] = self.microbatches_per_step
            out["windows"] = self.windows
            out["updates"] = self.updates
        return out
