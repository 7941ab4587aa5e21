"""ZeRO-1 for a replicated stage (``pipeline.shard=optimizer``): each of a stage's n
data-parallel replicas keeps AdamW's moments for one n-th of the stage's parameters,
updates that slice at the step, and the replicas all-gather the updated slices.

The slice is of the stage's parameters laid end to end (one flat per weight-decay group,
padded to a multiple of n), not whole tensors: every replica holds the same share, a
byte count the simulator prices exactly (``pipeflow.sim.memory``), and the slice is the
one a reduce-scatter fills (ZeRO-2's next step). Built by hand rather than with torch's
``ZeroRedundancyOptimizer``, which assigns whole parameters to replicas (shares as even
as the tensors' sizes allow, which an embedding can dominate on a small stage) and has
no such slice.

The gradients are all-reduced as without sharding (the executor's REDUCE), so every
replica holds the whole gradient for the clip norm and the gradient dump; the update of
a slice is torch's single-tensor AdamW written out, op for op, so a sharded run's
weights are the unsharded run's. A tied embedding's copies (summed across their stages
by the executor) keep a plain AdamW of their own on every replica, as without sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .optim import make_optimizer


class ShardedAdamW:
    """AdamW over one replica's slice of a stage's parameters (module docstring). Looks
    to the executor like a torch optimizer: ``param_groups`` (it sets ``lr``), ``step``,
    ``zero_grad``, ``state`` (what the memory profile names optimizer state),
    ``state_dict`` and ``load_state_dict`` (a checkpoint of this replica's slice)."""

    def __init__(self, module: torch.nn.Module, optim: dict, params: list, tied: list, group) -> None:
        self.group, self.n, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.betas = (float(optim["beta1"]), float(optim["beta2"]))
        self.eps = float(optim["eps"])
        lr = float(optim["lr"])
        tied_ids = {id(p) for p in tied}
        own = [p for p in params if id(p) not in tied_ids]
        # weight decay on matrices only, as make_optimizer
        self.param_groups = [
            {"params": [p for p in own if p.dim() >= 2], "weight_decay": float(optim["weight_decay"]), "lr": lr},
            {"params": [p for p in own if p.dim() < 2], "weight_decay": 0.0, "lr": lr}]
        self.tied = make_optimizer(module, optim, params=list(tied)) if tied else None
        self.steps = 0
        self.moments: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.param_groups)

    def shard(self, group: dict) -> tuple[int, int, int]:
        """(the flat's length, each replica's share, where this replica's starts)."""
        total = sum(p.numel() for p in group["params"])
        share = -(-total // self.n)
        return total, share, self.rank * share

    @property
    def state(self) -> dict:
        moments = {i: {"exp_avg": m[0], "exp_avg_sq": m[1]} for i, m in enumerate(self.moments) if m is not None}
        return {**moments, **({("tied", k): v for k, v in self.tied.state.items()} if self.tied else {})}

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        for i, group in enumerate(self.param_groups):
            total, share, start = self.shard(group)
            if not total:
                continue
            params = group["params"]
            param = torch.zeros(share, dtype=params[0].dtype, device=params[0].device)
            grad = torch.zeros_like(param)
            for p, lo, hi, at in self._pieces(params, start, start + share):  # this replica's slice, gathered
                param[at:at + hi - lo] = p.view(-1)[lo:hi]
                if p.grad is not None:
                    grad[at:at + hi - lo] = p.grad.view(-1)[lo:hi]
            if self.moments[i] is None:
                self.moments[i] = (torch.zeros_like(param), torch.zeros_like(param))
            exp_avg, exp_avg_sq = self.moments[i]
            lr, decay = group["lr"], group["weight_decay"]
            # torch.optim.AdamW's single-tensor update (torch.optim.adam._single_tensor_adam)
            if decay != 0:
                param.mul_(1 - lr * decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = float(self.steps)
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(self.eps)
            param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
            del grad, denom
            # every replica's updated slice, end to end, back into the parameters
            flat = torch.empty(share * self.n, dtype=param.dtype, device=param.device)
            dist.all_gather(list(flat.split(share)), param, group=self.group)
            del param
            at = 0
            for p in params:
                p.view(-1).copy_(flat[at:at + p.numel()])
                at += p.numel()
            del flat
        if self.tied is not None:
            for g in self.tied.param_groups:
                g["lr"] = self.param_groups[0]["lr"]
            self.tied.step()

    @staticmethod
    def _pieces(params: list, lo: int, hi: int):
        """The parts of ``params`` laid end to end that fall in [lo, hi): (parameter, its
        first and last element there, where the part starts in the slice)."""
        at = 0
        for p in params:
            a, b = max(lo, at), min(hi, at + p.numel())
            if a < b:
                yield p, a - at, b - at, a - lo
            at += p.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)
        if self.tied is not None:
            self.tied.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"shard": [self.n, self.rank] + [self.shard(g)[0] for g in self.param_groups], "steps": self.steps,
                "moments": [None if m is None else [m[0], m[1]] for m in self.moments],
                "tied": self.tied.state_dict() if self.tied is not None else None}

    def load_state_dict(self, state: dict) -> None:
        mine = [self.n, self.rank] + [self.shard(g)[0] for g in self.param_groups]
        if list(state["shard"]) != mine:
            raise ValueError(f"the checkpoint's optimizer slice is replica {state['shard'][1]} of {state['shard'][0]} "
                             f"over {state['shard'][2:]} elements; this run's is {self.rank} of {self.n} "
                             f"over {mine[2:]} (resume onto the same pipeline.shard and data_parallel)")
        self.steps = int(state["steps"])
        self.moments = [None if m is None else (m[0].clone(), m[1].clone()) for m in state["moments"]]
        if self.tied is not None and state["tied"] is not None:
            self.tied.load_state_dict(state["tied"])
