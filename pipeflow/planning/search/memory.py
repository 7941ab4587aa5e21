"""A search candidate's memory: each device's peak as the simulator's walk counts it, from
the schedule's walks (:mod:`.closed_form`) and the candidate's own bytes per term (a
mixin of :class:`~.price.Pricer`: it reads the pricer's structures, costs and caches)."""

from __future__ import annotations

import numpy as np

from pipeflow.sim.memory import term_value
from pipeflow.sim.memory_terms import ONE_STAGE, TWO_STAGES, like_stage

from ..cost import AnalyticCost
from .closed_form import PERIODS, Structure, priced_as
from .space import Candidate


class MemoryPrices:
    """Each device's peak bytes for a candidate: its schedule's periodic walks where they
    serve (:meth:`needs`), else the walk at its own size (:meth:`_needs`); its fullest
    device against its limit (:meth:`_worst`)."""

    def periodic(self, c: Candidate) -> tuple[int, int, int] | None:
        """(m0, period, k): the candidate's m is k periods past m0, a size from which the
        schedule's walks repeat one block a period (closed_form.PERIODS); None where the
        schedule has no rule or m is below its fill. (The walks are at m0 and m0 + 2
        periods; k may be anything from 0: the blocks stand k times.)"""
        rule = PERIODS.get(c.schedule)
        if rule is None:
            return None
        fill, q = rule(c.stages, c.virtual_stages, c.segments, c.microbatches)
        if c.microbatches < fill:
            return None
        m0 = fill + (c.microbatches - fill) % q
        return m0, q, (c.microbatches - m0) // q

    def _values(self, cost: AnalyticCost, terms: list, c: Candidate, replicas: bool) -> np.ndarray:
        """The bytes of a walk's ``terms`` under ``cost``, as ``c``'s level and replicas
        price them (``replicas``: a replicated walk's terms, :func:`priced_as`); each
        distinct term valued once per cost, a stage's as the first of its kind's
        (AnalyticCost.stage_kinds). The walk's terms as they stand are valued once per
        cost; a level and a number of replicas change a few of them (the shards, the
        slices), valued on top."""
        kinds = self._kinds.get(id(cost))
        if kinds is None:
            kinds = self._kinds[id(cost)] = tuple(cost.stage_kinds())
        key = (id(terms), kinds)
        got = self._term_index.get(key)
        if got is None:  # (built once per walk and kinds of stage: each term's number among all)
            got = self._term_index[key] = (terms, self._numbers([like_stage(k, kinds) for k in terms]))
        out = self._valued(cost, got[1])
        if not replicas:
            return out
        level = (id(terms), c.shard, c.data_parallel, kinds)
        moved = self._term_index.get(level)
        if moved is None:  # the terms the level and the replicas price otherwise: where, and as what
            where = self._term_index.get(level[:3])
            if where is None:  # (once per walk and level; the kinds of stage, per cost model)
                pos, keys = [], []
                for i, k in enumerate(terms):
                    q = priced_as(k, c.shard, c.data_parallel)
                    if q != k:
                        pos.append(i)
                        keys.append(q)
                where = self._term_index[level[:3]] = (np.array(pos, dtype=np.int64), keys)
            moved = self._term_index[level] = (where[0], self._numbers([like_stage(q, kinds) for q in where[1]]))
        pos, numbers = moved
        if len(pos):
            out[pos] = self._valued(cost, numbers)
        return out

    def _numbers(self, keys: list) -> np.ndarray:
        """Each term's number among every term the pricer has met."""
        number, named = self._term_numbers, self._term_keys
        out = []
        for k in keys:
            n = number.get(k)
            if n is None:
                n = number[k] = len(named)
                named.append(k)
            out.append(n)
        return np.array(out, dtype=np.int64)

    def _valued(self, cost: AnalyticCost, numbers: np.ndarray) -> np.ndarray:
        """The bytes of the terms ``numbers`` under ``cost`` (a new array): each term valued
        once per cost, kept in an array by its number."""
        known = self._term_bytes.get(id(cost))
        size = len(self._term_numbers)
        if known is None or len(known) < size:
            grown = np.full(size, np.nan)
            if known is not None:
                grown[:len(known)] = known
            known = self._term_bytes[id(cost)] = grown
        out = known[numbers]
        missing = np.isnan(out)
        if missing.any():
            keys = self._term_keys
            values = self._terms.setdefault(id(cost), {})
            # a term's bytes depend on the cost model's shape and on the kinds of the stages it
            # names (AnalyticCost.stage_kinds: their layers, first or not, last or not), not
            # on which cost model: valued once for every cost model of that shape
            shared, shape, kind = self._shared_terms, self._shape(cost), self._stage_kinds(cost)
            for n in np.unique(numbers[missing]).tolist():
                k = keys[n]
                name = k[0]
                if name in ONE_STAGE:
                    alike = (shape, name, kind[k[1]], *k[2:])
                elif name in TWO_STAGES:
                    alike = (shape, name, kind[k[1]], kind[k[2]], *k[3:])
                else:
                    alike = None  # (a term of no stage: its own)
                v = shared.get(alike) if alike is not None else None
                if v is None:
                    v = term_value(k, cost, None, values)
                    if alike is not None:
                        shared[alike] = v
                known[n] = v
            out = known[numbers]
        return out

    def _shape(self, cost: AnalyticCost):
        """What a cost model's terms depend on besides the kinds of their stages: its
        tables' shape (AnalyticCost's ``shared``) and the host's kernels and optimizer step
        set on it after them; a cost model built without ``shared`` shares with none."""
        number = getattr(cost, "shape_number", None)
        if number is None:
            return ("own", id(cost))
        return (number, getattr(cost, "product_scratch", None), getattr(cost, "attention_scratch", None),
                getattr(cost, "step_per_tensor", False))

    def _stage_kinds(self, cost: AnalyticCost) -> list[tuple]:
        """Each stage's kind: (its layers, first, last)."""
        got = self._kinds.get(("tuples", id(cost)))
        if got is None:
            last = cost.num_stages - 1
            got = [(n, s == 0, s == last) for s, n in enumerate(cost.layers_per_stage)]
            self._kinds[("tuples", id(cost))] = got
        return got

    def needs(self, c: Candidate, cost: AnalyticCost) -> np.ndarray | None:
        """Bytes each device of one replica needs at its peak at the candidate's own m,
        from the schedule's periodic walks (:meth:`periodic`), or None where they do not
        serve. With replicas, the walk of one among them (their reductions' buffers and
        what they shard)."""
        at = self.periodic(c)
        if at is None:
            return None
        m0, q, k = at  # (every schedule with a rule is synchronous)
        st = self.structures.get(c.schedule, c.stages, m0, c.virtual_stages, c.segments)
        if isinstance(st, str):
            return None
        walk = Structure.walk_of(c.shard, c.gather, self._replicated(c, st))
        mem = self.structures.periodic(c.schedule, c.stages, m0, q, c.virtual_stages, c.segments, walk)
        if mem is None:
            return None
        return self._peaks(mem, cost, c, walk != ("plain",), k)

    def _needs(self, st: Structure, cost: AnalyticCost, c: Candidate) -> np.ndarray:
        """Bytes each device of one replica needs at its peak, as the simulator's memory
        walk counts them (model state, activations, messages, workspaces; with replicas,
        their reductions' buffers and what they shard)."""
        replicas = self._replicated(c, st)
        return self._peaks(st.replicated(c.shard, c.gather) if replicas else st.memory, cost, c, replicas)

    @staticmethod
    def _replicated(c: Candidate, st: Structure) -> bool:
        """Whether the candidate's memory is priced on its schedule's replicated walk: with
        replicas, and without them too where one pipeline holds each stage once (a
        synchronous chain: the walk without replicas is that walk with nothing at its
        REDUCEs, :func:`priced_as` with one replica), so that one walk of the schedule
        serves every number of replicas; else (Chimera's two pipelines reduce each stage
        within a replica; asynchronous policies) the schedule's own walk."""
        if st.asynchronous:
            return False
        return c.data_parallel > 1 or st.schedule.placement.num_pipes == 1

    def _peaks(self, mem, cost: AnalyticCost, c: Candidate, replicas: bool, k: int = 0) -> np.ndarray:
        """A walk's (:class:`~pipeflow.sim.memory_peaks.Peaks`, or ``Periodic`` at k
        periods) peak per device under ``cost``, at ``c``'s level and replicas (once each)."""
        key = (id(cost), id(mem), k, *((c.shard, c.data_parallel) if replicas else ()))
        got = self._needs_cache.get(key)
        if got is None:
            got = self._needs_cache[key] = mem.peaks(self._values(cost, mem.terms, c, replicas), k)
        return got

    def _worst(self, c: Candidate, needs: np.ndarray) -> tuple[float, float, int]:
        """(peak bytes, limit, device) of the fullest device relative to its limit, over every replica."""
        p = len(needs)
        key = (p, c.data_parallel, "devices")
        got = self._memo.get(key)
        if got is None:  # the devices [stage device, replica], their workspaces and limits
            dev = np.arange(p)[:, None] + p * np.arange(c.data_parallel)[None, :]
            got = self._memo[key] = (dev, np.array([[self.topology.workspace_bytes(int(x)) for x in row] for row in dev]),
                                      np.array([[self.limit(int(x)) for x in row] for row in dev], dtype=float))
        dev, workspace, limit = got
        held = np.asarray(needs, dtype=float)[:, None] + workspace  # the math libraries' own, throughout
        at = int(np.argmax(held - limit))  # (the first of the fullest, stage device first)
        return float(held.flat[at]), float(limit.flat[at]), int(dev.flat[at])
