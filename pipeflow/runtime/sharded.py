"""ZeRO-1, 2 and 3 for a replicated stage (``pipeline.shard=optimizer``, ``gradients``,
``full``): each of a stage's n replicas keeps AdamW's moments for one n-th of the stage's
parameters laid end to end (one flat per weight-decay group, padded to a multiple of n),
updates that slice and all-gathers the others; ZeRO-2 reduce-scatters the gradients
into it. Built by hand: torch's ``ZeroRedundancyOptimizer`` shares whole tensors
(docs/training.md says more)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..schedules.ir import Kind
from .memory_profile import tag
from .optimizer import make_optimizer, square_sum, step_impl


class ShardedAdamW:
    """AdamW over one replica's slice of a stage's parameters, with a torch optimizer's face:
    ``param_groups``, ``step``, ``zero_grad``, ``state``, ``state_dict``, ``load_state_dict``
    (this replica's slice)."""

    def __init__(self, module: torch.nn.Module, optim, params: list, tied: list, group,
                 scatter: bool = False, full: bool = False) -> None:
        self.group, self.n, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.full = full  # ZeRO-3: the parameters too, gathered by the schedule's GATHERs
        self.scatter = scatter or full  # ZeRO-2/3: the stage's REDUCE reduce-scatters into ``gradients``
        # gloo has no reduce-scatter of its own (it all-reduces a clone of the input and keeps
        # the share): all-reducing the flat in place sends the same and copies nothing more;
        # its all-gather copies too (see _all_gather)
        self.via_allreduce = dist.get_backend(group) == "gloo"
        self.betas = (optim.beta1, optim.beta2)
        self.eps = optim.eps
        # optim.impl: fused, torch's kernel over each slice; else the single-tensor update
        # written out (foreach over one slice is the same update)
        self.fused = step_impl(getattr(optim, "impl", "auto"), params[0].device.type if params else "cpu") == "fused"
        lr = optim.lr
        tied_ids = {id(p) for p in tied}
        own = [p for p in params if id(p) not in tied_ids]
        # weight decay on matrices only, as make_optimizer
        self.param_groups = [
            {"params": [p for p in own if p.dim() >= 2], "weight_decay": optim.weight_decay, "lr": lr},
            {"params": [p for p in own if p.dim() < 2], "weight_decay": 0.0, "lr": lr}]
        self.tied = make_optimizer(module, optim, params=list(tied)) if tied else None
        # each group's parameters live end to end in one flat (padded to n shares), as
        # Megatron's distributed optimizer keeps them: a replica updates its share of the
        # flat in place and the all-gather writes the others' shares straight into it
        self.flats: list[torch.Tensor | None] = []
        with torch.no_grad():
            for group in self.param_groups:
                total, share, _ = self.shard(group)
                if not total:
                    self.flats.append(None)
                    continue
                first = group["params"][0]
                flat = torch.zeros(share * self.n, dtype=first.dtype, device=first.device)
                at = 0
                for p in group["params"]:
                    flat[at:at + p.numel()].copy_(p.view(-1))
                    p.data = flat[at:at + p.numel()].view_as(p)
                    at += p.numel()
                self.flats.append(flat)
        # ZeRO-3: this replica's share of each flat, kept; the flat's storage is let go
        # between a FREE and the next GATHER (the parameters stay views of it, as do the
        # tensors autograd saved of them, which see the gathered values again), and while
        # it is gathered the share is its part of it (a checkpoint loaded into the
        # gathered weights is loaded into the shares too)
        self.shards: list[torch.Tensor | None] = [None] * len(self.flats)
        self.gathering: list = []  # the all-gathers a GATHER started, waited on before compute
        if full:
            for i, (group, flat) in enumerate(zip(self.param_groups, self.flats)):
                if flat is not None:
                    _, share, start = self.shard(group)
                    self.shards[i] = flat[start:start + share].clone()
                    flat.untyped_storage().resize_(0)
        self._copies_of: dict = {}
        self.flats_device = params[0].device if params else torch.device("cpu")
        self.steps = 0
        self.moments: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.param_groups)
        # ZeRO-2: this replica's slice of each group's summed gradient, from reduce_scatter
        self.gradients: list[torch.Tensor | None] = [None] * len(self.param_groups)

    def shard(self, group: dict) -> tuple[int, int, int]:
        """(the flat's length, each replica's share, where this replica's starts)."""
        total = sum(p.numel() for p in group["params"])
        share = -(-total // self.n)
        return total, share, self.rank * share

    @property
    def state(self) -> dict:
        moments = {i: {"exp_avg": m[0], "exp_avg_sq": m[1]} for i, m in enumerate(self.moments) if m is not None}
        return {**moments, **({("tied", k): v for k, v in self.tied.state.items()} if self.tied else {})}

    # ---- ZeRO-3: the parameters, gathered and let go -----------------------------------
    @torch.no_grad()
    def gather(self) -> None:
        """GATHER: start the all-gather of the stage's parameters from every replica's
        share into their flats (:meth:`wait_gathered` before they are used)."""
        for i, (group, flat) in enumerate(zip(self.param_groups, self.flats)):
            if flat is None or flat.untyped_storage().nbytes():
                continue  # (already gathered)
            _, share, start = self.shard(group)
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            tag(flat, "parameters")
            flat[start:start + share].copy_(self.shards[i])
            self.shards[i] = flat[start:start + share]  # (while gathered the share is the flat's)
            self.gathering.append(self._all_gather(flat, start, share, async_op=True))

    def _all_gather(self, flat: torch.Tensor, start: int, share: int, async_op: bool = False):
        """Every replica's share of ``flat`` (this one's at ``start``) into all of it, in place. On
        gloo, whose all-gather keeps a copy of its output, the other shares are zeroed and the
        flat all-reduced in place instead (the same values, no copy)."""
        if self.via_allreduce:
            flat[:start].zero_()
            flat[start + share:].zero_()
            return dist.all_reduce(flat, group=self.group, async_op=async_op)
        return dist.all_gather_single(flat, flat[start:start + share], group=self.group, async_op=async_op)

    def wait_gathered(self) -> None:
        for work in self.gathering:
            work.wait()
        self.gathering = []

    def release(self) -> None:
        """FREE: let the gathered parameters go, this replica's share kept."""
        self.wait_gathered()
        for i, (group, flat) in enumerate(zip(self.param_groups, self.flats)):
            if flat is not None and flat.untyped_storage().nbytes():
                _, share, start = self.shard(group)
                self.shards[i] = flat[start:start + share].clone()
                flat.untyped_storage().resize_(0)

    def storages(self) -> set[int]:
        """Where the gathered flats live now (what the executor's meter must not count)."""
        return {f.untyped_storage().data_ptr() for f in self.flats if f is not None and f.untyped_storage().nbytes()}

    # ---- ZeRO-2: the gradients, reduce-scattered --------------------------------------
    @torch.no_grad()
    def reduce_scatter(self) -> list:
        """Start the reduce-scatter of the stage's gradients (the tied copies' apart), laid end to
        end per group, into this replica's share. Returns what :meth:`finish` waits on."""
        pending = []
        for i, group in enumerate(self.param_groups):
            total, share, _ = self.shard(group)
            if not total:
                continue
            params = group["params"]
            pieces = [p.grad.view(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                      for p in params]
            if share * self.n > total:
                pieces.append(torch.zeros(share * self.n - total, dtype=params[0].dtype, device=params[0].device))
            flat = torch.cat(pieces)
            del pieces
            for p in params:
                tag(p.grad, "gradients")  # runtime.memory=profile: what they were, before they go
                p.grad = None
            out = torch.empty(share, dtype=flat.dtype, device=flat.device)
            if self.via_allreduce:  # gloo: the same sum, in place, and the share kept at finish
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            else:
                work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
            pending.append((work, flat, out, i))
        return pending

    def finish(self, pending: list) -> None:
        """Wait for :meth:`reduce_scatter`; the slices become this replica's gradients."""
        for work, flat, out, i in pending:
            work.wait()
            if self.via_allreduce:
                share = out.numel()
                out.copy_(flat[self.rank * share:(self.rank + 1) * share])
            self.gradients[i] = out
            # the flat goes now, not when the backend's thread lets go of its work (a race)
            flat.untyped_storage().resize_(0)
        pending.clear()

    def slices(self) -> list[torch.Tensor]:
        """ZeRO-2: the gradient slices this replica holds (the clip norm's and the
        loss scale's), the tied copies' whole gradients apart."""
        return [g for g in self.gradients if g is not None]

    def squares(self) -> torch.Tensor:
        """ZeRO-2: the squared norm of this replica's slices (fp64), a parameter that the
        ranks of a tensor-parallel device each hold whole counted once among them."""
        total = torch.zeros((), dtype=torch.float64, device=self.flats_device)
        for i, g in enumerate(self.gradients):
            if g is None:
                continue
            copies = self._copies(i)
            total += square_sum(g) if copies is None else (g.double().pow(2) / copies).sum()
        return total

    def _copies(self, i: int) -> torch.Tensor | None:
        """Per element of group i's slice, how many tensor ranks hold its parameter whole
        (None where every one holds a piece or none is split)."""
        if i not in self._copies_of:
            group = self.param_groups[i]
            if all(getattr(p, "_tp_copies", 1) == 1 for p in group["params"]):
                self._copies_of[i] = None
            else:
                total, share, start = self.shard(group)
                flat = torch.ones(share * self.n, dtype=torch.float64, device=self.flats_device)
                at = 0
                for p in group["params"]:
                    flat[at:at + p.numel()] = float(getattr(p, "_tp_copies", 1))
                    at += p.numel()
                self._copies_of[i] = flat[start:start + share].clone()
        return self._copies_of[i]

    @torch.no_grad()
    def whole_gradients(self) -> None:
        """ZeRO-2: put the whole summed gradients back on the parameters, all-gathered from
        the slices (``runtime.dump_grads`` only; :meth:`zero_grad` lets them go again)."""
        for i, group in enumerate(self.param_groups):
            if self.gradients[i] is None:
                continue
            total, share, _ = self.shard(group)
            flat = torch.empty(share * self.n, dtype=self.gradients[i].dtype, device=self.gradients[i].device)
            dist.all_gather_single(flat, self.gradients[i], group=self.group)
            at = 0
            for p in group["params"]:
                p.grad = flat[at:at + p.numel()].view_as(p).clone()
                at += p.numel()

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        for i, group in enumerate(self.param_groups):
            total, share, start = self.shard(group)
            if not total:
                continue
            params = group["params"]
            # this replica's share of the parameters, in place (ZeRO-3: the share it keeps)
            param = self.shards[i] if self.full else self.flats[i][start:start + share]
            grad = self.gradients[i]  # ZeRO-2: the reduce-scattered slice itself
            if grad is None:  # ZeRO-1: the slice of the whole gradients, gathered
                grad = torch.zeros_like(param)
                for p, lo, hi, at in self._pieces(params, start, start + share):
                    if p.grad is not None:
                        grad[at:at + hi - lo] = p.grad.view(-1)[lo:hi]
            if self.moments[i] is None:
                self.moments[i] = (torch.zeros_like(param), torch.zeros_like(param))
            exp_avg, exp_avg_sq = self.moments[i]
            lr, decay = group["lr"], group["weight_decay"]
            if self.fused:  # torch's fused kernel over the slice, in place (no temporary)
                torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [],
                                    [torch.tensor(float(self.steps), device=param.device)], lr=lr, beta1=beta1,
                                    beta2=beta2, weight_decay=decay, eps=self.eps, amsgrad=False, maximize=False)
                del grad
                if not self.full:
                    self._all_gather(self.flats[i], start, share)
                continue
            # torch.optim.AdamW's single-tensor update (torch.optim.adam._single_tensor_adam),
            # its denominator computed in place (the same values, one temporary)
            if decay != 0:
                param.mul_(1 - lr * decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = float(self.steps)
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            denom = exp_avg_sq.sqrt().div_(bias_correction2**0.5).add_(self.eps)
            param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
            del grad, denom
            # every replica's updated share, straight into the flat the parameters view
            # (ZeRO-3: at the next GATHER)
            if not self.full:
                self._all_gather(self.flats[i], start, share)
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
        self.gradients = [None] * len(self.param_groups)
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


@contextlib.contextmanager
def whole_weights(stages: dict):
    """Every fully sharded stage's parameters gathered for a while (evaluation, writing
    and loading a checkpoint), let go after; nothing for the other levels."""
    opts = [st.optimizer for st in stages.values() if getattr(st.optimizer, "full", False)]
    for opt in opts:
        opt.gather()
    for opt in opts:
        opt.wait_gathered()
    try:
        yield
    finally:
        for opt in opts:
            opt.release()


def gather_handlers(stages: dict, meter, handlers: dict) -> dict:
    """A synchronous step's handlers under ``pipeline.shard=full``: GATHER starts the stage's
    all-gather, each compute action waits for it, FREE lets the parameters go; ``meter`` is
    told which storages are gathered weights, not activations."""
    def gather(a, io=None) -> None:
        opt = stages[(a.pipe, a.stage)].optimizer
        opt.gather()
        meter.exclude |= opt.storages()

    def free(a, io=None) -> None:
        opt = stages[(a.pipe, a.stage)].optimizer
        gone = opt.storages()
        opt.release()
        meter.exclude -= gone

    def gathered_first(handler):
        def run(a, io) -> None:
            opt = stages[(a.pipe, a.stage)].optimizer
            if getattr(opt, "gathering", None):
                opt.wait_gathered()
            handler(a, io)
        return run

    return {**{k: gathered_first(h) if k in Kind.COMPUTE else h for k, h in handlers.items()},
            Kind.GATHER: gather, Kind.FREE: free}
