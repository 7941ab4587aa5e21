"""Execute one rank's share of a Schedule with real tensors: walk its lowered action list,
posting sends and receives with ``batch_isend_irecv`` (matched by the lowering's tags),
running F, B and the zero-bubble I/W (:mod:`pipeflow.runtime.backward`), and at the
first STEP the replicas' reductions, the tied embedding's sum, the world all-reduce of
norm and loss, the clip and the updates (docs/runtime.md, "How the runtime executes a
schedule")."""

from __future__ import annotations

import contextlib
import functools

import math
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..device_paths import cuda_path
from ..formats.timeline import Event
from ..schedules.ir import Action, Kind
from ..formats.runplan import Lowered
from ..schedules.lowering import Comm
from .adapters import Adapter
from .backward import accumulators, backward_input, backward_weight
from .saved_bytes import SavedBytes
from . import memory_profile
from .memory_profile import tag, tag_stage
from .messages import MessageIO
from .op_trace import SYNC_SCOPE
from .optimizer import square_sum
from .mixed_precision import LossScaler, Precision
from ..models.tensor_parallel import reduce_partial_gradients
from .sharded import gather_handlers
from .stage import Groups, Messages, StageState, StepStats, sync_tied


def clip_gradients(grads: list[torch.Tensor], norm: float | torch.Tensor, clip: float) -> None:
    """Scale ``grads`` in place by ``clip / (norm + 1e-6)`` where that is under 1. ``norm`` a
    float: the host decides; a device tensor: the factor, at most 1, is applied on the
    device with no host wait. The same gradients, bit for bit, either way."""
    if isinstance(norm, torch.Tensor):
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return
    coef = clip / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


@contextlib.contextmanager
def no_syncs(on: bool):
    """``on``: the block runs under ``torch.cuda.set_sync_debug_mode("error")``, so that any
    call in it that makes the host wait for a CUDA device raises, naming itself."""
    if not on:
        yield
        return
    was = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(was)


class Executor(MessageIO):
    def __init__(
        self,
        lowered: Lowered,
        device: int,
        stages: dict[tuple[int, int], StageState],
        adapter: Adapter,
        groups: Groups,
        grad_clip: float | None,
        on_grads: Callable[[dict[tuple[int, int], StageState]], None] | None = None,
        precision: Precision | None = None,
        p2p: str = "tagged",
        mesh=None,
    ):
        # ``device``: the index of the device this rank runs (its orders' and events'); with
        # tensor parallelism this rank is one of the device's ranks, and messages go to the
        # same tensor rank of another device (runtime.mesh)
        self._rank_of = (lambda d: d) if mesh is None else mesh.rank_of
        self._tensor = getattr(adapter, "tensor", None)
        self._staged_p2p = None  # messages pass through host memory where gloo serves a GPU (MessageIO._staged)
        self.precision = precision or Precision("fp32", adapter.device.type)
        self.scaler = LossScaler(self.precision.loss_scale) if self.precision.name == "fp16" else None
        self._skip = False  # fp16: this step's gradients overflowed
        # the host reads the clip norm mid-step (_synchronise) where that costs no wait (a
        # CPU rank's tensors are the host's); on an accelerator it is read at the step's end
        # (runtime.cuda_paths=[reads]: a CPU rank takes the accelerator's branch)
        self.host_reads = not cuda_path("reads", adapter.device)
        # runtime.sync_check (a test hook, CUDA ranks): the walk of a step under
        # torch.cuda.set_sync_debug_mode("error"); the worker sets it from the second step
        self.sync_check = False
        self.sent_bytes = 0  # bytes this rank sent to other ranks (activations and gradients)
        schedule = lowered.schedule
        self.lowered = lowered
        self.segmented = schedule.num_segments > 1
        if self.segmented and schedule.uses_split_backward():
            raise NotImplementedError("sequence segments run full backwards (B), not I/W splits")
        self.schedule = schedule
        self._positions = None  # action -> (device, index): which sends a message proves arrived
        self.device = device
        self.stages = stages
        self.adapter = adapter
        self.groups = groups
        self.grad_clip = grad_clip
        self.on_grads = on_grads
        # "ordered": no tags; every pair's receives posted in the order its sender sends,
        # so the messages pair up as NCCL (which ignores tags) pairs them
        self.ordered = p2p == "ordered"
        items = (lowered.paired if self.ordered else lowered.per_device)[device]  # (paired once, for the job)
        self.placement = schedule.placement
        self.graph = schedule.graph
        self.steps, self.tail = _post_ahead(items)
        # an overlapped F&B pair starts once both halves' inputs are in (the backward's
        # receives are posted before the forward runs); on CPU the halves then run in turn
        self.partner = schedule.overlap_partner()
        # bytes autograd saves for backward (and Seq1F1B's K/V cache), parameters excluded
        # the model's own tensors (parameters, and buffers such as position ids) are not activations
        self.meter = SavedBytes({t.untyped_storage().data_ptr() for st in stages.values()
                                 for t in (*st.module.parameters(), *st.module.buffers())})
        # forward-only walk for evaluation: the forwards and the activation messages, in
        # the same per-device order (a subsequence of a deadlock-free order is one too)
        self.eval_steps, self.eval_tail = _post_ahead(
            [x for x in items if (isinstance(x, Comm) and not x.grad) or (isinstance(x, Action) and x.kind == Kind.F)]
        )

    # ---- the walk ---------------------------------------------------------------------
    def _walk(self, steps, tail, handlers: dict, record: bool = False, t0: float | None = None,
              before: Callable | None = None, after: Callable | None = None) -> tuple[float, list, "Messages"]:
        """Walk a lowered action list once: post each step's messages, wait for the action's
        inputs, run its kind's handler (``before(a)`` untimed ahead of the wait, ``after(a, pos)``
        timed), record it. Every executor is this walk with its own handlers. Returns (busy
        seconds, events, the messages), the tail's posted; :meth:`_finish` completes them."""
        io = Messages()
        busy = 0.0
        events: list[Event] = []
        t0 = time.perf_counter() if t0 is None else t0
        for pos, (posts, a) in enumerate(steps):
            self._flush(posts, io.outbox, io.inbox, io.sends)
            if before is not None:
                before(a)
            self._await_inputs(a, io.inbox, io.sends)
            if a in self.partner:
                self._await_inputs(self.partner[a], io.inbox, io.sends)
            handler = handlers.get(a.kind)
            if handler is None:
                raise NotImplementedError(f"{a}: {type(self).__name__} runs {', '.join(map(str, handlers))} actions")
            start = time.perf_counter()
            with memory_profile.action(a):
                handler(a, io)
                if after is not None:
                    after(a, pos)
            end = time.perf_counter()
            if a.kind not in Kind.COLLECTIVE:  # REDUCE and GATHER only issue an asynchronous collective
                busy += end - start
            if record:
                events.append(
                    Event(self.device, str(a), a.kind, a.stage, a.microbatch, a.pipe, a.segment, start - t0, end - t0,
                          "collective" if a.kind in Kind.COLLECTIVE else "compute")
                )
        self._flush(tail, io.outbox, io.inbox, io.sends)
        return busy, events, io

    def _finish(self, io: "Messages", what: str) -> None:
        """Wait for the walk's sends; nothing may be left unconsumed."""
        for work, *_ in io.sends:
            work.wait()
        if io.inbox or io.outbox or io.local:
            raise RuntimeError(
                f"device {self.device}: messages left over after the {what}: "
                f"{sorted(list(io.inbox) + list(io.outbox) + list(io.local))[:6]}"
            )

    def _compute_handlers(self, batch, normalizer, loss_sum: torch.Tensor) -> dict:
        """F, B, I and W: the handlers both executors share (the forward adds its loss to ``loss_sum``)."""
        return {
            Kind.F: functools.partial(self._forward, batch=batch, normalizer=normalizer, into=loss_sum),
            Kind.B: lambda a, io: self._backward(a, io.inbox, io.local, io.outbox, full=True),
            Kind.I: lambda a, io: self._backward(a, io.inbox, io.local, io.outbox, full=False),
            Kind.W: lambda a, io: self._weight(a),
        }

    # ---- one iteration ----------------------------------------------------------------
    def train_step(self, batch, normalizer: float, lr: float, record: bool = False, t0: float | None = None) -> StepStats:
        """Run this rank's actions for one iteration; ``busy`` in the result is this
        rank's compute time (the caller reduces it across ranks if it wants the total)."""
        reduces: list = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.adapter.device)
        synced: list[tuple[float, float]] = []

        def before(a: Action) -> None:
            if a.kind == Kind.STEP and not synced:
                # the world all-reduce for the clip norm and the loss: not compute, not busy
                with torch.profiler.record_function(SYNC_SCOPE):  # runtime.trace_steps: the optimizer's class
                    synced.append(self._synchronise(reduces, loss_sum))

        def step(a: Action, io) -> None:
            st = self.stages[(a.pipe, a.stage)]
            if not self._skip:  # fp16: a step whose gradients overflowed is skipped
                for group in st.optimizer.param_groups:
                    group["lr"] = lr
                st.optimizer.step()
                torch.clear_autocast_cache()  # its casts are of the old weights
            tag_stage(st.module, st.optimizer)  # runtime.memory=profile: name what the stage holds
            st.optimizer.zero_grad(set_to_none=True)

        handlers = {**self._compute_handlers(batch, normalizer, loss_sum),
                    Kind.REDUCE: lambda a, io: reduces.append(self._reduce(a)), Kind.STEP: step}
        if self.schedule.shard == "full":  # ZeRO-3: the schedule's GATHERs and FREEs
            handlers = gather_handlers(self.stages, self.meter, handlers)
        with self.precision.shared_casts():
            with no_syncs(self.sync_check):
                busy, events, io = self._walk(self.steps, self.tail, handlers, record, t0, before=before)
                self._finish(io, "iteration")
        if not synced:
            raise RuntimeError(f"schedule {self.schedule.name!r} has no STEP on device {self.device}; nothing was updated")
        grad_norm, loss, scale = synced[0]
        # (read now, the step's work launched: on an accelerator the step's one wait)
        return StepStats(float(loss), float(grad_norm), busy, events, loss_scale=scale, skipped=self._skip)

    def _forward(self, a: Action, io: Messages, batch, normalizer, into: torch.Tensor | None = None) -> torch.Tensor:
        """Run a stage forward (F's handler; a last stage's loss added ``into`` the walk's sum). A
        source stage reads the batch; others get their predecessors' outputs as leaves (one
        tensor, or a dict by predecessor stage)."""
        inbox, local, outbox = io.inbox, io.local, io.outbox
        st = self.stages[(a.pipe, a.stage)]
        key = (a.microbatch, a.segment)
        preds = self.graph.preds[a.stage]
        leaves: dict[int, torch.Tensor] = {}
        batch, mb, normalizer = self._locate(a, batch, normalizer)
        if not preds:
            x = self._source_input(batch, a, mb)
        else:
            for p in preds:
                t = self._take((False, p, a.stage, a.microbatch, a.pipe, a.segment), inbox, local)
                got = self.precision.arrived(t)
                if got is not t:  # restored to fp32: kept for the backward (memory=profile names it)
                    tag(got, "activations")
                leaves[p] = got.detach().requires_grad_(True)
            # at 16 bits the module sees a view of each leaf: autocast caches its cast of
            # a leaf that requires grad (meant for weights) until the step's outer context
            # ends, so a stage whose first product reads its input (BERT's Q, K, V) kept
            # every microbatch's cast through the step
            views = leaves if self.precision.dtype is None else {p: v.view_as(v) for p, v in leaves.items()}
            x = views[preds[0]] if len(preds) == 1 else views
        with self._hooks(st), self.precision.autocast():
            out = self._run_module(st, a, x)
            # the loss's log-softmax is kept for the backward too: counted with the rest
            loss = self.adapter.loss(out, batch, mb, normalizer, a.segment) if st.last else None
        if st.last:
            # fp16: the backward runs on the scaled loss (see LossScaler)
            st.saved[key] = (leaves, loss if self.scaler is None else loss * self.scaler.scale)
            loss = loss.detach().double()
            if into is not None:
                into.add_(loss)
            return loss
        st.saved[key] = (leaves, out)
        for succ in self.graph.succs[a.stage]:
            dev = self.placement.device(a.pipe, succ)
            self._emit((False, a.stage, succ, a.microbatch, a.pipe, a.segment), out.detach(), outbox, local, dev)
        return torch.zeros((), dtype=torch.float64, device=self.adapter.device)

    def _hooks(self, st: StageState):
        """The saved-tensor hooks a forward runs under: the byte count here; the
        asynchronous executor adds its weight versions."""
        return self.meter.hooks()

    def _run_module(self, st: StageState, a: Action, x):
        if not self.segmented:
            return st.module(x)
        # Seq1F1B: the segment attends over the keys/values of the microbatch's earlier
        # segments, taken as leaves so that their gradient is collected here and handed
        # to those segments' own backwards (no backward runs through another's graph)
        cache = st.kv.setdefault(a.microbatch, {})
        prefix = None
        if a.segment > 0:
            # one leaf per earlier segment, per block: a detached view of that segment's
            # own keys/values (no copy), whose .grad is that segment's share
            earlier = [cache[j][0] for j in range(a.segment)]
            prefix = [
                (tuple(kv[i][0].detach().requires_grad_(True) for kv in earlier),
                 tuple(kv[i][1].detach().requires_grad_(True) for kv in earlier))
                for i in range(len(earlier[0]))
            ]
        out, kvs = st.module.forward_segment(x, self.adapter.segment_offset(a.segment), prefix)
        # held (and counted) until this segment's backward, the last segment's too
        holds = [self.meter.hold(t) for kv in kvs for t in kv]
        cache[a.segment] = (kvs, prefix, holds)
        return out

    def _segment_backward(self, a: Action, st: StageState, out, g) -> None:
        """Backward of one segment: its output gradient plus the gradient later segments
        sent to its keys/values; then its prefix leaves' gradients go to the earlier ones."""
        cache = st.kv[a.microbatch]
        kvs, prefix, _holds = cache.pop(a.segment)
        tensors, grads = [out], [g]
        extra = st.kv_grad.pop((a.microbatch, a.segment), None)
        if extra is not None:
            for (k, v), (dk, dv, _) in zip(kvs, extra):
                tensors += [k, v]
                grads += [dk, dv]
        torch.autograd.backward(tensors, grad_tensors=grads)
        if prefix is not None:
            for i, (keys, values) in enumerate(prefix):
                for j, (kl, vl) in enumerate(zip(keys, values)):
                    acc = st.kv_grad.setdefault((a.microbatch, j), [None] * len(prefix))
                    dk, dv = (kl.grad, vl.grad) if acc[i] is None else (acc[i][0] + kl.grad, acc[i][1] + vl.grad)
                    # counted from here until segment j's backward takes them
                    acc[i] = (dk, dv, (self.meter.hold(dk), self.meter.hold(dv)))
        if not cache:
            del st.kv[a.microbatch]

    def _locate(self, a: Action, batch, normalizer):
        """(batch, index in it, normalizer) of the action's microbatch: one batch per
        iteration here; an asynchronous chunk spans several (AsyncExecutor)."""
        return batch, a.microbatch, normalizer

    def _source_input(self, batch, a: Action, mb: int):
        return self.adapter.stage_input(batch, mb, a.stage, a.segment)

    def _output_grad(self, a: Action, st: StageState, inbox, local):
        if st.last:
            return None  # the output is the loss itself
        # an output read by several successors gets the sum of their gradients
        grads = [
            self._take((True, a.stage, t, a.microbatch, a.pipe, a.segment), inbox, local)
            for t in self.graph.succs[a.stage]
        ]
        return grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)

    def _send_input_grads(self, a: Action, leaves: dict, grads, outbox, local) -> None:
        for (pred, leaf), g in zip(leaves.items(), grads):
            if g is None:  # an input this stage did not use in this microbatch
                g = torch.zeros_like(leaf)
            dev = self.placement.device(a.pipe, pred)
            self._emit((True, pred, a.stage, a.microbatch, a.pipe, a.segment), g, outbox, local, dev)

    def _backward(self, a: Action, inbox, local, outbox, full: bool) -> None:
        st = self.stages[(a.pipe, a.stage)]
        key = (a.microbatch, a.segment)
        g = self._output_grad(a, st, inbox, local)
        leaves, out = st.saved.pop(key)
        if g is not None and g.dtype != out.dtype:  # it travelled in the compute dtype
            g = g.to(out.dtype)
        if full:
            if self.segmented:
                self._segment_backward(a, st, out, g)
            else:
                torch.autograd.backward(out, grad_tensors=g)
            self._send_input_grads(a, leaves, [leaf.grad for leaf in leaves.values()], outbox, local)
            return
        if st.accumulators is None:
            st.accumulators = accumulators(st.params)
        grads, st.pending_w[key] = backward_input(out, g, list(leaves.values()), st.params, st.accumulators,
                                                  keep=self.meter.keep)
        if leaves:
            self._send_input_grads(a, leaves, grads, outbox, local)

    def _weight(self, a: Action) -> None:
        st = self.stages[(a.pipe, a.stage)]
        backward_weight(st.pending_w.pop((a.microbatch, a.segment)), st.params)

    # ---- gradient synchronisation -----------------------------------------------------
    def _reduce(self, a: Action):
        group = self.groups.replica_group.get(a.stage)
        if group is None:
            return None
        st = self.stages[(a.pipe, a.stage)]
        self._tensor_partials(st)
        if getattr(st.optimizer, "scatter", False):  # ZeRO-2: into this replica's slice (runtime.sharded)
            return (st.optimizer, st.optimizer.reduce_scatter())
        tied = {id(p) for p in st.tied}
        params = [p for p in st.params if id(p) not in tied]  # the tied copies are summed separately
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=group, async_op=True)
        return (work, flat, params, grads)

    def _tensor_partials(self, st: StageState) -> None:
        """Tensor parallelism: sum across the stage's ranks the gradients they hold in parts
        (sequence-parallel norms and biases, replicated key/value heads), once a step."""
        if self._tensor is not None and not st.tensor_reduced:
            reduce_partial_gradients(st.params)
            st.tensor_reduced = True

    def _synchronise(self, reduces, loss_sum: torch.Tensor
                     ) -> tuple[float | torch.Tensor, float | torch.Tensor, float | None]:
        for st in self.stages.values():  # runtime.memory=profile: the gradients the reductions replace
            tag_stage(st.module, None)
            self._tensor_partials(st)
        for r in reduces:
            if r is None:
                continue
            if len(r) == 2:  # ZeRO-2: the slices become the optimizer's gradients
                r[0].finish(r[1])
                continue
            work, flat, params, grads = r
            work.wait()
            for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
                if p.grad is None:
                    p.grad = g.view_as(p).clone()
                else:  # in place: a new gradient beside the old one (still listed) is a third copy
                    p.grad.copy_(g.view_as(p))
            # the flat goes now, before the optimizer steps and the clip norm's temporaries
            # (not when gloo's thread lets go of its work, which races with them)
            flat.untyped_storage().resize_(0)
        reduces.clear()
        sync_tied([p for st in self.stages.values() for p in st.tied], self.groups.tied_group)
        scale = None if self.scaler is None else self.scaler.scale
        # in stage order, as every replica of them calls their blocking collectives (Chimera's
        # mirror replicas hold their stages in opposite orders)
        scattered = [st.optimizer for _, st in sorted(self.stages.items(), key=lambda kv: kv[0][::-1])
                     if getattr(st.optimizer, "scatter", False)]
        slices = [g for opt in scattered for g in opt.slices()]  # ZeRO-2/3: this replica's of the gradients
        if scale is not None:  # fp16: back to the true gradients (an overflow stays inf)
            for st in self.stages.values():
                for p in st.params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / scale)
            for g in slices:
                g.mul_(1.0 / scale)
        if self.on_grads is not None:
            for opt in scattered:  # the dump's whole gradients, gathered (a test hook's cost)
                opt.whole_gradients()
            self.on_grads(self.stages)
            for opt in scattered:
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = None
        # one world all-reduce: the squared gradient norm (each parameter counted once:
        # replicas only on pipe 0, the tied embedding only on the first stage) and the loss
        # (ZeRO-2: every replica's slices, each part of the gradient on one replica only)
        sq = torch.zeros((), dtype=torch.float64, device=self.adapter.device)
        for (pipe, stage), st in self.stages.items():
            tied = {id(p) for p in st.tied}
            for p in st.params:
                if p.grad is not None and pipe == 0 and (id(p) not in tied or st.first):
                    # (tensor parallelism: a parameter its device's ranks hold whole, once)
                    sq += square_sum(p.grad) / getattr(p, "_tp_copies", 1)
        for opt in scattered:
            sq += opt.squares()
        for st in self.stages.values():
            st.tensor_reduced = False
        vec = torch.stack([sq, self._once(loss_sum).double()])
        dist.all_reduce(vec)
        grads = [p.grad for st in self.stages.values() for p in st.params if p.grad is not None] + slices
        if self.host_reads or self.scaler is not None:
            # (fp16: whether to skip the step is the host's to decide, from the norm)
            norm = math.sqrt(vec[0].item())
            # every rank sees the same norm, so every rank skips the same steps
            self._skip = self.scaler is not None and not self.scaler.update(math.isfinite(norm))
            if self.grad_clip and not self._skip:
                clip_gradients(grads, norm, self.grad_clip)
            return norm, vec[1].item(), scale
        # on an accelerator the host does not wait for the norm: the clip's factor stays on
        # the device, and the norm and the loss are read when the step has been launched
        # (train_step)
        self._skip = False
        norm = vec[0].sqrt()
        if self.grad_clip:
            clip_gradients(grads, norm, self.grad_clip)
        return norm, vec[1], scale

    def _once(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss every tensor rank of a device computed alike: counted by the first alone."""
        return loss if self._tensor is None or self._tensor.rank == 0 else torch.zeros_like(loss)

    # ---- evaluation -------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batch, normalizer: float) -> float:
        """The loss of a forward-only walk (the forwards and their messages)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.adapter.device)
        forward = self._compute_handlers(batch, normalizer, loss_sum)[Kind.F]

        def evaluate(a: Action, io) -> None:
            forward(a, io)
            st = self.stages[(a.pipe, a.stage)]
            st.saved.pop((a.microbatch, a.segment), None)
            if self.segmented and a.segment + 1 == self.schedule.num_segments:
                st.kv.pop(a.microbatch, None)  # the microbatch's last segment: its K/V are done

        _, _, io = self._walk(self.eval_steps, self.eval_tail, {Kind.F: evaluate})
        self._finish(io, "evaluation")
        vec = self._once(loss_sum).reshape(1).clone()
        dist.all_reduce(vec)
        return vec.item()


def _post_ahead(items: list) -> tuple[list[tuple[list[Comm], Action]], list[Comm]]:
    """Group a lowered list into (messages to post, action) steps: before action i, the sends
    of i-1 and the receives of i and i+1 (posted one action early, gloo can move data while
    the rank computes; receives never block, so this cannot deadlock)."""
    actions: list[Action] = []
    recvs: list[list[Comm]] = []
    sends: list[list[Comm]] = [[]]  # sends[i + 1]: the sends that follow action i
    pending: list[Comm] = []
    for x in items:
        if isinstance(x, Comm):
            (pending if x.op == "recv" else sends[-1]).append(x)
        else:
            actions.append(x)
            recvs.append(pending)
            pending = []
            sends.append([])
    plan = []
    for i, a in enumerate(actions):
        posts = list(sends[i]) + ([] if i else recvs[0]) + (recvs[i + 1] if i + 1 < len(actions) else [])
        plan.append((posts, a))
    return plan, sends[-1] + pending


