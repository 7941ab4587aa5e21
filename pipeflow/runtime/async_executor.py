"""Execute an asynchronous schedule (pipedream, pipedream_2bw, amdp): ``windows`` steps per call without a
flush, each replica keeping the real weight versions its policy needs (saved parameters become
(parameter, version) references). docs/runtime.md tells how the versions, reductions and tied copies are
kept."""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..schedules.ir import Action, Kind, WeightPolicy
from ..formats.runplan import Lowered
from ..schedules.versions import forward_version
from .executor import Executor, Groups, StageState, no_syncs
from .memory_profile import tag, tag_stage
from .op_trace import SYNC_SCOPE
from .optimizer import square_sum

KEEP = (WeightPolicy.STASH, WeightPolicy.DOUBLE_BUFFER)  # backward uses the forward's version


class ReplicaVersions:
    """The weight versions of one replica: the live parameters plus stashed copies."""

    def __init__(self, params: list[torch.nn.Parameter], policy: WeightPolicy, live: int = 0):
        self.params = params
        self.policy = policy
        self.live = live  # updates applied so far (across chunks)
        self.stash: dict[int, list[torch.Tensor]] = {}
        self.refs: Counter = Counter()  # version -> in-flight microbatches that saved it
        self.peak_versions = 1

    def tensors(self, version: int) -> list[torch.Tensor]:
        if version == self.live:
            return [p.detach() for p in self.params]
        return self.stash[version]

    def tensor(self, version: int, i: int) -> torch.Tensor:
        """Parameter ``i`` at ``version`` (what a backward unpacks, once per saved weight)."""
        return self.params[i].detach() if version == self.live else self.stash[version][i]

    def before_update(self) -> None:
        """Copy the live version aside if anything will still compute with it."""
        v = self.live
        need = self.refs[v] > 0 or self.policy == WeightPolicy.DOUBLE_BUFFER
        if self.policy in KEEP and need and v not in self.stash:
            self.stash[v] = [p.detach().clone() for p in self.params]
            for t in self.stash[v]:
                tag(t, "weight_versions")  # runtime.memory=profile

    def after_update(self) -> None:
        self.live += 1
        self._free()

    def release(self, version: int) -> None:
        self.refs[version] -= 1
        self._free()

    def _free(self) -> None:
        keep_from = self.live - 1 if self.policy == WeightPolicy.DOUBLE_BUFFER else self.live
        for v in [v for v in self.stash if v < keep_from and self.refs[v] <= 0]:
            del self.stash[v]
        self.peak_versions = max(self.peak_versions, 1 + len(self.stash))


@contextmanager
def weight_version(vers: ReplicaVersions, version: int, meter=None):
    """Run a forward with weight ``version`` of a replica; its backward sees that version (stash,
    double_buffer) or the current weights. Other saved tensors go to ``meter``."""
    tensors = vers.tensors(version)
    swapped = None
    if version != vers.live:  # 2BW: compute with the previous version's copy
        swapped = [p.data for p in vers.params]
        for p, t in zip(vers.params, tensors):
            p.data = t
    index = {t.untyped_storage().data_ptr(): i for i, t in enumerate(tensors)}
    keep = vers.policy in KEEP

    def pack(t: torch.Tensor):
        i = index.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if i is None:
            return t if meter is None else meter.pack(t)
        return (i, version, t.size(), t.stride(), t.storage_offset())

    def unpack(obj):
        if not isinstance(obj, tuple):
            return obj if meter is None else meter.unpack(obj)
        i, v, size, stride, offset = obj
        src = vers.tensor(v, i) if keep else vers.params[i].detach()
        return src.as_strided(size, stride, offset)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        if swapped is not None:
            for p, t in zip(vers.params, swapped):
                p.data = t


@dataclass
class ChunkStats:
    losses: list[float]  # per step of the chunk (sum of its normalised microbatch losses)
    grad_norms: list[float]  # per step: root mean square over its updates of the global update norm
    busy: float
    records: list[dict]  # staleness records of this rank
    events: list = field(default_factory=list)
    loss_scale: float | None = None  # fp16 (synchronous steps): the scale the step's backward ran with
    skipped: bool = False  # fp16: the step's gradients overflowed and no update was applied

    @classmethod
    def of(cls, step) -> "ChunkStats":
        """A synchronous step's :class:`~.stage.StepStats` as a chunk of one step."""
        return cls([step.loss], [step.grad_norm], step.busy, [], step.events, step.loss_scale, step.skipped)


class AsyncExecutor(Executor):
    def __init__(self, lowered: Lowered, device: int, stages: dict[tuple[int, int], StageState], adapter,
                 groups: Groups, grad_clip: float | None, on_grads=None, precision=None, p2p: str = "tagged",
                 keep_first_grads: bool = False):
        schedule = lowered.schedule
        if schedule.policy == WeightPolicy.SYNC:
            raise ValueError(f"schedule {schedule.name!r} is synchronous; use Executor")
        if schedule.uses_split_backward():
            raise NotImplementedError("asynchronous schedules run full backwards (B), not I/W splits")
        super().__init__(lowered, device, stages, adapter, groups, grad_clip, on_grads, precision, p2p)
        self.policy = schedule.policy
        self.m = schedule.microbatches_per_step
        self.windows = schedule.windows
        upd = schedule.update_of_microbatch
        self.updates = sorted(set(upd))
        self.updates_per_step = len(self.updates) // self.windows
        # the step (of the chunk) each update belongs to, for its learning rate
        self.step_of_update = {u: min(mb for mb in range(len(upd)) if upd[mb] == u) // self.m for u in self.updates}
        self.zero = schedule.zero
        self.owner = lowered.owners
        order = schedule.orders[device]
        # where each local replica's gradient of an update is complete
        self.take_after: dict[int, list[tuple[int, int, int]]] = {}
        last: dict[tuple[int, int, int], int] = {}
        for pos, a in enumerate(order):
            if a.kind in Kind.WEIGHT_GRAD:
                last[(a.pipe, a.stage, upd[a.microbatch])] = pos
        for key, pos in last.items():
            self.take_after.setdefault(pos, []).append(key)
        self._check_collective_order(order)
        self.tied_plan = self._plan_tied(lowered)
        for (pipe, stage), st in stages.items():
            if getattr(st, "versions", None) is None:
                st.versions = ReplicaVersions(st.params, self.policy)
        # the gradients update 0 applied, by name (a copy: runtime.dump_grads only; kept
        # always, it held a second set of the stage's gradients through the whole run)
        self.keep_first_grads = keep_first_grads
        self.first_grads: dict[str, torch.Tensor] = {}

    # ---- static plans -----------------------------------------------------------------
    def _check_collective_order(self, order: list[Action]) -> None:
        """ValueError unless (zero) each replica's REDUCE and STEP alternate per update."""
        if not self.zero:
            return
        seen: dict[tuple[int, int], list[str]] = {}
        for a in order:
            if a.kind in (Kind.REDUCE, Kind.STEP):
                seen.setdefault((a.pipe, a.stage), []).append(f"{a.kind}{a.version}")
        for key, ops in seen.items():
            want = [f"{k}{u}" for u in sorted({int(o[1:]) for o in ops}) for k in (Kind.REDUCE, Kind.STEP)]
            if self.groups.replica_group.get(key[1]) is not None and ops != want:
                raise ValueError(f"schedule {self.schedule.name!r}: replica {key} issues {ops[:6]}, "
                                 f"zero needs REDUCE and STEP of each update in turn")

    def _plan_tied(self, lowered: Lowered) -> dict[tuple[int, int, int], list[int]]:
        """(pipe, stage, update w) -> tied updates this replica applies at its STEP w."""
        tied_stages = {s for (_, s), st in self.stages.items() if st.tied}
        plan = lowered.tied.get(self.device, {})
        return {k: us for k, us in plan.items() if k[1] in tied_stages}

    # ---- data of a global microbatch --------------------------------------------------
    def _locate(self, a: Action, batch, normalizer):
        w, i = divmod(a.microbatch, self.m)
        return batch[w], i, normalizer[w]

    # ---- one chunk --------------------------------------------------------------------
    def train_chunk(self, batches: list, normalizers: list, lrs: list[float], base_update: int, base_mb: int,
                    record: bool = False, t0: float | None = None) -> ChunkStats:
        """Run ``len(batches)`` steps without a flush (ValueError unless ``windows``). ``base_update``:
        updates applied before the chunk; ``base_mb``: the run's id of its first microbatch."""
        if len(batches) != self.windows:
            raise ValueError(f"chunk of {len(batches)} steps for a schedule of {self.windows} windows")
        upd = self.schedule.update_of_microbatch
        losses = torch.zeros(self.windows, dtype=torch.float64, device=self.adapter.device)
        sq_norms = torch.zeros(len(self.updates), dtype=torch.float64, device=self.adapter.device)
        taken: dict[tuple[int, int, int], list] = {}
        reduces: dict[tuple[int, int, int], tuple] = {}
        tied_local: dict[int, list] = {}  # update -> [local sum, copies still to take]
        tied_work: dict[int, tuple] = {}
        fwd_v: dict[tuple[int, int, int], int] = {}
        applied: dict[tuple[int, int, int], int] = {}
        records: list[dict] = []
        tied_copies = {k: st for k, st in self.stages.items() if st.tied}
        for (pipe, stage), st in self.stages.items():
            if st.versions.live != base_update:
                st.versions.live = base_update  # a resumed run: its stash is gone, versions restart
                st.versions.stash.clear()

        def forward(a: Action, io) -> None:
            st = self.stages[(a.pipe, a.stage)]
            u = base_update + upd[a.microbatch]
            v = forward_version(self.policy, st.versions.live, u)
            if v != st.versions.live and v not in st.versions.stash:
                v = st.versions.live  # 2BW after a resume: the previous version is gone
            fwd_v[(a.pipe, a.stage, a.microbatch)] = v
            if self.policy in KEEP:
                st.versions.refs[v] += 1
            self._fwd_version = v  # the version _hooks swaps in for this forward
            losses[a.microbatch // self.m] += self._forward(a, io, batches, normalizers)

        def backward(a: Action, io) -> None:
            st = self.stages[(a.pipe, a.stage)]
            self._backward(a, io.inbox, io.local, io.outbox, full=True)
            f = fwd_v.pop((a.pipe, a.stage, a.microbatch))
            b = f if self.policy in KEEP else st.versions.live
            if self.policy in KEEP:
                st.versions.release(f)
            records.append({"pipe": a.pipe, "stage": a.stage, "microbatch": base_mb + a.microbatch,
                            "update": base_update + upd[a.microbatch], "forward": f, "backward": b})

        def reduce(a: Action, io) -> None:
            reduces[(a.pipe, a.stage, a.version)] = self._reduce_async(a, taken)

        def step(a: Action, io) -> None:
            st = self.stages[(a.pipe, a.stage)]
            applied[(a.pipe, a.stage, base_update + a.version)] = st.versions.live
            with torch.profiler.record_function(SYNC_SCOPE):  # runtime.trace_steps: the optimizer's class
                self._step(a, st, taken, reduces, tied_work, lrs, base_update, sq_norms)

        def after(a: Action, pos: int) -> None:
            for key in self.take_after.get(pos, ()):  # a replica's gradient of an update is complete
                self._take_grads(key, taken, tied_local, tied_work, tied_copies, base_update)

        handlers = {Kind.F: forward, Kind.B: backward, Kind.REDUCE: reduce, Kind.STEP: step}
        with no_syncs(self.sync_check):  # (runtime.sync_check: the chunk's walk reads nothing mid-way)
            busy, events, io = self._walk(self.steps, self.tail, handlers, record, t0, after=after)
        # tied updates no STEP of this chunk could take: apply them now, in order
        for (pipe, stage, w), us in sorted(self.tied_plan.items(), key=lambda kv: kv[0][2] < 0):
            if w == -1:
                st = self.stages[(pipe, stage)]
                for u in us:
                    self._apply_tied(st, u, tied_work, lrs, base_update, sq_norms, stage_first=st.first and pipe == 0)
        for r in reduces.values():
            if r is not None:
                r[0].wait()
        self._finish(io, "chunk")
        return self._chunk_stats(losses, sq_norms, busy, events, records, applied)

    def _chunk_stats(self, losses: torch.Tensor, sq_norms: torch.Tensor, busy: float, events: list,
                     records: list[dict], applied: dict) -> ChunkStats:
        """The chunk's stats, ``records`` completed; losses and norms summed over ranks (a collective)."""
        for rec in records:
            rec["applied"] = applied.get((rec["pipe"], rec["stage"], rec["update"]), rec["forward"])
            rec["mismatch"] = rec["backward"] - rec["forward"]
            rec["staleness"] = rec["applied"] - rec["forward"]
        # one all-reduce for the chunk's losses and update norms (not a flush: the chunk is over)
        vec = torch.cat([losses, sq_norms])
        dist.all_reduce(vec)
        step_losses = vec[: self.windows].tolist()
        norms = vec[self.windows:].tolist()
        per_step: list[list[float]] = [[] for _ in range(self.windows)]
        for u, sq in zip(self.updates, norms):
            per_step[self.step_of_update[u]].append(sq)
        grad_norms = [math.sqrt(sum(x) / len(x)) if x else 0.0 for x in per_step]
        return ChunkStats(step_losses, grad_norms, busy, records, events)

    # ---- forward with a weight version -------------------------------------------------
    def _hooks(self, st: StageState):
        return weight_version(st.versions, self._fwd_version, self.meter)

    # ---- gradients and updates ---------------------------------------------------------
    def _take_grads(self, key, taken, tied_local, tied_work, tied_copies, base_update) -> None:
        """The replica's gradient of update ``key[2]`` is complete: move it out of .grad."""
        pipe, stage, u = key
        st = self.stages[(pipe, stage)]
        tied = {id(p) for p in st.tied}
        grads = []
        for p in st.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = None
            tag(g, "gradients")  # runtime.memory=profile: held until the update applies it
            if id(p) in tied:
                entry = tied_local.get(u)
                if entry is None:  # the first local copy's gradient is the sum so far (no zeros beside it)
                    entry = tied_local[u] = [g, len(tied_copies)]
                else:
                    entry[0] += g
                entry[1] -= 1
                if entry[1] == 0:  # every local copy has its share: sum across the copies' ranks
                    total = tied_local.pop(u)[0]
                    group = self.groups.tied_group
                    work = dist.all_reduce(total, group=group, async_op=True) if group is not None else None
                    tied_work[u] = (work, total, [len(tied_copies)])  # [local copies still to apply it]
            else:
                grads.append(g)
        taken[key] = grads

    def _plain(self, st: StageState) -> list:
        tied = {id(p) for p in st.tied}
        return [p for p in st.params if id(p) not in tied]

    def _reduce_async(self, a: Action, taken):
        group = self.groups.replica_group.get(a.stage)
        if group is None:
            return None
        grads = taken[(a.pipe, a.stage, a.version)]
        flat = _flatten_dense_tensors(grads)
        if self.zero:
            work = dist.reduce(flat, dst=self.owner[a.stage], group=group, async_op=True)
        else:
            work = dist.all_reduce(flat, group=group, async_op=True)
        return (work, flat, grads)

    def _step(self, a: Action, st: StageState, taken, reduces, tied_work, lrs, base_update, sq_norms) -> None:
        key = (a.pipe, a.stage, a.version)
        grads = taken.pop(key)
        r = reduces.pop(key, None)
        if r is not None:
            work, flat, _ = r
            work.wait()
            grads = list(_unflatten_dense_tensors(flat, grads))
        plain = self._plain(st)
        u = base_update + a.version
        lr = lrs[self.step_of_update[a.version]]
        group = self.groups.replica_group.get(a.stage)
        owner = self.owner.get(a.stage, self.device) if group is not None else self.device
        counted = a.pipe == 0 if not self.zero or group is None else owner == self.device
        st.versions.before_update()
        if owner == self.device:
            sq = sum((square_sum(g) for g in grads), torch.zeros((), dtype=torch.float64, device=self.adapter.device))
            self._apply(st, plain, grads, lr, sq)
            if counted:
                sq_norms[a.version] += float(sq)
            if u == 0 and self.keep_first_grads:
                for name, p in st.module.named_parameters():
                    if any(p is q for q in plain):
                        self.first_grads[f"{a.pipe}:{name}"] = grads[[id(q) for q in plain].index(id(p))].clone()
        if self.zero and group is not None:  # the owner's parameters reach the other replicas
            flat = _flatten_dense_tensors([p.detach() for p in plain])
            dist.broadcast(flat, src=owner, group=group)
            if owner != self.device:
                with torch.no_grad():
                    for p, t in zip(plain, _unflatten_dense_tensors(flat, plain)):
                        p.copy_(t)
        for tu in self.tied_plan.get((a.pipe, a.stage, a.version), ()):
            self._apply_tied(st, tu, tied_work, lrs, base_update, sq_norms, stage_first=st.first and a.pipe == 0)
        st.versions.after_update()

    def _apply(self, st: StageState, params: list, grads: list, lr: float, sq) -> None:
        """One optimizer step over ``params`` with ``grads`` (the others untouched), clipped by their norm."""
        coef = 1.0
        if self.grad_clip:
            norm = math.sqrt(float(sq))
            if norm > self.grad_clip:
                coef = self.grad_clip / (norm + 1e-6)
        for p, g in zip(params, grads):
            # the taken gradient itself, not a copy (a copy held a second set of gradients
            # through every step; AdamW reads .grad, never writes it)
            p.grad = g.view_as(p) * coef if coef != 1.0 else g.view_as(p)
        for group in st.optimizer.param_groups:
            group["lr"] = lr
        st.optimizer.step()
        tag_stage(st.module, st.optimizer)  # runtime.memory=profile: name what the stage holds
        for p in st.params:
            p.grad = None

    def _apply_tied(self, st: StageState, u_local: int, tied_work, lrs, base_update, sq_norms, stage_first: bool):
        work, total, left = tied_work[u_local]
        left[0] -= 1
        if left[0] == 0:  # every local copy has applied it: let the gradient go (kept, each
            del tied_work[u_local]  # tied update's gradient lived to the end of the chunk)
        if work is not None:
            work.wait()
        sq = square_sum(total)
        self._apply(st, st.tied, [total] * len(st.tied), lrs[self.step_of_update[u_local]], sq)
        if stage_first:
            sq_norms[u_local] += float(sq)
        if base_update + u_local == 0 and self.keep_first_grads:
            for name, p in st.module.named_parameters():
                if any(p is q for q in st.tied):
                    self.first_grads[f"{st.pipe}:{name}"] = total.clone()
