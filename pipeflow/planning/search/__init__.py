"""Which schedule should I use? ``pipeflow-search`` (docs/planning.md): :func:`search`
enumerates the candidates (:mod:`.space`), prices each in closed form (:mod:`.closed_form`)
and simulates the most promising that fit (:mod:`.price`)."""

from __future__ import annotations

import gc
import multiprocessing
from contextlib import contextmanager
import re
import os
import signal
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

from .price import CLOSED_FORM, SIMULATED, Priced, Pricer, pareto
from .progress_line import Progress
from .space import (GATHERS, PARTITIONS, RECOMPUTE, SHARDS, SPLITS, Candidate, SearchSpace, candidates,
                    default_schedules, searchable)

__all__ = ["CLOSED_FORM", "SIMULATED", "GATHERS", "PARTITIONS", "RECOMPUTE", "SHARDS", "SPLITS", "Candidate", "NothingFits", "Priced", "Pricer",
           "SearchResult", "SearchSpace", "candidates", "collector_off", "default_schedules", "default_workers", "pareto", "search", "searchable"]

GIB = 2**30


class NothingFits(ValueError):
    """No candidate fits the memory limit; the message names the smallest requirement found."""


@dataclass
class SearchResult:
    considered: int  # candidates enumerated
    refused: dict[str, int]  # a schedule's or the cost model's rule -> candidates it refused
    closed: list[Priced]  # every priced candidate, closed form, fastest first
    ranked: list[Priced]  # the simulated ones that fit, fastest first (ranked[0] is the pick)
    out_of_memory: list[Priced]  # those that do not fit (simulated where simulated), least over first
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> Priced:
        return self.ranked[0]

    @property
    def simulated(self) -> list[Priced]:
        return self.ranked + [q for q in self.out_of_memory if q.how == SIMULATED]


def _rule(c: Candidate, why: str) -> str:
    """A refusal grouped by its rule: 'dualpipe_v: pipeline.microbatches: ... needs at least
    two per stage of the V ...' (the sizes replaced by n)."""
    key, _, rule = why.partition(": ")
    return f"{c.schedule}: {key.split('=')[0]}: " + re.sub(r"\b\d+\b", "n", rule or key)


# the search.* keys a rule's key comes from (its candidates' sizes are the search's options)
_SEARCH_KEYS = {"pipeline.microbatches": ("search.global_batch", "search.microbatch_sizes"),
                "pipeline.microbatch_size": ("search.microbatch_sizes",), "pipeline.stages": ("search.stages",),
                "pipeline.data_parallel": ("search.devices",), "pipeline.virtual_stages": ("search.virtual_stages",),
                "pipeline.segments": ("search.segments",), "schedule.split": ("search.splits",),
                "model.recompute": ("search.recompute",), "partition.name": ("search.partitions",),
                "pipeline.shard": ("search.shard",), "pipeline.gather": ("search.gather",),
                "pipeline.tensor_parallel": ("search.tensor_parallel",)}
# and those behind a reason space.candidates left combinations out for
_LEFT_OUT_KEYS = {"global batch": ("search.global_batch", "search.microbatch_sizes"),
                  "than layers": ("search.stages", "search.virtual_stages"), "asynchronous": ("search.schedules",)}


def _none_run(space: SearchSpace, n: int, refused: dict[str, int], said: dict[str, str]) -> str:
    """The sentence for a search none of whose candidates can run: the key the commonest rule
    comes from, up to three rules with how many candidates each refused, and the keys to
    change."""
    if refused:
        rules = sorted(refused, key=lambda r: (-refused[r], r))[:3]
        keys = [k for r in rules for k in _SEARCH_KEYS.get(r.split(": ")[1], ())]
        reasons = "; ".join(f"{refused[r]} of them: {said[r]}" for r in rules)
        head = f"none of the {n} candidates can run"
    else:  # none built: what left the combinations out
        left_out = sorted(space.skipped.items(), key=lambda kv: -kv[1])[:3]
        keys = [k for why, _ in left_out for words, ks in _LEFT_OUT_KEYS.items() if words in why for k in ks]
        reasons = "; ".join(f"{why}: {k} left out" for why, k in left_out) or "none was made"
        head = "no combination of the search's options adds up"
    keys = list(dict.fromkeys([*keys, "search.schedules"]))
    change = ", ".join(keys[:-1]) + f" or {keys[-1]}" if len(keys) > 1 else keys[0]
    return f"{keys[0]}={_setting(space, keys[0])}: {head} ({reasons}); change {change}"


def _setting(space: SearchSpace, key: str) -> str:
    """A search key's value as the command line writes it (lists in brackets, null)."""
    value = {"search.global_batch": space.global_batch, "search.devices": space.devices,
             "search.stages": space.stages, "search.schedules": space.schedules,
             "search.microbatch_sizes": space.microbatch_sizes, "search.virtual_stages": space.virtual_stages,
             "search.segments": space.segments, "search.splits": space.splits, "search.recompute": space.recompute,
             "search.partitions": space.partitions, "search.shard": space.shards, "search.gather": space.gathers,
             "search.tensor_parallel": sorted({t for t, _ in space.tensors})}.get(key)
    if value is None:
        return "null"
    return f"[{','.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)


_PRICER: Pricer | None = None  # the pricer a forked worker inherits
_PROGRESS: Progress | None = None  # and the phase's counters


def _each(price, batch: list[Candidate]) -> list:
    out = []
    for c in batch:
        out.append(price(c))
        if _PROGRESS is not None:
            _PROGRESS.priced(c, out[-1])
    return out


def _closed_forms(batch: list[Candidate]) -> list[Priced | str]:
    """A group's closed forms; then what the group built goes (Pricer.release: no other
    group's candidate needs it, and a search that kept every group's would hold gigabytes)."""
    try:
        return _each(_PRICER.closed_form, batch)
    finally:
        _PRICER.release()


_CLOSED: dict = {}  # candidate -> its closed-form price, for the simulated phase (forked with it)


def _simulate(batch: list[Candidate]) -> list[Priced]:
    return _each(lambda c: _PRICER.simulated(c, _CLOSED.get(c)), batch)


def _groups(items: list, key) -> list[list]:
    """Items in groups of the same ``key``, the largest first: a worker takes whole groups (it
    builds what they share once), the largest first so none is left with one at the end."""
    groups: dict = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    return sorted(groups.values(), key=len, reverse=True)


def _map(fn, items: list, workers: int, key, phase: str = "", report: tuple = (None, None)) -> list[tuple]:
    """(item, result) pairs of fn over items, in ``workers`` forked processes when more
    than one (each inherits the pricer and takes whole groups by ``key``). ``report``:
    (seconds between progress lines, where a line goes) for :class:`.progress_line.Progress`."""
    global _PROGRESS, _BATCHES
    every, say = report
    if workers <= 1 or len(items) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        _PROGRESS = Progress(phase, items, every, say)
        try:  # (by groups as the workers take them: the same order, and what a group shares built once)
            out = [pair for b in _groups(items, key) for pair in zip(b, fn(b))]
            _PROGRESS.tell(final=True)
        finally:
            _PROGRESS = None
        return out
    _BATCHES = batches = _groups(items, key)  # (before the fork: a worker is sent a group's index, not the group)
    _PROGRESS = progress = Progress(phase, items, every, say, shared=True)  # before the fork: the workers count
    pool = ProcessPoolExecutor(min(workers, len(batches)), mp_context=multiprocessing.get_context("fork"),
                               initializer=_die_with_parent)
    try:
        futures = [pool.submit(_batch, fn, i) for i in range(len(batches))]
        while True:
            done, pending = wait(futures, timeout=progress.poll(), return_when=FIRST_EXCEPTION)
            if not pending or any(f.exception() for f in done):
                break
            progress.tell()
        out = [pair for b, f in zip(batches, futures) for pair in zip(b, f.result())]
        progress.tell(final=True)
    except BaseException:  # a signal (Ctrl-C, SIGTERM) or an error: the workers go now, not after their batch
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        _PROGRESS, _BATCHES = None, []
    pool.shutdown()
    return out


_BATCHES: list[list] = []  # the groups a forked worker takes by index


def _batch(fn, i: int) -> list:
    return fn(_BATCHES[i])


def _die_with_parent() -> None:
    """A search worker's start: it ends with the search whatever ends the search (Linux:
    the kernel sends it SIGTERM when its parent dies, even by SIGKILL), and leaves
    Ctrl-C to its parent, which stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # not the app's handler, forked with it: end quietly
        signal.signal(sig, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's handling above only
        pass
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(1)


def default_workers() -> int:
    """The processes a search prices in: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def search(space: SearchSpace, pricer: Pricer, simulate_top: int = 16, workers: int = 1,
           progress_every: float | None = None, say: Callable[[str], None] | None = None) -> SearchResult:
    """Search ``space``: price every candidate in closed form, simulate the ``simulate_top`` fastest
    that fit and each schedule's fastest, rank by the simulator, in ``workers`` processes;
    ``say`` gets a progress line every ``progress_every`` seconds (0: every chance; None: none).
    NothingFits when no candidate fits, ValueError when none can be built."""
    with collector_off():
        return _search(space, pricer, simulate_top, workers, progress_every, say)


@contextmanager
def collector_off():
    """Python's cycle collector off inside, as it was after: a search's millions of small, kept,
    acyclic objects cost ~15% of its time in the collector's passes."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _search(space: SearchSpace, pricer: Pricer, simulate_top: int, workers: int, progress_every: float | None,
            say: Callable[[str], None] | None) -> SearchResult:
    global _PRICER
    t0 = time.perf_counter()
    refused: dict[str, int] = {}
    said: dict[str, str] = {}  # a rule -> the first sentence it refused a candidate in, numbers and all
    closed: list[Priced] = []
    every = list(candidates(space))
    n = len(every)
    # both ZeRO-2's walk (none, optimizer, gradients) and ZeRO-3's gathered once a step
    # wanted: one pass walks both
    pricer.structures.pairs = "full" in space.shards and "step" in space.gathers and bool(
        {"none", "optimizer", "gradients"} & set(space.shards))
    _PRICER = pricer
    try:
        # (a worker gets whole groups of the same stages x chunks and segments: every
        # schedule's structures, and the cost models and terms they share, built once)
        for c, q in _map(_closed_forms, every, workers, lambda c: (c.stages * c.virtual_stages, c.segments),
                         "closed form",
                         (progress_every, say)):
            if isinstance(q, str):
                rule = _rule(c, q)
                refused[rule] = refused.get(rule, 0) + 1
                said.setdefault(rule, q)
            else:
                closed.append(q)
    finally:
        _PRICER = None
    t1 = time.perf_counter()
    if not closed:
        raise ValueError(_none_run(space, n, refused, said))
    closed.sort(key=lambda q: q.step_time)
    fitting = [q for q in closed if q.fits]
    if not fitting:
        least = min(closed, key=lambda q: q.over)
        raise NothingFits(
            f"no candidate fits {least.memory_limit / GIB:.3g} GiB per device (of {len(closed)} priced): the smallest "
            f"requirement found is {least.peak_memory / GIB:.3g} GiB on device {least.device}, "
            f"{least.candidate.label()}; raise the memory limit to at least that, or add devices")
    chosen: dict[Candidate, Priced] = {}
    for q in fitting[:simulate_top]:
        chosen[q.candidate] = q
    seen: set = set()
    for q in fitting:  # the fastest of every schedule and tensor degree, so each has a row to compare
        for kind in (q.candidate.schedule, (q.candidate.tensor_parallel, q.candidate.sequence_parallel)):
            if kind not in seen:
                seen.add(kind)
                chosen.setdefault(q.candidate, q)
    _PRICER = pricer
    _CLOSED.update(chosen)
    try:
        simulated = [q for _, q in _map(_simulate, list(chosen), workers, lambda c: c, "simulated",
                                        (progress_every, say))]
    finally:
        _PRICER = None
        _CLOSED.clear()
    t2 = time.perf_counter()
    ranked = sorted((q for q in simulated if q.fits), key=lambda q: q.step_time)
    sim_oom = [q for q in simulated if not q.fits]
    done = {q.candidate for q in simulated}
    oom = sorted(sim_oom + [q for q in closed if not q.fits and q.candidate not in done], key=lambda q: q.over)
    if not ranked:  # every simulated one was over after all: the closest is what to report
        least = min(sim_oom, key=lambda q: q.over)
        raise NothingFits(
            f"no simulated candidate fits {least.memory_limit / GIB:.3g} GiB per device: the smallest requirement "
            f"found is {least.peak_memory / GIB:.3g} GiB, {least.candidate.label()}")
    return SearchResult(n, refused, closed, ranked, oom, time.perf_counter() - t0,
                        {"closed_form": t1 - t0, "simulation": t2 - t1, "structures": len(pricer.structures)})
