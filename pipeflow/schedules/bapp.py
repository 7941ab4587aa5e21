"""BAPP: branch-aware bidirectional pipelines for concurrent-branch models: the vision branch placed down,
the text branch up, each device's order list-scheduled over the stage DAG under a :class:`BappPolicy`
(docs/schedules.md). :mod:`pipeflow.planning.coordinator` searches the policies."""

from __future__ import annotations

import heapq
from typing import Callable, NamedTuple

from .common import check_basic, finish_sync, require
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec

BRANCHES = ("vision", "text")
PRIORITIES = ("fcfs", "backward_first", "forward_first")
HEADS = ("vision_end", "text_end")


class BappPolicy(NamedTuple):
    priority: str = "fcfs"
    lead: str = "vision"
    warmup: int = 0
    head: str = "vision_end"

    def describe(self) -> str:
        return f"priority={self.priority} lead={self.lead} warmup=+{self.warmup} head={self.head}"


UNCOORDINATED = BappPolicy()  # first come first served, the vision branch first on ties


def branch_chains(graph: StageGraph) -> dict[str, list[int]]:
    """Each branch's stages in chain order (by topological order of the graph)."""
    order = graph.topological_order()
    chains: dict[str, list[int]] = {b: [] for b in BRANCHES}
    for s in order:
        label = graph.branch[s] if graph.branch else ""
        if label in chains:
            chains[label].append(s)
    return chains


def bapp_placement(graph: StageGraph, p: int, head: str = "vision_end") -> Placement:
    chains = branch_chains(graph)
    device = [0] * graph.num_stages
    for i, s in enumerate(chains["vision"]):
        device[s] = i
    for j, s in enumerate(chains["text"]):
        device[s] = p - 1 - j
    for s in range(graph.num_stages):
        if graph.branch[s] == "head":
            device[s] = p - 1 if head == "vision_end" else 0
    return Placement.single(device, p)


def check_bapp_graph(graph: StageGraph | None, stages: int) -> None:
    name = "bapp"
    require(graph is not None and bool(graph.branch), "schedule.name", name, name,
            "a concurrent-branch model (model.family=cbm, e.g. model=cbm_tiny): two branch chains and a head")
    chains = branch_chains(graph)
    for b in BRANCHES:
        require(len(chains[b]) == stages, "pipeline.stages", stages, name,
                f"each branch cut into pipeline.stages stages; the {b} branch has {len(chains[b])}")
    heads = [s for s in range(graph.num_stages) if graph.branch[s] == "head"]
    require(len(heads) == 1 and len(heads) + 2 * stages == graph.num_stages, "model", "cbm", name,
            "two branch chains and one fused head stage")


def bapp(
    stages: int,
    microbatches: int,
    graph: StageGraph | None = None,
    policy: BappPolicy = UNCOORDINATED,
    durations: Callable[[str, int], float] | None = None,
) -> Schedule:
    name = "bapp"
    check_basic(name, stages, microbatches)
    check_bapp_graph(graph, stages)
    require(policy.priority in PRIORITIES, "schedule.priority", policy.priority, name, f"one of {', '.join(PRIORITIES)}")
    require(policy.lead in BRANCHES, "schedule.lead", policy.lead, name, f"one of {', '.join(BRANCHES)}")
    require(policy.head in HEADS, "schedule.head", policy.head, name, f"one of {', '.join(HEADS)}")
    require(isinstance(policy.warmup, int) and policy.warmup >= 0, "schedule.warmup", policy.warmup, name,
            "a whole number >= 0 of extra microbatches in flight")
    p, m = stages, microbatches
    placement = bapp_placement(graph, p, policy.head)
    orders = _list_schedule(graph, placement, p, m, policy, durations or _unit_durations)
    return finish_sync(name, graph, placement, orders, m,
                       meta={"policy": policy._asdict(), "branches": {b: c for b, c in branch_chains(graph).items()}})


def bapp_from_options(stages: int, microbatches: int, graph: StageGraph | None = None, priority: str | None = None,
                      lead: str | None = None, warmup: int | None = None, head: str | None = None) -> Schedule:
    """BAPP with the policy given option by option (null: the uncoordinated policy's choice)."""
    given = {"priority": priority, "lead": lead, "warmup": warmup, "head": head}
    return bapp(stages, microbatches, graph, UNCOORDINATED._replace(**{k: v for k, v in given.items() if v is not None}))


# coordinate (default true in its YAML): the configuration layer lets
# pipeflow.planning.coordinator choose the policy by simulation, within memory_limit_gb
SPEC = ScheduleSpec("bapp", bapp_from_options, "the concurrent-branch model's branches as pipelines in opposite directions",
                    config_keys={"coordinate": bool, "memory_limit_gb": float})


def _unit_durations(kind: str, stage: int) -> float:
    return 1.0 if kind == Kind.F else 2.0


def _priority(policy: BappPolicy, label) -> Callable[[Action, float], tuple]:
    """The key ordering a device's ready actions under ``policy`` (smallest first): of action ``a`` ready at
    ``t``, its branch read from ``label``."""
    lead_rank = {policy.lead: 0, ("text" if policy.lead == "vision" else "vision"): 1, "head": 2}

    def key(a: Action, t: float) -> tuple:
        backward = a.kind == Kind.B
        branch = lead_rank[label[a.stage]]
        if policy.priority == "fcfs":
            return (t, branch, not backward, a.microbatch)
        if policy.priority == "backward_first":
            return (not backward, t, branch, a.microbatch)
        return (backward, t, branch, a.microbatch)

    return key


def _list_schedule(graph: StageGraph, placement: Placement, p: int, m: int, policy: BappPolicy,
                   dur: Callable[[str, int], float]) -> list[list[Action]]:
    """Each device's order of every F and B: list scheduling over ``graph``, an action taking ``dur(kind,
    stage)`` and a free device running its ready action first under ``policy``."""
    chains = branch_chains(graph)
    source_of = {chains[b][0]: b for b in BRANCHES}
    cap = p + policy.warmup
    key = _priority(policy, graph.branch)
    npred = {s: len(graph.preds[s]) for s in range(graph.num_stages)}
    nsucc = {s: len(graph.succs[s]) for s in range(graph.num_stages)}
    fwd_waiting: dict[tuple[int, int], int] = {}  # (stage, mb) -> predecessors' forwards still to finish
    bwd_waiting: dict[tuple[int, int], int] = {}  # (stage, mb) -> successors' backwards (+ own forward) to finish
    in_flight = {b: 0 for b in BRANCHES}  # microbatches between F and B on each branch's first stage
    next_admit = {b: 0 for b in BRANCHES}
    ndev = placement.num_devices
    queue: list[list] = [[] for _ in range(ndev)]
    free_at = [0.0] * ndev
    events: list = []
    orders: list[list[Action]] = [[] for _ in range(ndev)]
    seq = 0

    def ready(a: Action, t: float) -> None:
        nonlocal seq
        heapq.heappush(queue[placement.device(0, a.stage)], (key(a, t), seq, a))
        seq += 1

    def admit(b: str, t: float) -> None:
        while in_flight[b] < cap and next_admit[b] < m:
            mb = next_admit[b]
            next_admit[b] += 1
            in_flight[b] += 1
            ready(Action(Kind.F, chains[b][0], mb), t)

    for b in BRANCHES:
        admit(b, 0.0)
    remaining = 2 * graph.num_stages * m
    now = 0.0
    while remaining:
        for dev in range(ndev):
            if free_at[dev] <= now and queue[dev]:
                a = heapq.heappop(queue[dev])[-1]
                orders[dev].append(a)
                free_at[dev] = now + dur(a.kind, a.stage)
                heapq.heappush(events, (free_at[dev], seq, a))
                seq += 1
        if not events:
            raise RuntimeError("bapp list scheduling stalled")  # a bug, never a config error
        now = events[0][0]
        while events and events[0][0] <= now:
            t, _, a = heapq.heappop(events)
            remaining -= 1
            s, mb = a.stage, a.microbatch
            if a.kind == Kind.F:
                for succ in graph.succs[s]:
                    k = (succ, mb)
                    fwd_waiting[k] = fwd_waiting.get(k, npred[succ]) - 1
                    if fwd_waiting[k] == 0:
                        ready(Action(Kind.F, succ, mb), t)
                k = (s, mb)
                bwd_waiting[k] = bwd_waiting.get(k, nsucc[s] + 1) - 1
                if bwd_waiting[k] == 0:
                    ready(Action(Kind.B, s, mb), t)
                continue
            if s in source_of:
                b = source_of[s]
                in_flight[b] -= 1
                admit(b, t)
            for pred in graph.preds[s]:
                k = (pred, mb)
                bwd_waiting[k] = bwd_waiting.get(k, nsucc[pred] + 1) - 1
                if bwd_waiting[k] == 0:
                    ready(Action(Kind.B, pred, mb), t)
    return orders
