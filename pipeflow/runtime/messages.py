"""How a rank's executor moves messages: posting a run of sends and receives as one
batch, waiting for the receives an action needs, handing a stage's output to the next
stage (another rank's, or one on this rank), and letting go of a send once a later
message from its peer proves it arrived (gloo reports a send complete only when
waited on). gloo moves host memory only: ranks computing on a GPU under gloo send a host
copy of each message and receive into host memory, copied to the device buffer (posted
with the receive, as NCCL's is) when the message is waited for."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..device_paths import cuda_path
from ..schedules.ir import Action, Kind
from ..schedules.lowering import Comm, action_positions, message_position
from .memory_profile import tag


class MessageIO:
    """The message half of :class:`~pipeflow.runtime.executor.Executor` (its attributes:
    ``adapter``, ``precision``, ``graph``, ``schedule``, ``device``, ``ordered``,
    ``sent_bytes``, ``_positions``)."""

    # ---- messages ---------------------------------------------------------------------
    def _key(self, c: Comm) -> tuple:
        return (c.grad, c.src_stage, c.dst_stage, c.microbatch, c.pipe, c.segment)

    def _flush(self, comms: list[Comm], outbox: dict, inbox: dict, sends: list) -> None:
        """Post a run of sends and receives as one batch; receives are waited for by
        the compute action that needs them, sends once a later message proves them
        arrived (:meth:`_drop_arrived`) or at the end of the iteration."""
        if not comms:
            return
        ops, held = [], []  # held: the device tensor of each op (its host copy travels under gloo)
        staged = self._staged()
        for c in comms:
            if c.op == "send":
                # autograd may hand back a strided view; the wire needs contiguous memory
                tensor = outbox.pop(self._key(c)).contiguous()
                self.sent_bytes += tensor.numel() * tensor.element_size()
                wire = tensor.to("cpu", copy=True) if staged else tensor  # (a host copy, on CPU too)
                ops.append(dist.P2POp(dist.isend, wire, self._rank_of(c.peer), tag=0 if self.ordered else c.tag))
            else:
                shape, dtype = self.adapter.message_spec(c.src_stage, c.dst_stage, c.segment)
                tensor = torch.empty(shape, dtype=self.precision.wire_dtype(dtype), device=self.adapter.device)
                tag(tensor, "inputs")
                wire = torch.empty(shape, dtype=tensor.dtype) if staged else tensor
                ops.append(dist.P2POp(dist.irecv, wire, self._rank_of(c.peer), tag=0 if self.ordered else c.tag))
            held.append(tensor)
        for c, op, tensor, work in zip(comms, ops, held, dist.batch_isend_irecv(ops)):
            if c.op == "send":
                # the tensor must live until the send completes (as NCCL's would, held alike
                # when a host copy is what travels); where its consumer runs
                key = self._key(c)
                sends.append((work, tensor, key, self._position(key, consumer=True)))
            else:
                inbox[self._key(c)] = (tensor, _Staged(work, op.tensor, tensor) if staged else work)

    def _staged(self) -> bool:
        """Messages pass through host memory: a GPU rank whose process group is gloo (or a
        CPU rank taking that path: ``runtime.cuda_paths=[staging]``)."""
        staged = self._staged_p2p
        if staged is None:
            staged = self._staged_p2p = (cuda_path("staging", self.adapter.device)
                                         and dist.get_backend() == dist.Backend.GLOO)
        return staged

    def _await_inputs(self, a: Action, inbox: dict, sends: list | None = None) -> None:
        if a.kind == Kind.F:
            keys = [(False, p, a.stage, a.microbatch, a.pipe, a.segment) for p in self.graph.preds[a.stage]]
        elif a.kind in Kind.BACKWARD:
            keys = [(True, a.stage, t, a.microbatch, a.pipe, a.segment) for t in self.graph.succs[a.stage]]
        else:
            return
        for key in keys:
            if key in inbox:
                buf, work = inbox[key]
                if work is not None:
                    work.wait()
                    inbox[key] = (buf, None)  # a gloo receive must not be waited on twice
        if sends:
            self._drop_arrived(sends, [key for key in keys if key in inbox])

    def _position(self, key: tuple, consumer: bool) -> tuple[int, int] | None:
        """(device, index in its order) of the action that consumes (``consumer``) or
        makes a message ``key`` (:func:`~pipeflow.schedules.lowering.message_position`)."""
        if self._positions is None:
            self._positions = action_positions(self.schedule)
        return message_position(self._positions, key, consumer)

    def _drop_arrived(self, sends: list, received: list) -> None:
        """Let go of the sends a received message proves complete. A message from a peer
        made by an action that comes after (in the peer's order) the action consuming one
        of our sends means the peer had that send: its tensor is no longer needed. gloo
        reports a send complete only when waited on, so without this every output and
        gradient a rank sent stayed alive to the end of the step (stage 0 of 1F1B kept
        all m outputs; the last stage all m gradients), measured with runtime.memory=profile."""
        done = set()
        for key in received:
            made = self._position(key, consumer=False)
            if made is None:
                continue
            for _work, _tensor, sent, used in sends:
                if used is not None and used[0] == made[0] and used[1] < made[1]:
                    done.add(sent)
        if done:
            _drop_sent(sends, done)

    def _take(self, key: tuple, inbox: dict, local: dict) -> torch.Tensor:
        """A message for this rank: from a receive (wait for it) or from a stage on this device."""
        if key in local:
            return local.pop(key)
        buf, work = inbox.pop(key)
        if work is not None:
            work.wait()
        return buf

    def _emit(self, key: tuple, tensor: torch.Tensor, outbox: dict, local: dict, dst_device: int) -> None:
        # a stage boundary is one whether or not it crosses ranks: the same dtype either way
        tag(tensor, "outputs")
        tensor = self.precision.wire(tensor)
        tag(tensor, "outputs")
        if dst_device == self.device:
            local[key] = tensor
        else:
            outbox[key] = tensor



class _Staged:
    """A receive into host memory for a device buffer: waiting for it copies the message over."""

    def __init__(self, work, host: torch.Tensor, device: torch.Tensor):
        self.work, self.host, self.device = work, host, device

    def wait(self) -> bool:
        self.work.wait()
        self.device.copy_(self.host)
        self.host = None
        return True


def _drop_sent(sends: list, done: set) -> None:
    """Wait for (at once: they are complete) and let go of the sends whose keys are in ``done``."""
    keep = []
    for entry in sends:
        if entry[2] in done:
            entry[0].wait()
        else:
            keep.append(entry)
    sends[:] = keep

