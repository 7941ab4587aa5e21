"""The search's pre-filter: a candidate priced in closed form, before any simulation
(docs/planning.md, "How a candidate is priced"): idle time from the schedule's bubble
formula (:data:`IDLE`), peak memory the simulator's, from byte-less walks of the schedule
per size (:class:`Structure`) summed per candidate (:mod:`pipeflow.sim.memory_peaks`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.data_parallel import as_replica
from pipeflow.schedules.sharding import gathers_per_step, with_gathers
from pipeflow.schedules.ir import Kind, Schedule, WeightPolicy
from pipeflow.schedules.registry import build_schedule
from pipeflow.sim.device_walk import tapes
from pipeflow.sim.memory_peaks import NotPeriodic, Periodic, Peaks, encoded

# idle(p, m, v, s, F, I, W, overlap) -> idle time per device, in the unit times' units
IdleFormula = Callable[[int, int, int, int, float, float, float, float], float]


def _one_f_one_b(p, m, v, s, F, I, W, o):  # noqa: E741 - the zero-bubble paper's names
    return (p - 1) * (F + I + W)


def _zero_bubble_h1(p, m, v, s, F, I, W, o):  # noqa: E741
    return (p - 1) * max(F + I - W, 0.0)


def _zero_bubble_h2(p, m, v, s, F, I, W, o):  # noqa: E741
    # (p-1)F once m >= 2p-1; with fewer microbatches the warm-up cannot fill it
    return (p - 1) * F if m >= 2 * p - 1 else (p - 1) * max(F + I - W, F)


def _zero_bubble_v(p, m, v, s, F, I, W, o):  # noqa: E741
    return (p - 1) * max(F + I - W, 0.0) * (1 if m >= 2 * p - 1 else 2)


def _dualpipe_v(p, m, v, s, F, I, W, o):  # noqa: E741
    B = I + W
    pair = max(F, B) + (1 - o) * min(F, B)  # an overlapped F&B pair, as the simulator prices it
    return (p - 1) * max(pair + B - 3 * W, 0.0)


def _chimera(p, m, v, s, F, I, W, o):  # noqa: E741
    # per basic unit of p microbatches (two opposite pipelines of p/2 each)
    return math.ceil(m / p) * (p - 2) * (F + (I + W) / 2)


def _asynchronous(p, m, v, s, F, I, W, o):  # noqa: E741
    return 0.0  # no flush: the steady state has no bubble


IDLE: dict[str, IdleFormula] = {
    "gpipe": _one_f_one_b,
    "1f1b": _one_f_one_b,
    "interleaved_1f1b": _one_f_one_b,
    "looped_bfs": _one_f_one_b,
    "seq1f1b": _one_f_one_b,
    "seq1f1b_interleaved": _one_f_one_b,
    "zb_h1": _zero_bubble_h1,
    "interleaved_zb": _zero_bubble_h1,
    "zb_h2": _zero_bubble_h2,
    "zb_v": _zero_bubble_v,
    "dualpipe_v": _dualpipe_v,
    "chimera": _chimera,
    "pipedream": _asynchronous,
    "pipedream_2bw": _asynchronous,
    "amdp": _asynchronous,
}


# The schedules whose simulated step the search extrapolates from three simulations a
# period apart past the fill (Pricer.simulated); the others are simulated at their own
# size. A step's time need not grow by the same amount every period from the fill on:
# a fixed order can accrue a wait each period that only shows once what was slack is
# used up (ZB-H2, gpt_small, 4 stages, parameters partition and full recomputation:
# 4.135 ms a microbatch up to m = 14, 4.405 ms from m = 16), so extrapolating is held to
# the schedules whose whole simulations tests/test_search.py compares it with.
TIMED = frozenset({"1f1b", "zb_h1", "seq1f1b", "zb_v", "dualpipe_v", "chimera", "interleaved_1f1b",
                   "interleaved_zb", "seq1f1b_interleaved"})


def idle_formula(name: str) -> tuple[IdleFormula, bool]:
    """(formula, whether it is the schedule's own; False: 1F1B's stands in)."""
    own = IDLE.get(name)
    return (own, True) if own is not None else (_one_f_one_b, False)


class Structure:
    """One replica of a schedule at given sizes: its placement, its units of work per
    device and its devices' memory walks. ScheduleConfigError when the schedule cannot be
    built at these sizes."""

    def __init__(self, name: str, stages: int, microbatches: int, virtual_stages: int, segments: int,
                 options: dict | None = None) -> None:
        self.schedule: Schedule = build_schedule(name, stages, microbatches, virtual_stages=virtual_stages,
                                                 segments=segments, check=False, **(options or {}))
        sched = self.schedule
        self.asynchronous = sched.policy != WeightPolicy.SYNC
        self._memory: Peaks | None = None
        # per device: the (stage, segment) keys it computes and how many F, B, I and W of
        # each it runs, as index arrays (stages, segments) and a (4, keys) count matrix
        self.counts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        row = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 3}
        for order in sched.orders:
            n: dict[tuple[int, int], list[int]] = {}
            for a in order:
                r = row.get(a.kind)
                if r is not None:
                    n.setdefault((a.stage, a.segment), [0, 0, 0, 0])[r] += 1
            self.counts.append((np.array([k[0] for k in n], dtype=int), np.array([k[1] for k in n], dtype=int),
                                np.array(list(n.values()), dtype=float).reshape(len(n), 4).T))
        # the stages each device holds (every pipe's), and each stage's replicas' devices
        self.stages_on = [sorted({s for _, s in sched.placement.stages_on(d)}) for d in range(sched.num_devices)]
        self.replica_devices = [tuple(d for _, d in sched.placement.replicas(s)) for s in range(sched.num_stages)]
        self.overlapped = len(sched.overlapped)
        self.microbatches_per_update = sched.microbatches_per_step or sched.num_microbatches
        self.updates = max(1, sched.num_microbatches // self.microbatches_per_update) if self.asynchronous else 1
        self._replicated: dict[tuple, Peaks] = {}  # walk -> one replica's memory
        self._gathers: dict[str, dict] = {}  # pipeline.gather -> all-gathers a step per (pipe, stage)
        self._replicas: dict[tuple, Schedule] = {}  # walk -> one replica's schedule
        self.pairs = False  # ZeRO-2's and ZeRO-3's (step) walks together (StructureCache.pairs)

    @property
    def memory(self) -> Peaks:
        """Per device: the terms its memory holds and the instants that can be its peak
        (walked when first asked for: the simulated phase never asks)."""
        if self._memory is None:
            self._memory = Peaks(tapes(self.schedule))
        return self._memory

    @staticmethod
    def walk_of(shard: str, gather: str, replicas: bool) -> tuple:
        """Which walk prices a candidate's memory: ("plain",) one replica alone, or a
        replicated one (:meth:`replicated`): ZeRO-2's for none, optimizer and gradients, one per
        gather policy of full."""
        if not replicas:
            return ("plain",)
        return ("full", gather) if shard == "full" else ("gradients", "")

    def encoded_tapes(self, walk: tuple, index: dict) -> list[np.ndarray]:
        """The walk's tapes (:meth:`walk_of`), each device's steps :func:`encoded` over
        ``index`` (the terms' numbers, shared by the walks to compare)."""
        return [encoded(t, index) for t in self._tapes(walk)[walk]]

    def _tapes(self, walk: tuple) -> dict[tuple, list]:
        """walk -> its tapes: the walk's, and with ``pairs`` ZeRO-2's and ZeRO-3's gathered
        once a step together (one pass: :func:`tapes`' bare twin)."""
        if walk == ("plain",):
            return {walk: tapes(self.schedule)}
        if self.pairs and walk in PAIRED:
            full, bare = tapes(self._replica(PAIRED[1]), replicas=2, bare="gradients")
            return {PAIRED[0]: bare, PAIRED[1]: full}
        return {walk: tapes(self._replica(walk), replicas=2)}

    def _replica(self, walk: tuple) -> Schedule:
        """One replica's schedule for the walk (built once: its walks and its gathers read it)."""
        got = self._replicas.get(walk)
        if got is None:
            got = as_replica(self.schedule)
            if walk[0] == "full":
                got = with_gathers(got, walk[1], every_stage=True)
            got = dataclasses.replace(got, shard=walk[0])
            self._replicas[walk] = got
        return got

    def replicated(self, shard: str, gather: str) -> Peaks:
        """The memory of one replica among data-parallel ones sharding ``shard`` (gathering by
        ``gather`` under full): one replica's walks as if among 2, each term valued by
        :func:`priced_as`. One walk, ZeRO-2's, serves none, ZeRO-1 and ZeRO-2."""
        walk = self.walk_of(shard, gather, True)
        got = self._replicated.get(walk)
        if got is None:  # (one replica's lists: the others walk alike)
            for w, walked in self._tapes(walk).items():
                self._replicated[w] = Peaks(walked)
            got = self._replicated[walk]
        return got

    def gathers(self, gather: str) -> dict:
        """ZeRO-3's all-gathers a step per (pipe, stage) under ``gather``, without a walk."""
        got = self._gathers.get(gather)
        if got is None:
            got = self._gathers[gather] = gathers_per_step(self._replica(("full", gather)))
        return got


# the walks one pass gives together (Structure._tapes): ZeRO-2's, and ZeRO-3's gathered once a step
PAIRED = (("gradients", ""), ("full", "step"))

# the memory terms that carry a stage's replica count (pipeflow.sim.memory_terms)
_SLICED = frozenset({"sharded_optimizer_state", "gradient_slice", "own_share", "parameter_shard",
                     "sharded_step_workspace"})


def priced_as(key: tuple, shard: str, replicas: int) -> tuple:
    """A term of a walk built with 2 replicas (ZeRO-2's or ZeRO-3's) as ``shard`` with
    ``replicas`` prices it: its count of copies times the replicas; without sharding the state
    and step whole; with one replica no reduction at all (the schedule's own walk)."""
    name = key[0]
    if replicas == 1 and name == "flat_gradients":
        return ("nothing",)
    if shard in ("none", "optimizer") and name in ("scattered_gradients", "gradient_slice"):
        return ("nothing",)
    if shard == "none" and name == "sharded_optimizer_state":
        return ("state", key[1], "optimizer_state")
    if shard == "none" and name == "sharded_step_workspace":
        return ("step_workspace_bytes", key[1])
    if name == "sharded_step_workspace":
        return (name, key[1], key[2] * replicas // 2, shard)
    return (*key[:2], key[2] * replicas // 2, *key[3:]) if name in _SLICED else key


class StructureCache:
    """Structures by (schedule, p, m, v, s), built once each; a refusal is cached too."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Structure | str] = {}
        self.built = 0  # structures built (clear() lets them go, not the count)
        # walk ZeRO-2's and ZeRO-3's (gathered once a step) walks of a structure together,
        # where a search prices both (one pass: what they share walked once)
        self.pairs = False

    def get(self, name: str, p: int, m: int, v: int, s: int) -> Structure | str:
        """The structure, or the generator's one-sentence refusal."""
        key = (name, p, m, v, s)
        got = self._cache.get(key)
        if got is None:
            try:
                got = Structure(name, p, m, v, s)
                got.pairs = self.pairs
                self.built += 1
            except ScheduleConfigError as err:
                got = str(err)
            self._cache[key] = got
        return got

    def periodic(self, name: str, p: int, m: int, period: int, v: int, s: int, walk: tuple) -> Periodic | None:
        """The periodic walk (:class:`~pipeflow.sim.memory_peaks.Periodic`) from m microbatches on,
        one period being ``period`` more, from the walks at m and two periods on; None when a size
        is refused or the walks are not periodic there."""
        key = ("periodic", name, p, m, period, v, s, walk)
        got = self._cache.get(key)
        if got is None:
            built = [self.get(name, p, x, v, s) for x in (m, m + 2 * period)]
            if any(isinstance(b, str) for b in built):
                self._cache[key] = False
                return None
            walked = [b._tapes(walk) for b in built]  # (with pairs, both walks of the pair)
            for w in walked[0]:
                index: dict = {}
                try:
                    periodic = Periodic(*([encoded(t, index) for t in x[w]] for x in walked), list(index))
                except NotPeriodic:
                    periodic = False
                self._cache[("periodic", name, p, m, period, v, s, w)] = periodic
            got = self._cache[key]
        return got or None

    def clear(self) -> None:
        """Let go of every structure and walk built so far."""
        self._cache.clear()

    def __len__(self) -> int:
        """The structures built (each once while kept)."""
        return self.built
