"""A placement plan of the topology-aware planner (:class:`Plan`), its schedule
(:func:`build_plan_schedule`), its pricing by simulation (:func:`evaluate`), the closed-form pre-filter
(:class:`StageModel`, :func:`estimate`) and the cuts of L layers into p stages. The search is
:mod:`pipeflow.planning.planner`."""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from ..schedules.data_parallel import replicate_onto, round_robin
from ..schedules.ir import Schedule
from ..schedules.one_f_one_b import one_f_one_b
from ..sim.device_memory import device_peaks
from ..sim.device_walk import tapes
from ..sim.memory_peaks import Peaks
from ..sim.engine import SimResult, simulate
from ..topology.topology import Topology
from .cost import AnalyticCost, layer_cost
from .tensor_cost import (collectives_time, layer_collectives, sequence_parallel_layer, shard_spec,
                          stage_collectives)
from .model_state import STATE_BYTES, cast_bytes, step_time
from .saved_tensors import first_stage_saved, last_stage_saved
from .transformer import (
    TransformerSpec,
    arrived_input_saved,
    head_forward_flops,
    layer_matrix_params,
    recomputed_matrix_params,
    stage_params,
    stage_shared_saved,
)

GB = 1e9  # plan.memory_limit_gb is in GB of 1e9 bytes, as schedule.memory_limit_gb

# ------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """A pipeline plan: ``layers_per_stage[s]`` blocks of stage s on device ``device_of_stage[s]``, 1F1B."""

    layers_per_stage: list[int]
    device_of_stage: list[int]
    microbatches: int
    microbatch_size: int = 1
    # data-parallel replicas of the whole pipeline beyond the first: replica_devices[k][s]
    # holds stage s of pipeline k + 1; microbatch i runs on pipeline i mod (replicas), and
    # each stage's gradients are all-reduced across its replicas at the end (empty: none)
    replica_devices: list[list[int]] = field(default_factory=list)
    schedule: str = "1f1b"
    predicted_iteration_time: float = math.nan
    # per stage: its device's peak bytes as pipeflow-simulate walks them (sim.device_memory.
    # device_peaks; the largest over its replicas), and the forward + backward time of one
    # microbatch on it (seconds)
    stage_memory_bytes: list[float] = field(default_factory=list)
    stage_compute_time: list[float] = field(default_factory=list)
    memory_limit_bytes: float | None = None
    model: str = ""
    topology: str = ""
    method: str = "planner"
    # each device a tensor group of this many GPUs of one node (pipeline.tensor_parallel), the
    # numbers above one rank's; sequence_parallel: pipeline.sequence_parallel with it
    tensor_parallel: int = 1
    sequence_parallel: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def replicas(self) -> int:
        """Pipelines running side by side (1: no replication)."""
        return 1 + len(self.replica_devices)

    @property
    def pipelines(self) -> list[list[int]]:
        """Device of each stage, per pipeline: ``pipelines[k][s]``."""
        return [list(self.device_of_stage)] + [list(r) for r in self.replica_devices]

    @property
    def num_devices_used(self) -> int:
        return self.num_stages * self.replicas

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.stage_memory_bytes, default=0.0)

    def memory_per_device(self) -> dict[int, float]:
        """Device -> memory of the stage it holds (the stage's largest over its replicas)."""
        return {d: m for row in self.pipelines for d, m in zip(row, self.stage_memory_bytes)}

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @staticmethod
    def from_dict(data: dict) -> "Plan":
        known = {f for f in Plan.__dataclass_fields__}
        return Plan(**{k: v for k, v in data.items() if k in known})

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))


# ------------------------------------------------------------- schedule and scoring


def build_plan_schedule(device_of_stage: Sequence[int], num_devices: int, microbatches: int,
                        replica_devices: Sequence[Sequence[int]] = ()) -> Schedule:
    """1F1B over stages placed on distinct devices; each row of ``replica_devices`` a further pipeline
    sharing the microbatches round robin, gradients all-reduced across replicas. ValueError on a shared
    device or more replicas than microbatches."""
    table = [list(device_of_stage)] + [list(r) for r in replica_devices]
    p, d = len(table[0]), len(table)
    flat = [x for row in table for x in row]
    if len(set(flat)) != len(flat) or any(len(row) != p for row in table):
        raise ValueError(f"device tables {table}: every stage of every pipeline needs its own device")
    if d > microbatches:
        raise ValueError(f"{d} pipeline replicas need at least {d} microbatches, got {microbatches}")
    ids = round_robin([len(range(k, microbatches, d)) for k in range(d)])
    return replicate_onto([one_f_one_b(p, len(x)) for x in ids], table, num_devices, ids)


def device_limits(topology: Topology, memory_limit_bytes: float | None) -> list[float]:
    """Per device: the memory a plan may use there."""
    return [
        d.memory_bytes if memory_limit_bytes is None else min(float(memory_limit_bytes), d.memory_bytes)
        for d in topology.devices
    ]


def evaluate(
    spec: TransformerSpec,
    topology: Topology,
    layers_per_stage: Sequence[int],
    device_of_stage: Sequence[int],
    microbatches: int,
    microbatch_size: int = 1,
    memory_limit_bytes: float | None = None,
    efficiency: float = 0.5,
    dtype_bytes: int = 2,
    method: str = "planner",
    record: bool = False,
    replica_devices: Sequence[Sequence[int]] = (),
    tensor_parallel: int | None = None,
    sequence_parallel: bool = False,
) -> tuple[Plan, SimResult]:
    """Simulate one candidate: (its :class:`Plan`, with iteration time and per-stage peak bytes, and the
    simulation). ``tensor_parallel`` T (None: the topology's own): each device is a tensor group of T
    GPUs."""
    T = tensor_degree_of(topology, tensor_parallel)
    layers, devs = list(layers_per_stage), list(device_of_stage)
    reps = [list(r) for r in replica_devices]
    table = [devs] + reps
    cost = AnalyticCost(
        spec, len(layers), microbatch_size=microbatch_size, efficiency=efficiency,
        dtype_bytes=dtype_bytes, layers_per_stage=layers, tensor_parallel=T, sequence_parallel=sequence_parallel,
    )
    if T > 1:
        cost.place_tensor_groups(topology)
    sched = build_plan_schedule(devs, topology.num_devices, microbatches, reps)
    res = simulate(sched, cost, topology, record=record)
    # the walk pipeflow-simulate takes, as arrays once per placement (a plan search prices
    # one placement under many cuts of the layers)
    walks = _walks(tuple(devs), topology.num_devices, microbatches, tuple(map(tuple, reps)))
    peaks = device_peaks(sched, cost, res.per_device, topology, walks)
    mem = [max(peaks[row[s]] for row in table) for s in range(len(devs))]
    comp = [
        max(cost.compute_time("F", s, 0, topology.devices[row[s]]) + cost.compute_time("B", s, 0, topology.devices[row[s]])
            for row in table)
        for s in range(len(devs))
    ]
    plan = Plan(
        layers_per_stage=layers,
        device_of_stage=devs,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        replica_devices=reps,
        predicted_iteration_time=res.makespan,
        stage_memory_bytes=mem,
        stage_compute_time=comp,
        memory_limit_bytes=memory_limit_bytes,
        model=spec.name,
        topology=topology.name,
        method=method,
        tensor_parallel=T,
        sequence_parallel=cost.sequence_parallel,
    )
    return plan, res


@functools.lru_cache(maxsize=256)
def _walks(devs: tuple, num_devices: int, microbatches: int, reps: tuple) -> Peaks:
    """The memory walks of the plan schedule of a placement, as arrays (:class:`Peaks`)."""
    return Peaks(tapes(build_plan_schedule(devs, num_devices, microbatches, reps)))


def tensor_degree_of(topology: Topology, tensor_parallel: int | None) -> int:
    """The tensor degree a plan on ``topology`` prices; ValueError unless the topology's own."""
    own = getattr(topology, "tensor_parallel", 1)
    if tensor_parallel is None:
        return own
    if tensor_parallel != own:
        raise ValueError(f"pipeline.tensor_parallel={tensor_parallel}: topology '{topology.name}' is grouped in "
                         f"tensor groups of {own} (plan on pipeflow.topology.tensor.tensor_topology(topology, "
                         f"{tensor_parallel}))")
    return tensor_parallel


def fits(plan: Plan, topology: Topology, memory_limit_bytes: float | None) -> bool:
    limits = device_limits(topology, memory_limit_bytes)
    return all(m <= limits[d] * (1 + 1e-9) for d, m in plan.memory_per_device().items())


def overshoot(plan: Plan, topology: Topology, memory_limit_bytes: float | None) -> float:
    """Bytes by which the plan's worst device exceeds its limit (<= 0: fits)."""
    limits = device_limits(topology, memory_limit_bytes)
    return max(m - limits[d] for d, m in plan.memory_per_device().items())


# ------------------------------------------------------------- closed-form estimates


class StageModel:
    """Per-layer constants of the analytic cost (whole sequences), read from the formulas
    :class:`~pipeflow.planning.cost.AnalyticCost` reads, so the search prices any cut on any device in
    closed form. With ``tensor_parallel`` T > 1: one rank of a tensor group and its collectives on
    ``topology`` (ValueError unless it is grouped by T)."""

    def __init__(self, spec: TransformerSpec, microbatch_size: int = 1, efficiency: float = 0.5,
                 dtype_bytes: int = 2, tensor_parallel: int = 1, sequence_parallel: bool = False,
                 topology: Topology | None = None) -> None:
        T = tensor_parallel
        if T > 1 and getattr(topology, "tensor_parallel", 1) != T:
            raise ValueError(f"pipeline.tensor_parallel={T}: the planner prices the tensor groups' collectives on "
                             f"the topology seen as groups of {T} (pipeflow.topology.tensor.tensor_topology)")
        self.full_spec, self.T, self.sp = spec, T, bool(sequence_parallel) and T > 1
        self.links = topology if T > 1 else None
        self._waits: dict = {}  # (device, first, last) -> the collectives' seconds (per layer, the stage's own)
        spec = shard_spec(spec, T)  # one rank's shape (the spec itself at T = 1)
        self.spec, self.b, self.eff, self.dt = spec, microbatch_size, efficiency, dtype_bytes
        S, b, dt = spec.seq_len, microbatch_size, dtype_bytes
        H = spec.n_embd
        one = layer_cost(spec, S, S, b, dt)  # one layer, with model.recompute applied
        if self.sp:  # norms, dropouts and the stream on the rank's S/T tokens
            one = sequence_parallel_layer(spec, one, S, b, T)
        self.L = spec.n_layer
        self.f_layer = one.forward * b
        self.e_layer = one.recompute * b  # FLOPs a backward reruns per layer
        self.f_head = head_forward_flops(spec, S) * b
        self.a_layer = float(one.saved)
        self.t_layer = one.rebuilt  # the layer (or region) a backward rebuilds and holds
        self.a_first = first_stage_saved(spec, S, b)  # token and position ids, the embedding's dropout mask
        self.a_last = last_stage_saved(spec, S, b, dt)  # the final norm, the head's input, the log-softmax
        self.a_shared = stage_shared_saved(spec, S)  # rotary tables, once per stage
        self.a_arrived = arrived_input_saved(spec, S, b, dt)  # a stage after the first
        # a stage's parameters, n layers and its ends' (the planner asks for many cuts)
        self.p_layer = stage_params(spec, 1, False, False)
        self.p_ends = {(f, e): stage_params(spec, 0, f, e) for f in (False, True) for e in (False, True)}
        # the 16-bit casts beside the model state (a recomputed region casts its own
        # weights, held with the rebuilt layer: t_layer)
        self.cast_layer = cast_bytes(layer_matrix_params(spec) - recomputed_matrix_params(spec), dt)
        self.cast_last = cast_bytes(spec.vocab_size * H, dt)
        # with sequence parallelism each rank sends its S/T tokens to its match (AnalyticCost.message_bytes)
        self.msg_bytes = float(b * (S // T if self.sp else S) * H * dt)

    def params(self, n: int, first: bool, last: bool) -> float:
        """Parameters of a stage of ``n`` layers (:func:`~pipeflow.planning.transformer.stage_params`)."""
        return float(n * self.p_layer + self.p_ends[first, last])

    def fb_time(self, n: int, last: bool, device, first: bool = False) -> float:
        """Seconds of forward + backward of one microbatch through ``n`` layers."""
        flops = 3 * (n * self.f_layer + (self.f_head if last else 0.0)) + n * self.e_layer
        t = flops / (device.peak_flops * self.eff)
        if self.T > 1:
            per_layer, own = self.tensor_waits(device, first, last)
            t += n * per_layer + own
        return t

    def tensor_waits(self, device, first: bool, last: bool) -> tuple[float, float]:
        """(seconds per layer, seconds of the stage's embedding or head) a forward plus a backward wait for
        the tensor group's collectives on ``device``."""
        key = (device, first, last)
        got = self._waits.get(key)
        if got is None:
            S, spec = self.spec.seq_len, self.spec
            per_layer = own = 0.0
            for kind in ("F", "B"):
                layer = layer_collectives(kind, S, self.b, spec, self.dt, self.sp)
                stage = stage_collectives(kind, S, self.b, self.full_spec, self.dt, self.sp, self.T, first, last)
                per_layer += collectives_time(self.links, layer, device)
                own += collectives_time(self.links, stage, device)
            got = self._waits[key] = (per_layer, own)
        return got

    def step_time(self, n: int, first: bool, last: bool, device) -> float:
        """Seconds of the stage's optimizer step (:func:`~pipeflow.planning.model_state.step_time`)."""
        return step_time(self.params(n, first, last), self.dt, device.memory_bandwidth)

    def memory(self, n: int, first: bool, last: bool, in_flight: int) -> float:
        act = n * self.a_layer + self.a_shared + (self.a_first if first else self.a_arrived) \
            + (self.a_last if last else 0.0)
        casts = n * self.cast_layer + (self.cast_last if last else 0.0)
        return in_flight * act + self.t_layer + self.params(n, first, last) * STATE_BYTES + casts


def _edge_times(topology: Topology, chain: Sequence[int], nbytes: float) -> list[float]:
    return [
        max(topology.transfer_time(a, b, nbytes), topology.transfer_time(b, a, nbytes))
        for a, b in zip(chain, chain[1:])
    ]


def estimate(model: StageModel, topology: Topology, layers: Sequence[int], chain: Sequence[int],
             microbatches: int, limits: Sequence[float],
             replicas: Sequence[Sequence[int]] = ()) -> tuple[float, float]:
    """(estimated 1F1B iteration time in seconds, worst memory overshoot in bytes) of a cut; with
    ``replicas``, the slowest replica's and the unhidden gradient all-reduce."""
    table = [list(chain)] + [list(r) for r in replicas]
    p, d = len(layers), len(table)
    m = -(-microbatches // d)
    devs = topology.devices
    t = [max(model.fb_time(n, s == p - 1, devs[row[s]], s == 0) for row in table) for s, n in enumerate(layers)]
    c = [max(e) for e in zip(*(_edge_times(topology, row, model.msg_bytes) for row in table))] if p > 1 else []
    step = max(model.step_time(n, s == 0, s == p - 1, devs[row[s]])
               for s, n in enumerate(layers) for row in table)
    est = sum(t) + 2 * sum(c) + (m - 1) * max(max(t), max(c, default=0.0)) + step
    if d > 1:
        hidden = 0.0
        tail = 0.0
        for s, n in enumerate(layers):
            ar = topology.allreduce_time([row[s] for row in table], model.params(n, s == 0, s == p - 1) * model.dt)
            tail = max(tail, ar - hidden)
            hidden += 2 * t[s] / 3
        est += tail
    over = max(
        model.memory(n, s == 0, s == p - 1, min(p - s, m)) - limits[row[s]]
        for s, n in enumerate(layers) for row in table
    )
    return est, over


# ------------------------------------------------------------------------ cuts


def _greedy_cut(cap, p: int, L: int, reverse: bool = False) -> list[int] | None:
    """Layers per stage, each taking the most ``cap(s, n)`` allows in order; None if infeasible."""
    out = [0] * p
    left = L
    order = range(p - 1, -1, -1) if reverse else range(p)
    for k, s in enumerate(order):
        remaining = p - 1 - k
        hi = left - remaining
        if hi < 1:
            return None
        if k == p - 1:
            if not cap(s, left):
                return None
            out[s] = left
            left = 0
            break
        # the largest n in 1..hi with cap(s, n): cap is monotone (true then false)
        if not cap(s, 1):
            return None
        lo_n, hi_n = 1, hi
        while lo_n < hi_n:
            mid = (lo_n + hi_n + 1) // 2
            if cap(s, mid):
                lo_n = mid
            else:
                hi_n = mid - 1
        out[s] = lo_n
        left -= lo_n
    return out if left == 0 else None


def _bisect_cut(value, p: int, L: int, reverse: bool, extra_cap=None, iters: int = 40) -> list[int] | None:
    """The cut minimising max_s value(s, n_s) (monotone in n), subject to extra_cap."""
    def cap_for(T):
        def cap(s, n):
            return value(s, n) <= T and (extra_cap is None or extra_cap(s, n))
        return cap

    hi = max(value(s, L - p + 1) for s in range(p))
    lo = 0.0
    best = _greedy_cut(cap_for(hi), p, L, reverse)
    if best is None:
        return None
    for _ in range(iters):
        mid = (lo + hi) / 2
        cut = _greedy_cut(cap_for(mid), p, L, reverse)
        if cut is None:
            lo = mid
        else:
            hi, best = mid, cut
        if hi - lo <= 1e-9 * hi:
            break
    return best


def _compositions(L: int, p: int) -> Iterable[tuple[int, ...]]:
    for bars in itertools.combinations(range(1, L), p - 1):
        edges = (0, *bars, L)
        yield tuple(edges[i + 1] - edges[i] for i in range(p))


def uniform_cut(L: int, p: int) -> list[int]:
    base, extra = divmod(L, p)
    return [base + (1 if s < extra else 0) for s in range(p)]
