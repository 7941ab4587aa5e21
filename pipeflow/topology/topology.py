"""Devices and the links between them, as the simulator and the planner see them.

A :class:`Topology` is devices plus *resources*: directed links or ports, each with its
bandwidth (bytes/s) and latency (s). A transfer occupies every resource on its
:class:`Route` at once, so transfers sharing one (a GPU's NVLink egress, an uplink)
serialize; ports rather than pairs, so one GPU sending to two peers shares its egress.
Presets: :mod:`pipeflow.topology.presets`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Device:
    name: str  # "a100-80g", "v100-32g", "cpu"
    peak_flops: float  # dense FLOP/s at the 16-bit training dtype (bf16/fp16)
    memory_bytes: float
    memory_bandwidth: float = 0.0  # bytes/s (used for optimizer-step time)
    node: int = 0
    fp32_flops: float = 0.0  # dense FLOP/s in fp32 (A100/H100: TF32 tensor cores); 0: as peak_flops
    # bytes the math libraries keep for the whole run in each process on the device: a
    # cuBLAS workspace per thread that runs products (the forward's and autograd's
    # device thread) and cuBLASLt's; the simulator counts them as temporaries
    workspace_bytes: float = 0.0
    # a device profile (an operator sweep's JSON: pipeflow.planning.device_profile) that
    # prices each operator as measured on this device; "": FLOPs at the peak x efficiency
    profile: str = ""

    def flops(self, dtype_bytes: int = 2) -> float:
        """Dense FLOP/s for elements of ``dtype_bytes`` (4: fp32; otherwise 16-bit)."""
        return (self.fp32_flops or self.peak_flops) if dtype_bytes >= 4 else self.peak_flops


@dataclass(frozen=True)
class Route:
    resources: tuple[int, ...]  # directed link resources a src->dst transfer occupies; () when src == dst
    bandwidth: float  # bytes/s: the slowest resource on the path (inf when src == dst)
    latency: float  # seconds: sum over the path (0 when src == dst)


_LOCAL = Route((), math.inf, 0.0)


class Topology:
    """Devices, directed link resources, and the route of every ordered device pair
    (``paths[(src, dst)]``: the resource ids crossed, in order). A route's bandwidth is its
    slowest resource's, its latency the sum of its resources'."""

    def __init__(
        self,
        name: str,
        devices: Sequence[Device],
        resource_names: Sequence[str],
        resource_bandwidth: Sequence[float],
        resource_latency: Sequence[float],
        paths: Mapping[tuple[int, int], Sequence[int]],
        cores: int | None = None,
        contention: float = 1.0,
        message_host: float = 0.0,
        collective_bandwidth: float | None = None,
    ) -> None:
        self.name = name
        # Shared compute: the devices are processes on one host with ``cores`` cores
        # (None: each device computes on its own, as GPUs do). With k devices computing
        # at once each progresses at rate min(1, cores / k) x the contention factor of
        # min(k, cores) busy cores: 1 for one, ``contention`` (memory bandwidth and cache
        # shared, measured by the calibration) with every core busy, linear between.
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
            raise ValueError(f"topology '{name}': cores={cores!r} must be a whole number >= 1, or None")
        if not 0 < contention <= 1:
            raise ValueError(f"topology '{name}': contention={contention!r} must be in (0, 1]")
        self.cores = cores
        self.contention = float(contention)
        # Host time each message costs the compute stream of both its sender and its
        # receiver (posting it, the transport's own threads on the same cores): CPU ranks
        # pay it, GPUs (whose copies run beside their kernels) do not.
        if not 0 <= message_host < math.inf:
            raise ValueError(f"topology '{name}': message_host={message_host!r} must be a finite number of seconds >= 0")
        self.message_host = float(message_host)
        # The most bytes/s a ring all-reduce's steps reach (None: what its links carry).
        # gloo's all-reduce on CPU ranks reduces on the ranks' own cores and runs far below
        # its point-to-point rate; pipeflow.runtime.calibration_run's step synchronisation measures it.
        if collective_bandwidth is not None and not 0 < collective_bandwidth < math.inf:
            raise ValueError(f"topology '{name}': collective_bandwidth={collective_bandwidth!r} must be a number of "
                             f"bytes/s > 0, or None")
        self.collective_bandwidth = None if collective_bandwidth is None else float(collective_bandwidth)
        self.devices = tuple(devices)
        self.resource_names = tuple(resource_names)
        self.resource_bandwidth = tuple(float(b) for b in resource_bandwidth)
        self.resource_latency = tuple(float(t) for t in resource_latency)
        n, r = len(self.devices), len(self.resource_names)
        if n < 1:
            raise ValueError(f"topology '{name}' needs at least one device")
        if len(self.resource_bandwidth) != r or len(self.resource_latency) != r:
            raise ValueError(
                f"topology '{name}': {r} resource names but {len(self.resource_bandwidth)} bandwidths "
                f"and {len(self.resource_latency)} latencies"
            )
        links = zip(self.resource_names, self.resource_bandwidth, self.resource_latency)
        for rid, (rname, bw, lat) in enumerate(links):
            if not bw > 0 or not lat >= 0:
                raise ValueError(
                    f"topology '{name}': resource {rid} ({rname}) needs bandwidth > 0 and latency >= 0, "
                    f"got {bw} B/s and {lat} s"
                )
        # routes[src][dst]: a dense table so route() is one index, the simulator's hot path
        routes: list[list[Route]] = [[_LOCAL] * n for _ in range(n)]
        for src in range(n):
            for dst in range(n):
                if src == dst:
                    continue
                if (src, dst) not in paths:
                    raise ValueError(f"topology '{name}': no path from device {src} to device {dst}")
                res = tuple(paths[(src, dst)])
                if not res or any(not 0 <= x < r for x in res):
                    raise ValueError(
                        f"topology '{name}': path {src}->{dst} must be a non-empty list of resource ids in 0..{r - 1}, "
                        f"got {list(res)}"
                    )
                bw = min(self.resource_bandwidth[x] for x in res)
                lat = sum(self.resource_latency[x] for x in res)
                routes[src][dst] = Route(res, bw, lat)
        self._routes = tuple(tuple(row) for row in routes)

    # ----------------------------------------------------------------- queries

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return len({d.node for d in self.devices})

    @property
    def on_gpus(self) -> bool:
        """Whether any device is an accelerator (the presets' ``cpu`` is the one that is not)."""
        return any(d.name != "cpu" for d in self.devices)

    def workspace_bytes(self, device: int) -> float:
        """What device ``device``'s math libraries keep for the whole run (:attr:`Device.workspace_bytes`)."""
        return float(self.devices[device].workspace_bytes) if device < len(self.devices) else 0.0

    @property
    def shares_compute(self) -> bool:
        """Whether devices slow each other down when they compute at once (see __init__)."""
        return self.cores is not None and (self.cores < self.num_devices or self.contention < 1.0)

    def compute_rate(self, busy: int) -> float:
        """How fast each of ``busy`` devices computing at once progresses (1 = alone)."""
        if self.cores is None or busy <= 1:
            return 1.0
        k = min(busy, self.cores)
        factor = 1.0 if self.cores == 1 else 1.0 - (1.0 - self.contention) * (k - 1) / (self.cores - 1)
        return min(1.0, self.cores / busy) * factor

    def route(self, src: int, dst: int) -> Route:
        return self._routes[src][dst]

    def bandwidth(self, src: int, dst: int) -> float:
        return self._routes[src][dst].bandwidth

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        """Time of one transfer on an otherwise idle network; 0 for src == dst."""
        if src == dst:
            return 0.0
        r = self._routes[src][dst]
        return r.latency + nbytes / r.bandwidth

    def allreduce_time(self, devices: Sequence[int], nbytes: float) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``devices`` in that ring order:
        2(n-1)/n * nbytes / B + 2(n-1) * L, B the slowest neighbour bandwidth, L the largest
        neighbour latency; k ring hops crossing one resource each get 1/k of it."""
        n, bw, lat = self._ring(devices, "all-reduce")
        if n <= 1 or nbytes <= 0 or math.isinf(bw):  # (inf: every ring member is the same device)
            return 0.0
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    def allgather_time(self, devices: Sequence[int], nbytes: float) -> float:
        """Seconds of a ring all-gather of ``nbytes`` in all (``nbytes / n`` from each device): the
        all-reduce's second half. Without accelerators the all-reduce's time (gloo's all-gather
        copies its output, so the runtime all-reduces in place: pipeflow.runtime.sharded)."""
        return self._half_ring(devices, nbytes, "all-gather")

    def reducescatter_time(self, devices: Sequence[int], nbytes: float) -> float:
        """Seconds of a ring reduce-scatter of ``nbytes`` over ``devices``: the all-reduce's first
        half. Without accelerators the all-reduce's time (gloo has no reduce-scatter)."""
        return self._half_ring(devices, nbytes, "reduce-scatter")

    def _half_ring(self, devices: Sequence[int], nbytes: float, what: str) -> float:
        if not self.on_gpus:  # gloo's CPU ranks: an all-reduce in place (see the two above)
            return self.allreduce_time(devices, nbytes)
        n, bw, lat = self._ring(devices, what)
        if n <= 1 or nbytes <= 0 or math.isinf(bw):
            return 0.0
        return (n - 1) / n * nbytes / bw + (n - 1) * lat

    def _ring(self, devices: Sequence[int], what: str) -> tuple[int, float, float]:
        """A ring collective's size, bandwidth and latency over ``devices`` in that order."""
        ring = list(devices)
        n = len(ring)
        for d in ring:
            if not 0 <= d < self.num_devices:
                raise ValueError(
                    f"{what} over device {d}: topology '{self.name}' has devices 0..{self.num_devices - 1}"
                )
        if n <= 1:
            return n, math.inf, 0.0
        hops = [self._routes[ring[i]][ring[(i + 1) % n]] for i in range(n)]
        uses: dict[int, int] = {}
        for hop in hops:
            for x in hop.resources:
                uses[x] = uses.get(x, 0) + 1
        bw = min((self.resource_bandwidth[x] / k for x, k in uses.items()), default=math.inf)
        if self.collective_bandwidth is not None and not math.isinf(bw):
            bw = min(bw, self.collective_bandwidth)
        return n, bw, max(hop.latency for hop in hops)

    # ------------------------------------------------------------ derivation

    def first(self, n: int) -> "Topology":
        """The sub-topology of devices 0..n-1, keeping only the resources their routes use."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.num_devices:
            raise ValueError(
                f"topology '{self.name}' has {self.num_devices} devices; cannot take the first {n} "
                f"(allowed: 1..{self.num_devices})"
            )
        if n == self.num_devices:
            return self
        used = sorted({x for s in range(n) for t in range(n) for x in self._routes[s][t].resources})
        new_id = {old: i for i, old in enumerate(used)}
        paths = {
            (s, t): [new_id[x] for x in self._routes[s][t].resources] for s in range(n) for t in range(n) if s != t
        }
        return Topology(
            self.name,
            self.devices[:n],
            [self.resource_names[x] for x in used],
            [self.resource_bandwidth[x] for x in used],
            [self.resource_latency[x] for x in used],
            paths,
            cores=self.cores,
            contention=self.contention,
            message_host=self.message_host,
            collective_bandwidth=self.collective_bandwidth,
        )

    def to_dict(self) -> dict:
        """JSON-able summary for summary.json: devices, and links grouped by kind."""
        links: dict[tuple[str, float, float], int] = {}
        for rname, bw, lat in zip(self.resource_names, self.resource_bandwidth, self.resource_latency):
            kind = rname.split("[", 1)[0]
            links[(kind, bw, lat)] = links.get((kind, bw, lat), 0) + 1
        return {
            "name": self.name,
            "num_devices": self.num_devices,
            "num_nodes": self.num_nodes,
            "devices": [asdict(d) for d in self.devices],
            "links": [
                {"kind": kind, "count": count, "bandwidth": bw, "latency": lat}
                for (kind, bw, lat), count in links.items()
            ],
            **({"cores": self.cores, "contention": self.contention} if self.cores is not None else {}),
            **({"message_host": self.message_host} if self.message_host else {}),
            **({"collective_bandwidth": self.collective_bandwidth} if self.collective_bandwidth else {}),
        }

    def __repr__(self) -> str:
        kinds = sorted({d.name for d in self.devices})
        return (
            f"Topology({self.name}: {self.num_devices} devices ({', '.join(kinds)}) on {self.num_nodes} node(s), "
            f"{len(self.resource_names)} link resources)"
        )


class TopologyBuilder:
    """Accumulates resources and paths; presets use it so that each reads as a wiring diagram."""

    def __init__(self, name: str, devices: Sequence[Device]) -> None:
        self.name = name
        self.devices = list(devices)
        self.names: list[str] = []
        self.bandwidth: list[float] = []
        self.latency: list[float] = []
        self.paths: dict[tuple[int, int], list[int]] = {}

    def resource(self, name: str, bandwidth: float, latency: float) -> int:
        self.names.append(name)
        self.bandwidth.append(bandwidth)
        self.latency.append(latency)
        return len(self.names) - 1

    def path(self, src: int, dst: int, resources: Sequence[int]) -> None:
        self.paths[(src, dst)] = list(resources)

    def build(self, cores: int | None = None, contention: float = 1.0, message_host: float = 0.0,
              collective_bandwidth: float | None = None) -> Topology:
        return Topology(self.name, self.devices, self.names, self.bandwidth, self.latency, self.paths,
                        cores=cores, contention=contention, message_host=message_host,
                        collective_bandwidth=collective_bandwidth)
