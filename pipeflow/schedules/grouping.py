"""Run a chain schedule over a stage DAG (the baseline BAPP is measured against): the stages
in one topological order cut into p contiguous groups, each action of chain position c
becoming that action for each stage of group c (forwards in topological order, backwards
in reverse). Valid for any chain schedule."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .ir import Action, Kind, Placement, Schedule, StageGraph


def contiguous_groups(graph: StageGraph, parts: int) -> list[list[int]]:
    """The graph's topological order cut into ``parts`` contiguous runs, the longer first (stage
    indices need not be a topological order)."""
    order = graph.topological_order()
    if not 1 <= parts <= len(order):
        raise ValueError(
            f"pipeline.stages={parts}: the model has {len(order)} stages to place, so use 1..{len(order)} devices"
        )
    base, extra = divmod(len(order), parts)
    out, lo = [], 0
    for c in range(parts):
        n = base + (1 if c < extra else 0)
        out.append(order[lo : lo + n])
        lo += n
    return out


def place_graph(chain: Schedule, graph: StageGraph, groups: Sequence[Sequence[int]] | None = None) -> Schedule:
    """``chain`` is a schedule over a chain of len(groups) stages; return it run over ``graph``."""
    p = chain.num_stages
    groups = [list(g) for g in (groups or contiguous_groups(graph, p))]
    if len(groups) != p or sorted(s for g in groups for s in g) != list(range(graph.num_stages)):
        raise ValueError(f"groups must split stages 0..{graph.num_stages - 1} into {p} parts, got {groups}")
    flat = [s for g in groups for s in g]
    position = {s: i for i, s in enumerate(flat)}
    for src, dst in graph.edges:
        if position[src] >= position[dst]:
            raise ValueError(f"groups put stage {dst} before its predecessor {src}; groups must follow a topological order")
    if not chain.graph.is_chain:
        raise ValueError(f"schedule {chain.name!r} is not a chain schedule")
    table = []
    for row in chain.placement.table:
        devices = [0] * graph.num_stages
        for c, group in enumerate(groups):
            for s in group:
                devices[s] = row[c]
        table.append(tuple(devices))

    def expand(a: Action) -> list[Action]:
        members = groups[a.stage]
        if a.kind in Kind.BACKWARD or a.kind == Kind.W:
            members = members[::-1]
        return [a._replace(stage=s) for s in members]

    orders = [[b for a in order for b in expand(a)] for order in chain.orders]
    # (the chain's every other field carries over: its policy, windows, shard, replicas)
    return dataclasses.replace(chain, graph=graph, placement=Placement(chain.num_devices, tuple(table)),
                               orders=orders, meta={**chain.meta, "groups": groups})
