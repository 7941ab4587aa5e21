"""The schedule IR: for each device an ordered list of :class:`Action` (a :class:`Schedule`),
checked by the validator, timed by the simulator, executed by the runtime. Communication
is derived (:mod:`pipeflow.schedules.lowering`), never written here.

Notation (a superset of torch.distributed.pipelining's ``0F3``)::

    [pipe:]<stage><KIND><microbatch>[s<segment>]     compute: F, B, I, W
    [pipe:]<stage><KIND>@<version>                   REDUCE (R) and STEP (S)

``1:2F3s1``: stage 2's forward of microbatch 3, segment 1, on replica 1; ``0:4R@0``
reduces stage 4's gradients for update 0."""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from enum import Enum
from itertools import repeat
from typing import Iterable, Iterator, NamedTuple, Sequence


class Kind:
    """Action kinds. Plain one-letter strings: cheap to compare, print as themselves."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients together)
    I = "I"  # backward for the input gradient only (zero-bubble split)  # noqa: E741
    W = "W"  # backward for the weight gradient only (zero-bubble split)
    REDUCE = "R"  # gradient reduction across the replicas of a stage (ZeRO-2/3: a reduce-scatter)
    STEP = "S"  # optimizer update of a stage
    GATHER = "G"  # all-gather of a fully sharded stage's parameters (pipeline.shard=full)
    FREE = "X"  # a fully sharded stage lets its gathered parameters go

    COMPUTE = frozenset("FBIW")
    BACKWARD = frozenset("BI")  # the actions that produce the input gradient
    WEIGHT_GRAD = frozenset("BW")  # the actions that produce the weight gradient
    COLLECTIVE = frozenset("RG")  # issued on the compute stream, run across a stage's replicas
    ALL = frozenset("FBIWRSGX")


class WeightPolicy(str, Enum):
    """Which weight version each forward and backward sees.

    sync: one update per iteration after a flush (GPipe, 1F1B, Chimera, ...).
    stash: PipeDream; a backward uses the version its forward used.
    none: PipeDream without stashing; a backward uses the current weights.
    double_buffer: PipeDream-2BW; every microbatch is exactly one version stale.
    bounded: AMDP; mismatch at most one update, only at window boundaries.
    """

    SYNC = "sync"
    STASH = "stash"
    NONE = "none"
    DOUBLE_BUFFER = "double_buffer"
    BOUNDED = "bounded"


class Action(NamedTuple):
    """One unit of work on one device. Compute: ``microbatch`` is global (unique across
    replicas), ``version`` -1. REDUCE and STEP: ``microbatch`` -1, ``version`` the weight
    update. GATHER and FREE: ``version`` counts the stage's gathers in the step."""

    kind: str
    stage: int
    microbatch: int = -1
    pipe: int = 0
    segment: int = 0
    version: int = -1

    def __str__(self) -> str:
        head = f"{self.pipe}:" if self.pipe else ""
        if self.kind in Kind.COMPUTE:
            tail = f"s{self.segment}" if self.segment else ""
            return f"{head}{self.stage}{self.kind}{self.microbatch}{tail}"
        return f"{head}{self.stage}{self.kind}@{self.version}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind in Kind.COMPUTE

    @staticmethod
    def parse(text: str) -> "Action":
        """Inverse of ``str(action)``; raises ValueError naming the bad string."""
        m = _ACTION_RE.fullmatch(text.strip())
        if m is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected [pipe:]<stage><F|B|I|W><mb>[s<seg>] "
                f"or [pipe:]<stage><R|S|G|X>@<version>, e.g. '0F3', '1:2B0s1', '4S@0'"
            )
        pipe, stage, kind, mb, seg, version = m.groups()
        pipe_i = int(pipe) if pipe else 0
        if kind in Kind.COMPUTE:
            if mb is None or version is not None:
                raise ValueError(f"cannot parse action {text!r}: compute actions need a microbatch")
            return Action(kind, int(stage), int(mb), pipe_i, int(seg) if seg else 0)
        if version is None or mb is not None or seg is not None:
            raise ValueError(f"cannot parse action {text!r}: R, S, G and X take '@<version>', e.g. '4R@0'")
        return Action(kind, int(stage), -1, pipe_i, 0, int(version))


_ACTION_RE = re.compile(r"(?:(\d+):)?(\d+)([FBIWRSGX])(?:(\d+)(?:s(\d+))?|@(\d+))")


def compute_actions(kind: str, stage: int, microbatches: Iterable[int], pipe: int = 0, seg: int = 0) -> list[Action]:
    """``Action(kind, stage, mb, pipe, seg)`` for each of ``microbatches``, made without a
    Python call each (a 64 x 1024 schedule has a quarter of a million)."""
    fields = zip(repeat(kind), repeat(stage), microbatches, repeat(pipe), repeat(seg), repeat(-1))
    return list(map(tuple.__new__, repeat(Action), fields))


def F(stage: int, mb: int, pipe: int = 0, seg: int = 0) -> Action:
    return Action(Kind.F, stage, mb, pipe, seg)


def B(stage: int, mb: int, pipe: int = 0, seg: int = 0) -> Action:
    return Action(Kind.B, stage, mb, pipe, seg)


def I(stage: int, mb: int, pipe: int = 0, seg: int = 0) -> Action:  # noqa: E743
    return Action(Kind.I, stage, mb, pipe, seg)


def W(stage: int, mb: int, pipe: int = 0, seg: int = 0) -> Action:
    return Action(Kind.W, stage, mb, pipe, seg)


def REDUCE(stage: int, pipe: int = 0, version: int = 0) -> Action:
    return Action(Kind.REDUCE, stage, -1, pipe, 0, version)


def STEP(stage: int, pipe: int = 0, version: int = 0) -> Action:
    return Action(Kind.STEP, stage, -1, pipe, 0, version)


@dataclass(frozen=True)
class StageGraph:
    """The model as a DAG of stages; edges carry activations forward (src -> dst). A GPT is a
    chain; a concurrent-branch model two chains with interaction edges and a joined head
    (``branch`` labels each stage). Sizes live in the cost model."""

    num_stages: int
    edges: tuple[tuple[int, int], ...]
    branch: tuple[str, ...] = ()
    preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.num_stages
        if n < 1:
            raise ValueError(f"a stage graph needs at least one stage, got {n}")
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for src, dst in self.edges:
            if not (0 <= src < n and 0 <= dst < n) or src == dst:
                raise ValueError(f"edge {src}->{dst} is not between two distinct stages of 0..{n - 1}")
            succs[src].append(dst)
            preds[dst].append(src)
        object.__setattr__(self, "preds", tuple(tuple(p) for p in preds))
        object.__setattr__(self, "succs", tuple(tuple(s) for s in succs))
        if self.branch and len(self.branch) != n:
            raise ValueError(f"branch labels: expected {n}, got {len(self.branch)}")
        self.topological_order()  # raises on a cycle

    @staticmethod
    def chain(num_stages: int) -> "StageGraph":
        return StageGraph(num_stages, tuple((i, i + 1) for i in range(num_stages - 1)))

    @property
    def is_chain(self) -> bool:
        return self.edges == tuple((i, i + 1) for i in range(self.num_stages - 1))

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if not self.preds[s])

    @property
    def sinks(self) -> tuple[int, ...]:
        """Stages that compute the loss: their backward needs no incoming gradient."""
        return tuple(s for s in range(self.num_stages) if not self.succs[s])

    def topological_order(self) -> list[int]:
        """Stages so that every edge goes forward; among ready stages the lowest index first."""
        indeg = [len(p) for p in self.preds]
        ready = [s for s in range(self.num_stages) if indeg[s] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            s = heapq.heappop(ready)
            order.append(s)
            for t in self.succs[s]:
                indeg[t] -= 1
                if indeg[t] == 0:
                    heapq.heappush(ready, t)
        if len(order) != self.num_stages:
            raise ValueError("stage graph has a cycle")
        return order


@dataclass(frozen=True)
class Placement:
    """Which device holds each stage, per pipeline replica: ``table[pipe][stage]``."""

    num_devices: int
    table: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.table:
            raise ValueError("a placement needs at least one pipeline replica")
        widths = {len(row) for row in self.table}
        if len(widths) != 1:
            raise ValueError("every pipeline replica must place the same number of stages")
        for pipe, row in enumerate(self.table):
            for stage, dev in enumerate(row):
                if not 0 <= dev < self.num_devices:
                    raise ValueError(
                        f"pipe {pipe} places stage {stage} on device {dev}, "
                        f"outside 0..{self.num_devices - 1}"
                    )

    @staticmethod
    def single(device_of_stage: Sequence[int], num_devices: int | None = None) -> "Placement":
        n = num_devices if num_devices is not None else max(device_of_stage) + 1
        return Placement(n, (tuple(device_of_stage),))

    @property
    def num_pipes(self) -> int:
        return len(self.table)

    @property
    def num_stages(self) -> int:
        return len(self.table[0])

    def device(self, pipe: int, stage: int) -> int:
        return self.table[pipe][stage]

    def stages_on(self, device: int) -> list[tuple[int, int]]:
        """(pipe, stage) pairs held by a device, in pipe then stage order."""
        return [(p, s) for p, row in enumerate(self.table) for s, d in enumerate(row) if d == device]

    def replicas(self, stage: int) -> list[tuple[int, int]]:
        """(pipe, device) for every replica of a stage."""
        return [(p, row[stage]) for p, row in enumerate(self.table)]

    def as_lists(self) -> list[list[int]]:
        return [list(row) for row in self.table]


@dataclass(frozen=True)
class Schedule:
    """Per-device ordered action lists and what interprets them: ``pipe_of_microbatch[mb]``
    (its replica), ``update_of_microbatch[mb]`` (the weight update its gradient feeds).
    Frozen once generated (sharding, data parallelism, plans make new ones); code reads
    fields, ``meta`` only describes."""

    name: str
    graph: StageGraph
    placement: Placement
    orders: list[list[Action]]
    num_microbatches: int
    num_segments: int = 1
    policy: WeightPolicy = WeightPolicy.SYNC
    pipe_of_microbatch: tuple[int, ...] = ()
    update_of_microbatch: tuple[int, ...] = ()
    # What the runtime and the simulator read besides the orders. An asynchronous schedule
    # covers ``windows`` steps (updates) of ``microbatches_per_step`` microbatches each,
    # without a flush; a synchronous one is one step of all its microbatches. ``zero``:
    # a replicated stage's optimizer state lives on one owner replica (AMDP's sharding).
    # ``shard`` (pipeline.shard): what a synchronous schedule's replicas of a stage shard,
    # "none", "optimizer" (ZeRO-1: each its slice of the optimizer state) or "gradients"
    # (ZeRO-2: and of the gradients, its REDUCE a reduce-scatter)
    windows: int = 1
    microbatches_per_step: int = 0  # 0: num_microbatches / windows
    zero: bool = False
    shard: str = "none"
    gather: str | None = None  # shard="full": when a stage gathers its parameters (pipeline.gather)
    data_parallel: int = 1  # the replicas of the pipeline side by side (pipeline.data_parallel)
    layers_per_stage: tuple[int, ...] = ()  # a plan's own cut of the layers (); else the partition's
    meta: dict = field(default_factory=dict)  # descriptive only (policy chosen, plan, groups, ...)
    # (forward, backward) pairs run as one overlapped unit (DualPipeV's overlapped F&B): the
    # backward right after its forward on one device, the pair starting once both are
    # ready; the simulator prices it as max + (1 - cost.overlap) x min of the two, the
    # runtime runs the forward, then the backward (on CPU), with both inputs received first
    overlapped: tuple[tuple[Action, Action], ...] = ()

    def __post_init__(self) -> None:
        m = self.num_microbatches
        if not self.microbatches_per_step:
            object.__setattr__(self, "microbatches_per_step", m // max(1, self.windows))
        if not self.pipe_of_microbatch:
            object.__setattr__(self, "pipe_of_microbatch", (0,) * m)
        if not self.update_of_microbatch:
            object.__setattr__(self, "update_of_microbatch", (0,) * m)
        if len(self.orders) != self.placement.num_devices:
            raise ValueError(
                f"schedule {self.name!r} has orders for {len(self.orders)} devices, "
                f"placement has {self.placement.num_devices}"
            )
        if self.placement.num_stages != self.graph.num_stages:
            raise ValueError(
                f"placement covers {self.placement.num_stages} stages, graph has {self.graph.num_stages}"
            )

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    @property
    def num_stages(self) -> int:
        return self.graph.num_stages

    def compile_mode(self, compile: bool) -> str:
        """What a run compiles with ``compile``: ``none``; ``blocks`` (each block whole); or
        ``eager_products`` (each block but its weight products: the zero-bubble split)."""
        if not compile:
            return "none"
        return "eager_products" if self.uses_split_backward() else "blocks"

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """(device, position, action) for every action."""
        for dev, order in enumerate(self.orders):
            for pos, act in enumerate(order):
                yield dev, pos, act

    def compute_orders(self) -> list[list[Action]]:
        return [[a for a in order if a.kind in Kind.COMPUTE] for order in self.orders]

    def uses_split_backward(self) -> bool:
        """Some backward runs as I then W (the zero-bubble split)."""
        return any(a.kind == Kind.I for order in self.orders for a in order)

    def overlap_partner(self) -> dict[Action, Action]:
        """Forward -> the backward it overlaps with (:attr:`overlapped`)."""
        return dict(self.overlapped)

    def cells(self, dev: int) -> list[str]:
        """Device ``dev``'s actions as printed, an overlapped pair as one ``(F;B)`` cell."""
        partner = self.overlap_partner()
        paired = set(partner.values())
        return [f"({a};{partner[a]})" if a in partner else str(a) for a in self.orders[dev] if a not in paired]

    def format(self, width: int = 6) -> str:
        """Human-readable grid, one row per device."""
        lines = []
        for dev in range(len(self.orders)):
            cells = " ".join(f"{c:<{width}}" for c in self.cells(dev))
            lines.append(f"d{dev:<3}| {cells}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return (
            f"Schedule({self.name}: {self.num_stages} stages on {self.num_devices} devices, "
            f"{self.placement.num_pipes} pipe(s), {self.num_microbatches} microbatches, "
            f"{self.num_segments} segment(s), policy={self.policy.value})"
        )


def parse_orders(rows: Iterable[Iterable[str]]) -> list[list[Action]]:
    """Parse per-device rows of action strings (e.g. from a CSV)."""
    return [[Action.parse(cell) for cell in row if cell.strip()] for row in rows]
