"""Pricing a search candidate: in closed form (every candidate, :mod:`.closed_form`) and by
the discrete-event simulator (the most promising ones, replicas' all-reduces and messages
on the topology's links too), both from the analytic cost of the candidate's own stages."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipeflow.schedules.data_parallel import replicate
from pipeflow.schedules.sharding import with_gathers
from pipeflow.sim.engine import compile_schedule, simulate
from pipeflow.sim.device_memory import device_memory, library_workspace
from pipeflow.topology.tensor import tensor_topology
from pipeflow.topology.topology import Topology

from ..cost import AnalyticCost
from ..model_state import gradient_bytes
from ..partitioners import partition_layers
from ..seqsplit import split_sequence
from ..transformer import TransformerSpec, kv_repeat_on, shared_head_params
from .closed_form import TIMED, Structure, StructureCache, idle_formula
from .candidate_memory import MemoryPrices, TermForms
from .space import Candidate

CLOSED_FORM, SIMULATED = "closed form", "simulated"


@dataclass
class Priced:
    """A candidate's predicted step: time, where it goes, and its memory against the limit."""

    candidate: Candidate
    how: str  # CLOSED_FORM or SIMULATED
    step_time: float  # seconds per update (an asynchronous schedule's: per update in its steady windows)
    compute: float  # busy time of the busiest device (its F, B, I, W and optimizer step)
    waits: float  # step_time - compute: bubble, messages, all-reduces the busiest device waits for
    bubble: float  # idle share of all device time
    peak_memory: float  # bytes on the fullest device (relative to its limit): model state + activations
    memory_limit: float  # bytes that device may use
    device: int  # which device that is
    tokens: int  # tokens per update
    note: str = ""  # e.g. that the closed form had no formula of its own for this schedule
    walked: bool = False  # the memory is the walk's at the candidate's own m (not extrapolated)

    @property
    def over(self) -> float:
        """Bytes beyond the limit on the fullest device (<= 0: it fits)."""
        return self.peak_memory - self.memory_limit

    @property
    def fits(self) -> bool:
        return self.over <= 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {**self.candidate.to_dict(), "label": self.candidate.label(), "priced_by": self.how,
                "step_time": self.step_time, "tokens_per_s": self.tokens_per_s, "compute": self.compute,
                "waits": self.waits, "bubble": self.bubble, "peak_memory_bytes": self.peak_memory,
                "memory_limit_bytes": self.memory_limit, "over_bytes": max(self.over, 0.0),
                "fits": self.fits, "device": self.device, "note": self.note}


@dataclass
class _Tables:
    """One cost model's numbers as arrays indexed [stage, segment] (bytes) or [stage]."""

    params: np.ndarray  # parameter (gradient) bytes per stage
    message: float  # bytes of one activation message (the longest segment's)
    times: dict  # device kind -> (F, B, I, W arrays [stage, segment], S array [stage]) in seconds


class Pricer(MemoryPrices):
    """Prices candidates for one model on one topology (``devices`` of it), within
    ``memory_limit`` bytes per device (None: each device's own memory)."""

    def __init__(self, spec: TransformerSpec, topology: Topology, efficiency: float = 0.5, dtype_bytes: int = 2,
                 overlap: float = 0.0, memory_limit: float | None = None) -> None:
        self.spec, self.topology = spec, topology
        self.efficiency, self.dtype_bytes, self.overlap = efficiency, dtype_bytes, overlap
        self.memory_limit = memory_limit
        self.structures = StructureCache()
        self._costs: dict[tuple, AnalyticCost | str] = {}
        self._tables: dict[int, _Tables] = {}
        self._terms: dict[int, dict] = {}  # id(cost) -> memory term -> bytes
        self._term_numbers, self._term_keys = {}, []  # every memory term met (as like_stage gives it) -> its number; back
        self._term_bytes: dict[int, np.ndarray] = {}  # id(cost) -> bytes by term number (nan: not yet valued)
        self._needs_cache: dict[tuple, np.ndarray] = {}  # (id(cost), id(walk), k[, level, replicas]) -> bytes per device
        self._work_cache: dict[tuple, tuple] = {}  # (id(structure), id(cost)) -> work per device, hop
        self._flat: dict[int, tuple] = {}  # id(structure) -> its devices' work keys in one list
        self._kinds: dict[int, tuple] = {}  # id(cost) -> each stage's first of its kind
        self._term_index: dict[tuple, tuple] = {}  # (id(a walk's terms), [shard, replicas,] kinds) -> index
        self._compiled: dict[tuple, object] = {}  # (id(structure), replicas, level, gather) -> its simulation's input
        self._layers: dict[tuple, list[int]] = {}
        self._memo: dict[tuple, object] = {}  # collectives' times and per-structure arrays, by tagged keys
        # what cost models of one shape share (AnalyticCost's rows per kind of stage; the
        # memory terms' bytes per kind of stage: MemoryPrices._valued), by every degree's pricer
        self._shared_tables, self._shared_terms, self._forms = {}, {}, TermForms()
        repeat = kv_repeat_on(spec, dtype_bytes, topology.on_gpus)  # fp32 grouped-query attention on GPUs
        self._specs = {r: dataclasses.replace(spec, recompute=r, kv_repeat=repeat)
                       for r in ("none", "selective", "full")}
        # pipeline.tensor_parallel: this pricer's degree (its topology's devices are tensor
        # groups of that many GPUs), and the pricers of the others, made when first asked for
        self.tensor = 1
        self._tensors: dict[int, "Pricer"] = {1: self}

    def for_tensor(self, t: int) -> "Pricer":
        """The pricer of candidates whose devices are tensor groups of ``t`` GPUs (the topology
        seen as groups of t, :mod:`pipeflow.topology.tensor`), sharing the schedules' structures."""
        got = self._tensors.get(t)
        if got is None:
            root = self._tensors[1]
            got = Pricer(root.spec, tensor_topology(root.topology, t), root.efficiency, root.dtype_bytes,
                         root.overlap, root.memory_limit)
            got.tensor, got.structures, got._layers, got._tensors = t, root.structures, root._layers, root._tensors
            # what no cost changes: the terms' numbering and each walk's index into it, each
            # structure's keys; what cost models of one shape share
            for name in ("_term_numbers", "_term_keys", "_term_index", "_forms", "_flat", "_shared_tables", "_shared_terms"):
                setattr(got, name, getattr(root, name))
            self._tensors[t] = got
        return got

    # ---------------------------------------------------------------- the pieces

    def limit(self, device: int) -> float:
        return self.memory_limit if self.memory_limit is not None else self.topology.devices[device].memory_bytes

    def cost(self, c: Candidate) -> AnalyticCost | str:
        """The candidate's analytic cost (shared by every candidate with its stages, batch
        shape and recomputation), or why it cannot be priced."""
        n = c.stages * c.virtual_stages
        key = (n, c.microbatch_size, c.segments, c.recompute, c.partition, c.split if c.segments > 1 else "",
               c.sequence_parallel)
        got = self._costs.get(key)
        if got is None:
            spec = self._specs[c.recompute]
            try:
                layers = self._layers.get((c.partition, n))
                if layers is None:
                    layers = self._layers[(c.partition, n)] = partition_layers(c.partition, spec, n)
                lengths = split_sequence(c.split, spec.seq_len, c.segments, spec,
                                         multiple=c.tensor_parallel if c.sequence_parallel else 1) \
                    if c.segments > 1 else None
                got = AnalyticCost(spec, n, microbatch_size=c.microbatch_size, efficiency=self.efficiency,
                                   dtype_bytes=self.dtype_bytes, layers_per_stage=layers, segment_lengths=lengths,
                                   tensor_parallel=self.tensor, sequence_parallel=c.sequence_parallel,
                                   shared=self._shared_tables)
                got.overlap = self.overlap
                if self.tensor > 1:  # the groups' collectives on their own links
                    got.place_tensor_groups(self.topology)
            except ValueError as err:
                got = str(err)
            self._costs[key] = got
        return got

    def tables(self, cost: AnalyticCost) -> _Tables:
        """The cost's numbers as arrays, built once per cost model."""
        got = self._tables.get(id(cost))
        if got is None:
            n, g = cost.num_stages, cost.num_segments
            got = self._tables[id(cost)] = _Tables(np.array([cost.param_bytes(s) for s in range(n)]),
                                                   max(cost.message_bytes(0, 1, k) for k in range(g)), {})
        return got

    def times(self, cost: AnalyticCost, device: int) -> tuple:
        """(F, B, I, W [stage, segment], S [stage]) in seconds on ``device`` (cached per device kind)."""
        tab = self.tables(cost)
        dev = self.topology.devices[device]
        kind = self._device_kind(device)
        got = tab.times.get(kind)
        if got is None:  # (once per kind of stage: cost.stage_kinds)
            like = np.array(cost.stage_kinds())
            firsts = sorted(set(like.tolist()))
            row = np.searchsorted(firsts, like)
            got = tab.times[kind] = tuple(cost.compute_table(k, firsts, dev)[row] for k in "FBIW") + (
                np.array([cost.compute_time("S", s, 0, dev) for s in firsts])[row],)
        return got

    def structure(self, c: Candidate, m: int | None = None) -> Structure | str:
        """The candidate's schedule (one replica) at its microbatches, or at ``m``."""
        return self.structures.get(c.schedule, c.stages, c.microbatches if m is None else m, c.virtual_stages,
                                   c.segments)

    @staticmethod
    def stand_in_sizes(p: int, m: int) -> tuple[int, ...]:
        """The microbatch counts the closed form builds a schedule at: m itself up to 6p; beyond,
        two counts in [2p, 6p) with m's residue mod 2p, from which the peak is extrapolated
        linearly in m and the work scaled."""
        if m < 6 * p:
            return (m,)
        m1 = 4 * p + (m - 4 * p) % (2 * p)
        return (m1, m1 - 2 * p)

    def _work(self, st: Structure, cost: AnalyticCost) -> tuple[np.ndarray, ...]:
        """Each device's seconds over the structure's step (F, the backward's I and W shares, its
        optimizer step) and its units of work, and the longest message hop; once per structure
        and cost."""
        key = (id(st), id(cost))
        got = self._work_cache.get(key)
        if got is None:
            p = st.schedule.num_devices
            flat = self._flat.get(id(st))
            if flat is None:  # every device's (stage, segment) keys in one list, and its stages
                dev = np.concatenate([np.full(len(i), d) for d, (i, _, _) in enumerate(st.counts)]).astype(np.int64)
                held = [(d, s) for d, stages in enumerate(st.stages_on) for s in stages]
                flat = self._flat[id(st)] = (
                    dev, np.concatenate([i for i, _, _ in st.counts]), np.concatenate([g for _, g, _ in st.counts]),
                    np.concatenate([n for _, _, n in st.counts], axis=1),
                    np.array([d for d, _ in held], dtype=np.int64), np.array([s for _, s in held], dtype=np.int64))
            dev, i, g, n, step_dev, step_stage = flat
            sums, steps = np.zeros(5 * p), np.zeros(p)  # (F, B, I, W, the W share of full Bs) per device
            for d0, devices in self._kinds_among(p).items():  # (once per kind of device)
                F, B, I, W, S = self.times(cost, d0)  # noqa: E741
                on = np.isin(dev, devices) if len(devices) < p else slice(None)
                at = (i[on], g[on])
                w = W[at]  # (n's rows F, B, I, W times their times, full Bs' times W: one bincount, by row and device)
                weights = np.concatenate((n[0, on] * F[at], n[1, on] * B[at], n[2, on] * I[at], n[3, on] * w, n[1, on] * w))
                sums += np.bincount((dev[on][None, :] + p * np.arange(5)[:, None]).ravel(), weights, minlength=5 * p)
                mine = np.isin(step_dev, devices) if len(devices) < p else slice(None)
                steps += np.bincount(step_dev[mine], S[step_stage[mine]], minlength=p)
            f_, b_, i_, w_, nb = sums.reshape(5, p)
            units = np.bincount(dev, n[0], minlength=p)
            sched, msg = st.schedule, self.tables(cost).message
            hop_key = (id(st), msg, "hop")
            hop = self._memo.get(hop_key)
            if hop is None:
                hop = self._memo[hop_key] = max((self.topology.transfer_time(
                    sched.placement.device(0, s), sched.placement.device(0, s + 1), msg)
                    for s in range(sched.num_stages - 1)), default=0.0)
            got = self._work_cache[key] = (f_, b_ - nb + i_, nb + w_, steps, units, hop)
        return got

    def _device_kind(self, d: int) -> tuple:
        """What a device's times depend on: devices alike share a cost's times."""
        x = self.topology.devices[d]
        return x.name, x.peak_flops, x.fp32_flops, x.memory_bandwidth

    def _kinds_among(self, p: int) -> dict[int, list[int]]:
        """The first p devices by kind: the first of each kind -> the devices of that kind."""
        got = self._memo.get((p, "kinds"))
        if got is None:
            got = {}
            first: dict[tuple, int] = {}
            for d in range(p):
                got.setdefault(first.setdefault(self._device_kind(d), d), []).append(d)
            self._memo[(p, "kinds")] = got
        return got

    # ---------------------------------------------------------------- closed form

    def closed_form(self, c: Candidate) -> Priced | str:
        """The pre-filter's price: the busiest device's work, the schedule's bubble formula
        in its unit times, a message per stage boundary on the way in and out, the
        optimizer step and the exposed all-reduce; the memory as the simulator counts it."""
        if c.tensor_parallel != self.tensor:
            return self.for_tensor(c.tensor_parallel).closed_form(c)
        at, needs, cost = self.periodic(c), None, None
        for periodic in (True, False):
            if periodic and at is None:
                continue
            sizes = (at[0] + 2 * at[1], at[0]) if periodic else self.stand_in_sizes(c.stages, c.microbatches)
            built = [self.structure(c, m) for m in sizes]
            for m, st in zip(sizes, built):
                if isinstance(st, str):  # the generator's rule, said of the candidate's own m
                    return st.replace(f"pipeline.microbatches={m}:", f"pipeline.microbatches={c.microbatches}:")
            cost = self.cost(c) if cost is None else cost
            if isinstance(cost, str):
                return cost
            needs = self.needs(c, cost) if periodic else None
            if needs is not None or not periodic:
                break  # (else the walks were not periodic there: two stand-in sizes instead)
        st = built[0]
        # what grows with m (each device's work, its units, the F&B pairs) is the larger
        # size's plus t times what the smaller lacks: exact past a schedule's fill, where
        # one more period adds the same actions
        t = (c.microbatches - sizes[0]) / (sizes[0] - sizes[1]) if len(sizes) > 1 else 0.0
        topo = self.topology
        p = st.schedule.num_devices
        f, i, w, steps, units, hop = self._work(st, cost)
        if t:
            f0, i0, w0, _, u0, _ = self._work(built[1], cost)
            f, i, w, units = f + t * (f - f0), i + t * (i - i0), w + t * (w - w0), units + t * (units - u0)
        busy_all = float((f + i + w + steps).sum())
        working = np.flatnonzero(units > 0)  # (work, F, I, W per unit, optimizer step) of each device with any
        busiest_device = int(working[np.argmax((f + i + w + steps)[working])])
        work, step = float(f[busiest_device] + i[busiest_device] + w[busiest_device]), float(steps[busiest_device])
        # the fill and the drain pass through the other devices: the bubble formula takes
        # their mean unit times (the busiest device's own with one device)
        others = working[working != busiest_device] if len(working) > 1 else working
        F, I, W = (float((x[others] / units[others]).mean()) for x in (f, i, w))  # noqa: E741
        if st.overlapped and self.overlap:
            pairs = st.overlapped + t * (st.overlapped - built[-1].overlapped)
            work -= self.overlap * min(F, I + W) * pairs / p
        formula, own = idle_formula(c.schedule)
        idle = formula(p, c.microbatches, c.virtual_stages, c.segments, F, I, W, self.overlap)
        step, sharding = self._sharded_step(c, built, t, cost, busiest_device, step)
        waits = idle + 2 * (p - 1) * hop + self._exposed_allreduce(c, st, cost) + self.tied_sync(c, st) + sharding
        if st.asynchronous:  # per update, in the steady state
            work, waits, busy_all = work / st.updates, 0.0, busy_all / st.updates
        total = work + step + waits
        if topo.shares_compute:
            # devices that share cores (CPU ranks on one host): the host cannot get through the
            # step's work faster than its cores at their best aggregate rate
            agg = max(n * topo.compute_rate(n) for n in range(1, c.stages * c.data_parallel + 1))
            total = max(total, busy_all * c.data_parallel / agg)
        bubble = max(0.0, 1 - busy_all / (p * total)) if total > 0 else 0.0
        walked = needs is not None or len(built) == 1  # (not extrapolated from stand-in sizes)
        if needs is None:  # (the periodic walks' peaks are the candidate's own)
            needs = self._needs(st, cost, c)
            if len(built) > 1:  # each device's peak extrapolated from two smaller sizes: saturating ones stay
                needs = needs + (needs - self._needs(built[1], cost, c)) * t
        peak, limit, worst = self._worst(c, needs)
        return Priced(c, CLOSED_FORM, total, work + step, waits, bubble, peak, limit, worst,
                      c.global_batch * self.spec.seq_len,
                      "" if own else "no bubble formula of its own: 1F1B's stands in", walked)

    def tied_sync(self, c: Candidate, st: Structure) -> float:
        """Seconds of a tied embedding's all-reduce before the optimizer step: its fp32 gradient
        over every device holding the first or the last stage (every replica's)."""
        if not self.spec.tied:
            return 0.0
        p, last = st.schedule.num_devices, st.schedule.num_stages - 1
        held = {r * p + d for r in range(c.data_parallel) for s in {0, last} for d in st.replica_devices[s]}
        if len(held) < 2:
            return 0.0
        key = (tuple(sorted(held)), "tied")
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self.topology.allreduce_time(sorted(held),
                                                                  gradient_bytes(shared_head_params(self.spec)))
        return got

    def _ring(self, ring: tuple, nbytes: float, what: str) -> float:
        key = (ring, nbytes, what)
        got = self._memo.get(key)
        if got is None:
            fn = {"all-reduce": self.topology.allreduce_time, "all-gather": self.topology.allgather_time,
                  "reduce-scatter": self.topology.reducescatter_time}[what]
            got = self._memo[key] = fn(ring, nbytes)
        return got

    def _sharded_step(self, c: Candidate, built: list[Structure], t: float, cost: AnalyticCost, d: int,
                      step: float) -> tuple[float, float]:
        """(the busiest device's optimizer step, the all-gathers it waits for) under ``c.shard``:
        a slice's step; ZeRO-1/2 all-gather each stage's weights, ZeRO-3 where its GATHERs stand,
        every one counted exposed."""
        st = built[0]
        if c.shard == "none" or c.data_parallel == 1 or st.asynchronous:
            return step, 0.0
        params = self.tables(cost).params
        gathers = [b.gathers(c.gather) if c.shard == "full" else {} for b in built]
        waited = 0.0
        rings = self._stage_rings(st, c.data_parallel)
        for s in st.stages_on[d]:
            ring = rings[s]
            if c.shard == "full":  # (a stand-in size's count, extrapolated with m as the work is)
                n0, *n1 = (max((k for (pipe, stage), k in g.items() if stage == s), default=0) for g in gathers)
                n = n0 + t * (n0 - n1[0]) if n1 else n0
            else:
                n = 1.0
            waited += n * self._ring(ring, float(params[s]), "all-gather")
        return step / c.data_parallel, waited

    def _exposed_allreduce(self, c: Candidate, st: Structure, cost: AnalyticCost) -> float:
        """Seconds of the reductions the last device to finish its backward waits for: each stage's
        replicas reduce after its last weight gradient, one stage after another (ZeRO-2/3: a
        reduce-scatter)."""
        p = st.schedule.num_devices
        if c.data_parallel == 1 and st.schedule.placement.num_pipes == 1:
            return 0.0
        params = self.tables(cost).params
        what = "reduce-scatter" if c.shard in ("gradients", "full") else "all-reduce"
        key = (id(st), id(params), c.data_parallel, what)
        got = self._memo.get(key)
        if got is None:
            rings = self._stage_rings(st, c.data_parallel)
            got = self._memo[key] = max(sum(self._ring(rings[s], float(params[s]), what)
                                             for s in st.stages_on[d] if len(rings[s]) > 1) for d in range(p))
        return got

    def _stage_rings(self, st: Structure, replicas: int) -> list[tuple]:
        """Each stage's devices over ``replicas`` replicas of the structure's pipeline."""
        key = (id(st), replicas, "rings")
        got = self._memo.get(key)
        if got is None:
            p = st.schedule.num_devices
            got = self._memo[key] = [tuple(r * p + dd for r in range(replicas) for dd in devs)
                                      for devs in st.replica_devices]
        return got

    # ---------------------------------------------------------------- simulated

    def simulated(self, c: Candidate, closed: Priced | None = None) -> Priced:
        """The simulator's price of the candidate's whole schedule (every replica), memory as
        pipeflow-simulate counts it. A periodic schedule is simulated at three sizes a period apart
        and, where they move alike, extrapolated per period (:meth:`_simulated_periods`); else at
        its own size. ``closed``: its closed-form price, whose memory it reuses where walked at m."""
        if c.tensor_parallel != self.tensor:
            return self.for_tensor(c.tensor_parallel).simulated(c, closed)
        cost = self.cost(c)
        if isinstance(cost, str):
            raise ValueError(cost)
        at = self.periodic(c) if c.schedule in TIMED else None
        if at is not None and at[2] < 2:  # (m itself is no larger than the three sizes)
            at = None
        got = self._simulated_periods(c, cost, *at) if at is not None else None
        st = self.structure(c, at[0] if got is not None else None)
        if isinstance(st, str):
            raise ValueError(st)
        if got is None:
            res = self._simulate(c, st, cost)
            makespan, busy, bubble = res.makespan, [d.busy for d in res.per_device], res.bubble_ratio
        else:
            makespan, busy, bubble = got
        # the tied embedding's all-reduce closes the step on its ranks: a collective (the
        # ranks wait on it), after the last backward, before the optimizer step
        makespan = makespan / st.updates + (0.0 if st.asynchronous else self.tied_sync(c, st))
        if st.asynchronous:  # an asynchronous policy's weight versions come from the timeline
            sched = replicate(st.schedule, c.data_parallel) if c.data_parallel > 1 else st.schedule
            worst = (-np.inf, 0.0, 0)
            held = library_workspace(self.topology, sched.num_devices)  # the math libraries' own, throughout
            for d, mem in enumerate(device_memory(sched, cost, res.per_device, held)):
                need = mem["peak_bytes"]
                if need - self.limit(d) > worst[0] - worst[1]:
                    worst = (need, self.limit(d), d)
        elif closed is not None and closed.walked:  # the same walk's peak, as the closed form found it
            worst = (closed.peak_memory, closed.memory_limit, closed.device)
        else:  # the simulator's walk of one replica (the others walk alike), as the closed form's
            needs = self.needs(c, cost)
            if needs is None:
                needs = self._needs(self.structure(c), cost, c)
            worst = self._worst(c, needs)
        compute = max(busy) / st.updates
        return Priced(c, SIMULATED, makespan, compute, makespan - compute, bubble, worst[0], worst[1],
                      worst[2], c.global_batch * self.spec.seq_len)

    def _simulate(self, c: Candidate, st: Structure, cost: AnalyticCost):
        """The simulation of the structure's schedule, replicated and sharded as ``c``
        (compiled once: the candidates of one schedule and level differ in their costs)."""
        key = (id(st), c.data_parallel, c.shard if c.data_parallel > 1 else "none", c.gather)
        compiled = self._compiled.get(key)
        if compiled is None:
            sched = replicate(st.schedule, c.data_parallel) if c.data_parallel > 1 else st.schedule
            if c.shard != "none" and c.data_parallel > 1:  # (what pipeflow.config.assembly.sharded does)
                sched = with_gathers(sched, c.gather) if c.shard == "full" else sched
                sched = dataclasses.replace(sched, shard=c.shard)
            compiled = self._compiled[key] = compile_schedule(sched)
        return simulate(compiled, cost, self.topology, record=False, waits=False)

    def _simulated_periods(self, c: Candidate, cost: AnalyticCost, m0: int, q: int, k: int):
        """(step time, busy time per device, bubble) at k periods past m0, from the
        simulations at m0, m0 + q and m0 + 2q; None where they do not move alike."""
        runs = []
        for m in (m0, m0 + q, m0 + 2 * q):
            st = self.structure(c, m)
            if isinstance(st, str):
                return None
            res = self._simulate(c, st, cost)
            runs.append((res.makespan, np.array([d.busy for d in res.per_device])))
        (t0, b0), (t1, b1), (t2, b2) = runs
        if not (math.isclose(t2 - t1, t1 - t0, rel_tol=1e-9, abs_tol=1e-12 * t2)
                and np.allclose(b2 - b1, b1 - b0, rtol=1e-9, atol=1e-12 * t2)):
            return None
        if t1 - t0 < (b1 - b0).max() * (1 - 1e-9):  # (a step cannot grow by less than its busiest device's work)
            return None
        makespan = t0 + k * (t1 - t0)
        busy = b0 + k * (b1 - b0)
        bubble = 1.0 - busy.sum() / (len(busy) * makespan) if makespan > 0 else 0.0
        return makespan, [float(x) for x in busy], bubble


def pareto(priced: Sequence[Priced]) -> list[Priced]:
    """The candidates no other beats on both step time and peak memory, fastest first."""
    front, best_mem = [], np.inf
    for q in sorted(priced, key=lambda q: (q.step_time, q.peak_memory)):
        if q.peak_memory < best_mem:
            front.append(q)
            best_mem = q.peak_memory
    return front
