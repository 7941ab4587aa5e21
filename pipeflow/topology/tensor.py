"""Tensor-parallel groups on a topology: each schedule device is T consecutive physical
devices of one node (``pipeline.tensor_parallel=T``; global rank = device x T + tensor rank).

A :class:`TensorTopology` shows one device per group (its first GPU) and, between two
groups, the route of their tensor rank 0, each resource's bandwidth divided by the most
matching routes (d·T + t to d'·T + t) of one group pair that cross it. A group's own
collectives run on its physical devices (:meth:`TensorTopology.collective_time`)."""

from __future__ import annotations

from .topology import Device, Topology

OPS = ("all-reduce", "all-gather", "reduce-scatter")


class TensorTopology(Topology):
    """``physical`` seen as groups of ``tensor`` consecutive devices (see the module's docstring)."""

    def __init__(self, physical: Topology, tensor: int) -> None:
        T, n = tensor, physical.num_devices
        if isinstance(T, bool) or not isinstance(T, int) or T < 1:
            raise ValueError(f"pipeline.tensor_parallel={T!r}: must be a whole number >= 1")
        if n % T:
            raise ValueError(f"pipeline.tensor_parallel={T}: topology '{physical.name}' has {n} devices, not a "
                             f"multiple of {T}")
        per_node: dict[int, int] = {}
        for d in physical.devices:
            per_node[d.node] = per_node.get(d.node, 0) + 1
        for node, count in sorted(per_node.items()):
            if count % T:
                raise ValueError(
                    f"pipeline.tensor_parallel={T}: topology '{physical.name}' node {node} has {count} devices, and a "
                    f"tensor-parallel group is {T} devices of one node (its all-reduces run on the node's links "
                    f"every layer); use a T that divides the devices of every node"
                    + (f" (at most {min(per_node.values())})" if T > min(per_node.values()) else ""))
        G = n // T
        self.physical = physical
        self.tensor_parallel = T
        self.groups = tuple(tuple(range(g * T, (g + 1) * T)) for g in range(G))
        # how many of a group pair's T matching routes cross each resource, at most
        shared: dict[int, int] = {}
        used: set[int] = set()
        for a in range(G):
            for c in range(G):
                if a == c:
                    continue
                count: dict[int, int] = {}
                for t in range(T):
                    for x in physical.route(a * T + t, c * T + t).resources:
                        count[x] = count.get(x, 0) + 1
                for x, k in count.items():
                    if k > shared.get(x, 1):
                        shared[x] = k
                used.update(physical.route(a * T, c * T).resources)
        order = sorted(used)
        new_id = {old: i for i, old in enumerate(order)}
        paths = {(a, c): [new_id[x] for x in physical.route(a * T, c * T).resources]
                 for a in range(G) for c in range(G) if a != c}
        cores = None if physical.cores is None else max(1, physical.cores // T)
        super().__init__(
            physical.name,
            [physical.devices[g * T] for g in range(G)],
            [physical.resource_names[x] for x in order],
            [physical.resource_bandwidth[x] / shared.get(x, 1) for x in order],
            [physical.resource_latency[x] for x in order],
            paths,
            cores=cores,
            contention=physical.contention,
            message_host=physical.message_host,
            collective_bandwidth=physical.collective_bandwidth,
        )
        self._collectives: dict[tuple, float] = {}  # (op, device, bytes) -> seconds
        self.cost_memo: dict[tuple, float] = {}  # an action's collectives by what they depend on (tensor_cost)
        self._group_of_device: dict[Device, tuple[int, ...]] = {}
        for g, dev in enumerate(self.devices):
            self._group_of_device.setdefault(dev, self.groups[g])

    def group(self, device: int) -> tuple[int, ...]:
        """The physical devices of schedule device ``device``'s tensor group."""
        return self.groups[device]

    def collective_time(self, op: str, device: Device, nbytes: float) -> float:
        """Seconds of one ``op`` (all-reduce, all-gather, reduce-scatter) of ``nbytes`` (the whole
        tensor) over the tensor group of schedule device ``device``, on the physical topology's
        ring (:meth:`pipeflow.topology.topology.Topology.allreduce_time` and its halves)."""
        key = (op, device, nbytes)
        got = self._collectives.get(key)  # (every cost model on this topology asks the same few)
        if got is not None:
            return got
        group = self._group_of_device.get(device)
        if group is None:
            raise ValueError(f"device {device.name} on node {device.node} is not a tensor group's of topology "
                             f"'{self.name}'")
        if op == "all-reduce":
            got = self.physical.allreduce_time(group, nbytes)
        elif op == "all-gather":
            got = self.physical.allgather_time(group, nbytes)
        elif op == "reduce-scatter":
            got = self.physical.reducescatter_time(group, nbytes)
        else:
            raise ValueError(f"collective {op!r}: allowed values: {', '.join(OPS)}")
        self._collectives[key] = got
        return got

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["tensor_parallel"] = self.tensor_parallel
        out["physical_devices"] = self.physical.num_devices
        return out

    def __repr__(self) -> str:
        return f"TensorTopology({self.num_devices} groups of {self.tensor_parallel} on {self.physical!r})"


def tensor_topology(physical: Topology, tensor: int) -> Topology:
    """``physical`` itself for T = 1, else its :class:`TensorTopology`."""
    return physical if tensor == 1 else TensorTopology(physical, tensor)
