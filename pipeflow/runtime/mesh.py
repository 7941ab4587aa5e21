"""Where a rank sits in the job's device mesh (data x pipeline x tensor), and the process
groups it needs beyond the schedule's own. With ``pipeline.tensor_parallel=T`` device d
is ranks d*T .. d*T+T-1 (tensor innermost); messages and device groups go between ranks
of the same ``t``. Groups come from :func:`~pipeflow.runtime.device.new_group`, under the
job's ``runtime.timeout_s`` (torch's DeviceMesh would give its own 30 minutes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..models.tensor_parallel import TensorGroup
from .device import new_group
from .memory_profile import released


@dataclass
class RankMesh:
    """This rank's place: ``device`` (the schedule's), ``t`` of ``tensor`` ranks there."""

    tensor: int = 1
    device: int = 0
    t: int = 0

    def rank_of(self, device: int) -> int:
        """The rank that talks to this one on ``device``: the same tensor rank."""
        return device * self.tensor + self.t

    def new_group(self, devices: list[int]):
        """A group over ``devices`` (this rank's tensor rank of each): every rank calls
        this with the same devices, in the same order, as ``dist.new_group``."""
        if self.tensor == 1:
            return new_group(devices)
        mine = None
        for t in range(self.tensor):
            group = new_group([d * self.tensor + t for d in devices])
            if t == self.t:
                mine = group
        return mine


def build_mesh(rank: int, num_devices: int, tensor: int, sequence_parallel: bool,
               n_head: int, n_kv_head: int | None) -> tuple[RankMesh, TensorGroup | None]:
    """This rank's :class:`RankMesh` and, with T > 1, its tensor group (collective: every
    rank calls it)."""
    mesh = RankMesh(tensor, rank // tensor, rank % tensor)
    if tensor == 1:
        return mesh, None
    group = None
    for d in range(num_devices):  # every rank makes every device's group, in one order
        g = new_group([d * tensor + t for t in range(tensor)])
        if d == mesh.device:
            group = g
    n_kv = n_kv_head or n_head
    kv_group, copies = None, 1
    if n_kv < tensor:  # replicated key/value heads: the ranks holding the same head sum its gradient
        copies = tensor // n_kv
        for d in range(num_devices):
            for k in range(n_kv):
                ranks = [d * tensor + k * copies + i for i in range(copies)]
                g = new_group(ranks)
                if rank in ranks:
                    kv_group = g
    tp = TensorGroup(tensor, mesh.t, group, sequence_parallel, kv_group, copies,
                     gloo=dist.get_backend(group) == dist.Backend.GLOO, released=released)
    return mesh, tp
