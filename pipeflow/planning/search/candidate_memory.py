"""A search candidate's memory: each device's peak as the simulator's walk counts it, from the schedule's
walks and the candidate's bytes per term."""

from __future__ import annotations

import numpy as np

from pipeflow.schedules.periods import periods_past_fill
from pipeflow.sim.memory_terms import term_value
from pipeflow.sim.memory_terms import ONE_STAGE, TWO_STAGES, like_stage

from ..cost import AnalyticCost
from .closed_form import Structure, priced_as
from .space import Candidate


class MemoryPrices:
    """Each device's peak bytes for a candidate, a mixin of :class:`~.price.Pricer`: the schedule's periodic
    walks where they serve (:meth:`needs`), else its walk at its own size (:meth:`_needs`); the fullest
    device against its limit (:meth:`_worst`)."""

    def periodic(self, c: Candidate) -> tuple[int, int, int] | None:
        """(m0, period, k): the candidate's m is k periods past m0, from which the walks repeat
        (:mod:`pipeflow.schedules.periods`); None without a rule or below the fill."""
        return periods_past_fill(c.schedule, c.stages, c.virtual_stages, c.segments, c.microbatches)

    def _values(self, cost: AnalyticCost, terms: list, c: Candidate, replicas: bool) -> np.ndarray:
        """The bytes of a walk's ``terms`` under ``cost`` at ``c``'s level and replicas (``replicas``:
        :func:`priced_as`), each distinct term valued once per cost."""
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
        number, named, forms = self._term_numbers, self._term_keys, self._forms
        out = []
        for k in keys:
            n = number.get(k)
            if n is None:
                n = number[k] = len(named)
                named.append(k)
                forms.add(k)
            out.append(n)
        return np.array(out, dtype=np.int64)

    def _valued(self, cost: AnalyticCost, numbers: np.ndarray) -> np.ndarray:
        """The bytes of the terms ``numbers`` under ``cost`` (a new array), each valued once per cost."""
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
            # on which cost model: valued once for every cost model of that shape, under
            # its form and its stages' kinds as one number (TermForms)
            shape, kinds = self._forms.of(cost, self)
            shared = self._shared_terms.setdefault(shape, {})  # (one shape's: a small table)
            form, first, second = self._forms.arrays()
            todo = np.unique(numbers[missing])
            one, two = first[todo], second[todo]
            alike = (form[todo] << 40) | (np.where(one >= 0, kinds[one], 0) << 20) | np.where(two >= 0, kinds[two] + 1, 0)
            got = []
            for n, key, own in zip(todo.tolist(), alike.tolist(), (one < 0).tolist()):
                if own:  # (a term of no stage: its own)
                    got.append(term_value(keys[n], cost, None, values))
                    continue
                v = shared.get(key)
                if v is None:
                    v = shared[key] = term_value(keys[n], cost, None, values)
                got.append(v)
            known[todo] = got
            out = known[numbers]
        return out

    def _shape(self, cost: AnalyticCost):
        """What a cost model's terms depend on besides its stages' kinds (its tables' shape, host kernels,
        step); a cost model without ``shared`` shares with none."""
        number = getattr(cost, "shape_number", None)
        if number is None:
            return ("own", id(cost))
        return (number, getattr(cost, "product_scratch", None), getattr(cost, "attention_scratch", None),
                getattr(cost, "step_impl", "fused"))

    def _stage_kinds(self, cost: AnalyticCost) -> list[tuple]:
        """Each stage's kind: (its layers, first, last)."""
        last = cost.num_stages - 1
        return [(n, s == 0, s == last) for s, n in enumerate(cost.layers_per_stage)]

    def release(self) -> None:
        """Let go of what one group of candidates built (the terms' numbering stays)."""
        for q in self._tensors.values():
            for cache in (q._costs, q._tables, q._terms, q._term_bytes, q._needs_cache, q._work_cache, q._flat,
                          q._kinds, q._term_index, q._compiled, q._memo):
                cache.clear()
        self._forms.forget()
        self.structures.clear()

    def needs(self, c: Candidate, cost: AnalyticCost) -> np.ndarray | None:
        """Bytes each device of one replica needs at its peak at the candidate's m from the periodic walks,
        or None where they do not serve."""
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
        """Bytes each device of one replica needs at its peak, as the simulator's memory walk counts them."""
        replicas = self._replicated(c, st)
        return self._peaks(st.replicated(c.shard, c.gather) if replicas else st.memory, cost, c, replicas)

    @staticmethod
    def _replicated(c: Candidate, st: Structure) -> bool:
        """Whether the candidate is priced on its schedule's replicated walk (with replicas, or a
        synchronous chain, whose walk serves every replica count); else its own walk."""
        if st.asynchronous:
            return False
        return c.data_parallel > 1 or st.schedule.placement.num_pipes == 1

    def _peaks(self, mem, cost: AnalyticCost, c: Candidate, replicas: bool, k: int = 0) -> np.ndarray:
        """A walk's peak per device under ``cost`` at ``c``'s level and replicas."""
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


class TermForms:
    """The search's memory terms as numbers: each term's form (its key without its stages) and stages, the
    cost models' shapes and stage kinds, so a term under a cost model is one integer (form << 40 | first
    kind << 20 | second kind + 1)."""

    LIMIT = 1 << 20  # forms, shapes and kinds numbered

    def __init__(self) -> None:
        self._ids: dict = {}  # form, shape or kind of stage -> its number
        self._form: list[int] = []
        self._first: list[int] = []
        self._second: list[int] = []
        self._arrays: tuple | None = None
        self._costs: dict[int, tuple] = {}  # id(cost) -> (its shape's number, its stages' kinds' numbers)

    def _id(self, thing) -> int:
        got = self._ids.get(thing)
        if got is None:
            got = self._ids[thing] = len(self._ids)
            if got >= self.LIMIT:
                raise RuntimeError(f"pipeflow-search: more than {self.LIMIT} memory terms' forms, shapes and kinds "
                                   "of stage: the numbers would overlap")
        return got

    def add(self, key: tuple) -> None:
        """The next term number's key (as like_stage gives it)."""
        name = key[0]
        if name in ONE_STAGE:
            form, one, two = (name, None, *key[2:]), key[1], -1
        elif name in TWO_STAGES:
            form, one, two = (name, None, None, *key[3:]), key[1], key[2]
        else:
            form, one, two = key, -1, -1
        self._form.append(self._id(("form", form)))
        self._first.append(one)
        self._second.append(two)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(form, first stage, second stage) by term number."""
        if self._arrays is None or len(self._arrays[0]) != len(self._form):
            self._arrays = tuple(np.array(x, dtype=np.int64) for x in (self._form, self._first, self._second))
        return self._arrays

    def of(self, cost: AnalyticCost, prices: MemoryPrices) -> tuple[int, np.ndarray]:
        """(the number of the cost model's shape, its stages' kinds' numbers), once per
        cost model; a cost model without a shape of its own shares with none."""
        got = self._costs.get(id(cost))
        if got is None:
            shape = prices._shape(cost)
            kinds = [self._id(("kind", k)) for k in prices._stage_kinds(cost)]
            number = self._id(("shape", shape)) if shape[0] != "own" else self._id(("own", len(self._ids)))
            got = self._costs[id(cost)] = (number, np.array(kinds, dtype=np.int64))
        return got

    def forget(self) -> None:
        """Let go of the cost models (:meth:`MemoryPrices.release`)."""
        self._costs.clear()
