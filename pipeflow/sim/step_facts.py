"""What every device's memory walk reads of one schedule (:class:`StepFacts`)."""

from __future__ import annotations

from ..schedules.ir import WeightPolicy
from ..schedules.lowering import action_positions
from ..schedules.versions import tied_update_plan
from ..schedules.zero import zero_owners
from .tape_steps import B, F, I


class StepFacts:
    """What every device's walk reads of one schedule: placement, replicas and shards, weight policy, where
    each action runs. ``replicas``: the schedule is one replica of that many."""

    def __init__(self, schedule, replicas: int = 1) -> None:
        self.placement, self.graph = placement, graph = schedule.placement, schedule.graph
        self.orders = schedule.orders
        self.nseg = max(1, schedule.num_segments)
        self.owners = zero_owners(placement) if getattr(schedule, "zero", False) else None
        # each stage's copies; a stage held by more than one device flattens its gradients for its REDUCE
        self.count = {s: replicas * len({row[s] for row in placement.table}) for s in range(len(placement.table[0]))}
        self.replicated = {s for s, c in self.count.items() if c > 1}
        self.shard = getattr(schedule, "shard", "none")  # pipeline.shard: what the replicas of a stage shard
        self.sliced = self.replicated if self.shard != "none" else set()  # ZeRO-1/2/3: each replica a slice
        # an asynchronous executor's forwards each cast the weights anew (their versions
        # change between microbatches): each microbatch's backward holds its own casts
        self.asynchronous = getattr(schedule, "policy", WeightPolicy.SYNC) != WeightPolicy.SYNC
        # a weight its first and last stages share (a tied embedding) is updated once the
        # last backward feeding it is done anywhere: until that STEP a copy holds the
        # update's gradient of it (the cost model prices it: 0 for an untied model)
        self.nstages = n = len(graph.preds)
        chain = n > 1 and all(len(p) <= 1 for p in graph.preds) and all(len(x) <= 1 for x in graph.succs)
        self.tied_plan = tied_update_plan(schedule, (0, n - 1)) if self.asynchronous and chain else {}
        # where each action runs: a message from a peer made by an action after the one that
        # consumed a send proves that send arrived (pipeflow.runtime.messages._drop_arrived)
        self.position = action_positions(schedule)

    def forward_at(self, stage: int, microbatch: int, pipe: int, segment: int) -> tuple | None:
        """(device, index) of that forward, or None."""
        return self.position.get((F, stage, microbatch, pipe, segment, -1))  # (an Action is this tuple)

    def backward_at(self, stage: int, microbatch: int, pipe: int, segment: int) -> tuple | None:
        """(device, index) of that backward (B, else I), or None."""
        got = self.position.get((B, stage, microbatch, pipe, segment, -1))
        return got if got is not None else self.position.get((I, stage, microbatch, pipe, segment, -1))
