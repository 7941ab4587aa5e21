"""Cost models: how long each action takes and how many bytes it moves and keeps.

:class:`CostModel` is the simulator's interface; :class:`AnalyticCost` prices a transformer from its
FLOPs and its tensors' bytes (docs/planning.md writes the formulas out). The others:
:class:`~.unit_cost.UnitCost` (textbook units, F = 1, B = 2), :class:`~.machine_cost.ProfiledCost` and
:class:`~.machine_cost.CalibratedCost` (measured)."""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ..sim.memory_terms import REQUIRED, MissingTerm, missing_terms
from ..topology.topology import Device
from .layer_cost import LayerCost, layer_cost  # noqa: F401 - re-exported (branched_cost, plans, tests)
from .tensor_cost import TensorShards, sequence_parallel_layer, shard_spec
from .held_outputs import HeldOutputs
from .model_state import gradient_bytes, parameter_state, step_time
from .operator_cost import OperatorTimes
from .saved_tensors import first_stage_saved, head_residual, last_stage_saved
from .working_set import BackwardWorkingSet, WorkingSetTerms, checked_segment
from .transformer import (
    TransformerSpec,
    arrived_input_saved,
    embedding_params,
    head_forward_flops,
    layer_matrix_params,
    shared_head_params,
    own_key_bytes,
    stage_params,
    stage_shared_saved,
)

KINDS = ("F", "B", "I", "W", "S")


# the memory terms of a cost model that prices only what a forward keeps, the messages
# and the model state (pipeflow.sim.memory_terms): it holds no working sets, outputs or
# zero-bubble residual terms apart from those
COARSE_ABSENT = frozenset(REQUIRED - {"state_bytes", "param_bytes", "activation_bytes", "weight_residual_bytes",
                                      "message_bytes"})


class CostModel(ABC):
    """Time of each action and the bytes of each memory term. A concrete cost model prices each term of
    :mod:`pipeflow.sim.memory_terms` or lists it in ``absent_terms``, checked when the class is defined
    (MissingTerm)."""

    name: str
    absent_terms: frozenset = frozenset()  # the memory terms it does not price (0 bytes, said so)
    num_stages: int
    # When set, every message takes exactly this long and occupies no link: the cost
    # model's own time unit (unit costs are abstract, so a topology's seconds would not
    # mix with them). None means messages are priced by the topology's links.
    message_time: float | None = None
    time_unit: str = "s"  # what compute_time returns
    # cost.overlap: how much of the shorter half of an overlapped F&B pair (DualPipeV) the
    # longer one hides, 0 (the halves run one after the other, as on CPU) to 1 (fully)
    overlap: float = 0.0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # (ABCMeta sets __abstractmethods__ only after this runs: a class still abstract is checked
        # where it is made concrete)
        if not any(getattr(getattr(cls, n, None), "__isabstractmethod__", False) for n in dir(cls)):
            wrong = missing_terms(cls)
            if wrong:
                raise MissingTerm(f"cost model {cls.__name__} breaks the memory contract "
                                  f"(pipeflow.sim.memory_terms): {'; '.join(wrong)}")

    @abstractmethod
    def compute_time(self, kind: str, stage: int, segment: int, device: Device) -> float:
        """Seconds (or units) of action ``kind`` in F, B, I, W, S (S: the stage's optimizer step)."""

    @abstractmethod
    def message_bytes(self, src_stage: int, dst_stage: int, segment: int) -> float:
        """Bytes F(src) sends to F(dst); the gradient sent back is the same size."""

    @abstractmethod
    def activation_bytes(self, stage: int, segment: int) -> float:
        """Bytes one forward keeps alive for its backward."""

    @abstractmethod
    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        """Of that, the bytes that stay after I until W (zero-bubble split)."""

    @abstractmethod
    def param_bytes(self, stage: int) -> float:
        """Gradient bytes a REDUCE all-reduces."""

    def model_state_bytes(self, stage: int) -> float:
        """Bytes of model state a stage holds for the whole run (0 if not modelled)."""
        return 0.0

    def state_bytes(self, stage: int) -> dict:
        """A stage's model state in bytes by category (this default: weights and the rest)."""
        weights = float(self.param_bytes(stage))
        return {"parameters": weights, "gradients": 0.0,
                "optimizer_state": max(0.0, float(self.model_state_bytes(stage)) - weights), "casts": 0.0}

    @abstractmethod
    def describe(self) -> dict: ...

    def _bad_kind(self, kind: str) -> ValueError:
        return ValueError(
            f"cost model '{self.name}' has no compute time for action kind {kind!r}; kinds: {', '.join(KINDS)} "
            f"(REDUCE time comes from the topology's all-reduce of param_bytes)"
        )


def _check_number(key: str, value, minimum: float = 0.0, strict: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ValueError(f"{key}={value!r}: must be a number {'>' if strict else '>='} {minimum}")
    return float(value)


def _check_int(key: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value!r}: must be a whole number >= {minimum}")
    return value


def uniform_layers(n_layer: int, num_stages: int) -> list[int]:
    """Layers per stage as even as possible, the first stages taking the remainder."""
    base, extra = divmod(n_layer, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def _host_kernel(name: str) -> property:
    """A property that is the working set's host kernel ``name`` (setting it replaces the working set)."""

    def get(self):
        return getattr(self.working_set, name)

    def put(self, value) -> None:
        self.working_set = dataclasses.replace(self.working_set, **{name: value})

    return property(get, put, doc=f"BackwardWorkingSet.{name}: this host's, for the working sets")


class AnalyticCost(TensorShards, WorkingSetTerms, HeldOutputs, OperatorTimes, CostModel):
    """Times from transformer FLOPs at ``efficiency`` of the device's peak (a roofline with its weight
    traffic), or from its measured operators on a device with a profile
    (:mod:`pipeflow.planning.operator_cost`); memory from the tensors the runtime keeps. Stage s holds
    ``layers_per_stage[s]`` blocks (embedding first, head last); segment i of a microbatch has
    ``segment_lengths[i]`` tokens (Seq1F1B). ValueError on a bad argument."""

    name = "analytic"
    # this host's kernels, set where the stages run on CPUs (pipeflow.config.prepare)
    product_scratch = _host_kernel("product_scratch")
    attention_scratch = _host_kernel("attention_scratch")
    step_impl = _host_kernel("step_impl")

    def __init__(
        self,
        spec: TransformerSpec,
        num_stages: int,
        microbatch_size: int = 1,
        efficiency: float = 0.5,
        dtype_bytes: int | None = None,  # None: 2 (bf16/fp16); pipeflow-simulate sets it from its precision
        layers_per_stage: Sequence[int] | None = None,
        segment_lengths: Sequence[int] | None = None,
        tensor_parallel: int = 1,  # pipeline.tensor_parallel: this prices one rank of a group of T (tensor_cost)
        sequence_parallel: bool = False,
        shared: dict | None = None,  # tables shared by the cost models of one search (_build_tables)
    ) -> None:
        self._shared = shared
        dtype_bytes = 2 if dtype_bytes is None else dtype_bytes
        self.tensor_parallel = _check_int("pipeline.tensor_parallel", tensor_parallel)
        self.sequence_parallel = bool(sequence_parallel) and tensor_parallel > 1
        self.full_spec = spec  # the whole model; self.spec is one tensor rank's shard of it
        spec = shard_spec(spec, tensor_parallel)
        self.spec = spec
        self.num_stages = _check_int("pipeline.stages", num_stages)
        self.microbatch_size = _check_int("microbatch_size", microbatch_size)
        self.efficiency = _check_number("cost.efficiency", efficiency, 0.0, strict=True)
        if self.efficiency > 1:
            raise ValueError(
                f"cost.efficiency={efficiency}: the fraction of peak FLOP/s reached; use a number in (0, 1]"
            )
        if dtype_bytes not in (1, 2, 4) or isinstance(dtype_bytes, bool):
            raise ValueError(
                f"cost.dtype_bytes={dtype_bytes!r}: bytes per activation/weight element; allowed values: 1, 2, 4"
            )
        self.dtype_bytes = dtype_bytes

        L = spec.n_layer
        if num_stages > L:
            raise ValueError(
                f"pipeline.stages={num_stages}: model '{spec.name}' has {L} layers, so at most {L} stages"
            )
        if layers_per_stage is None:
            layers = uniform_layers(L, num_stages)
        else:
            layers = list(layers_per_stage)
            if (
                len(layers) != num_stages
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers)
                or sum(layers) != L
            ):
                raise ValueError(
                    f"cost.layers_per_stage={layers}: needs {num_stages} whole numbers >= 1 "
                    f"(one per stage, pipeline.stages={num_stages}) adding up to model.n_layer={L}"
                )
        self.layers_per_stage = tuple(layers)

        if segment_lengths is None:
            segs = [spec.seq_len]
        else:
            segs = list(segment_lengths)
            if (
                not segs
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in segs)
                or sum(segs) != spec.seq_len
            ):
                raise ValueError(
                    f"cost.segment_lengths={segs}: needs whole numbers >= 1 adding up to model.seq_len={spec.seq_len}"
                )
        if len(segs) > 1 and not spec.causal:
            raise ValueError(
                f"cost.segment_lengths={segs}: sequence segments need causal attention, and model '{spec.name}' "
                f"is not causal (BERT attends both ways); use one segment"
            )
        self.segment_lengths = tuple(segs)
        self.prefixes = tuple(sum(segs[: i + 1]) for i in range(len(segs)))
        # what prices the backwards' working sets: its tables come with ours
        self.working_set = BackwardWorkingSet(spec, self.microbatch_size, dtype_bytes, self.segment_lengths,
                                              self.layers_per_stage)
        self._build_tables()

    @property
    def num_segments(self) -> int:
        return len(self.segment_lengths)

    def _build_tables(self) -> None:
        """FLOPs and bytes per (stage, segment), computed once: the simulator asks per action."""
        spec = self.spec
        last = self.num_stages - 1
        # a stage's rows depend on its layers, first or not, last or not: built once per
        # kind, and with ``shared`` (a search's thousands of cost models) once per kind and
        # shape (what else they depend on: the rank's spec, the microbatch, the dtype, the
        # segments, the tensor group, the host's attention kernel)
        shared = self._shared
        if shared is not None:
            shape = ("shape", spec, self.microbatch_size, self.dtype_bytes, self.segment_lengths,
                     self.sequence_parallel, self.tensor_parallel, self.attention_scratch)
            self.shape_number = shared.setdefault(shape, len(shared))
        ones = shared.get((self.shape_number, "ones")) if shared is not None else None
        if ones is None:
            ones = self._layer_rows()
            if shared is not None:
                shared[(self.shape_number, "ones")] = ones
        rows: dict[tuple, tuple] = {}
        for s, n in enumerate(self.layers_per_stage):
            if (kind := (n, s == 0, s == last)) in rows:
                continue
            got = shared.get((self.shape_number, kind)) if shared is not None else None
            rows[kind] = got if got is not None else self._stage_rows(n, s == 0, s == last, ones)
            if shared is not None:
                shared[(self.shape_number, kind)] = rows[kind]
        fwd, iws, trans, kvg, extra, wgt, act, res = zip(*(rows[(n, s == 0, s == last)]
                                                          for s, n in enumerate(self.layers_per_stage)))
        # recomputation runs in B, or in I (the first to unpack what the region saved)
        self._flops = {
            "F": fwd,
            "B": [[2 * f + e for f, e in zip(fr, er)] for fr, er in zip(fwd, extra)],
            "W": wgt,
            "I": [[2 * f - w + e for f, w, e in zip(fr, wr, er)] for fr, wr, er in zip(fwd, wgt, extra)],
        }
        self._activation = act
        self._residual = res
        self._rebuilt = trans
        self._kv_gradient = kvg
        self._params = [self.stage_params(s) for s in range(self.num_stages)]
        cast_params = [self.layers_per_stage[s] * layer_matrix_params(spec)
                       + (spec.vocab_size * spec.n_embd if s == last else 0) for s in range(self.num_stages)]
        self._traffic = self._weight_traffic()
        self.working_set = dataclasses.replace(self.working_set, rebuilt=trans, input_workspaces=iws,
                                               params=self._params, cast_params=cast_params)

    def _layer_rows(self) -> list:
        """One layer's :func:`layer_cost` per segment (a rank's tokens under sequence parallelism)."""
        spec, b, dt = self.spec, self.microbatch_size, self.dtype_bytes
        split = self.num_segments > 1
        ones = [layer_cost(spec, x, P, b, dt, segmented=split) for x, P in zip(self.segment_lengths, self.prefixes)]
        if self.sequence_parallel:
            ones = [sequence_parallel_layer(spec, one, x, b, self.tensor_parallel)
                    for one, x in zip(ones, self.segment_lengths)]
        return ones

    def _stage_rows(self, n: int, first: bool, last: bool, ones: list) -> tuple:
        """A stage of ``n`` layers' rows per segment: forward FLOPs, I's workspace, the rebuilt layer,
        Seq1F1B's K/V gradient, recomputed FLOPs, W's FLOPs, saved and residual bytes."""
        spec, b, dt = self.spec, self.microbatch_size, self.dtype_bytes
        kv_width, split = spec.kv_heads * spec.head_dim, self.num_segments > 1
        f_row, w_row, a_row, r_row, e_row, t_row, g_row, i_row = [], [], [], [], [], [], [], []
        for one, x, P in zip(ones, self.segment_lengths, self.prefixes):
            f = n * one.forward
            w = n * one.weight
            e = n * one.recompute  # FLOPs the backward spends recomputing (model.recompute)
            a = n * one.saved + stage_shared_saved(spec, x)
            t = one.rebuilt  # what the backward rebuilds at a time: one layer's (one region's) tensors
            r = n * one.residual
            # the gradient of this segment's K and V that later segments' backwards
            # accumulate until this segment's own backward runs (Seq1F1B)
            g_row.append(float(n * x * b * kv_width * (own_key_bytes(spec, dt) + dt)) if split else 0.0)
            a += first_stage_saved(spec, x, b) if first else arrived_input_saved(spec, x, b, dt)
            if last:
                hf = head_forward_flops(spec, x)
                f += hf
                w += hf
                a += last_stage_saved(spec, x, b, dt)
                r += head_residual(spec, x, b, dt)
            # I's working set, and a block's saved bytes
            i_row.append((*self.working_set.stage_input_workspace(n, one, x, last), one.saved))
            if first:
                # the first stage's input (token ids) needs no gradient: the runtime's I
                # there is empty and W is the whole backward (pipeflow.runtime.backward),
                # so everything the forwards kept stays until W
                r = a
            f_row.append(f * b)
            e_row.append(e * b)
            w_row.append(w * b)
            a_row.append(float(a))
            r_row.append(float(r))
            t_row.append(float(t))
        return (f_row, i_row, t_row, g_row, e_row, w_row, a_row, r_row)

    def _weight_traffic(self) -> dict:
        """Bytes each action kind moves for its stage's weights and fp32 gradients."""
        spec, dt = self.spec, self.dtype_bytes
        embedding = [embedding_params(spec) if s == 0 else 0 for s in range(self.num_stages)]
        matrices = [p - e for p, e in zip(self._params, embedding)]
        again = {"full": 1.0, "selective": 0.0}.get(spec.recompute, 0.0)
        return {
            "F": [m * dt for m in matrices],
            "I": [m * dt * (1 + again) for m in matrices],
            "W": [2 * gradient_bytes(p) for p in self._params],
            "B": [m * dt * (2 + again) + 2 * gradient_bytes(p) for m, p in zip(matrices, self._params)],
        }

    # ---------------------------------------------------------------- queries

    def stage_kinds(self) -> list[int]:
        """Per stage, the first stage of its kind (layers, first, last)."""
        first: dict[tuple, int] = {}
        return [first.setdefault((n, s == 0, s == self.num_stages - 1), s) for s, n in enumerate(self.layers_per_stage)]

    def stage_params(self, stage: int) -> int:
        """The parameters stage ``stage`` holds (:func:`~pipeflow.planning.transformer.stage_params`)."""
        return stage_params(self.spec, self.layers_per_stage[stage], stage == 0, stage == self.num_stages - 1)

    def flops(self, kind: str, stage: int, segment: int) -> float:
        """FLOPs of one action for the whole microbatch (F, B, I or W)."""
        if kind not in self._flops:
            raise self._bad_kind(kind)
        return self._flops[kind][stage][self._seg(segment)]

    def compute_time(self, kind: str, stage: int, segment: int, device: Device) -> float:
        if device.profile:
            if kind not in self._flops and kind != "S":
                raise self._bad_kind(kind)
            t = self.operator_time(kind, stage, segment, device.profile)
            if self.tensor_parallel > 1 and kind != "S":
                t += self.tensor_time(kind, stage, segment, device)
            return t
        if kind == "S":
            return step_time(self._params[stage], self.dtype_bytes, device.memory_bandwidth)
        # the device's peak for this precision (fp32: its fp32 or TF32 rate), or the time
        # to move the action's weight traffic, whichever is longer (a roofline)
        compute = self.flops(kind, stage, segment) / (device.flops(self.dtype_bytes) * self.efficiency)
        if device.memory_bandwidth > 0:
            compute = max(compute, self._traffic[kind][stage] / device.memory_bandwidth)
        if self.tensor_parallel > 1:  # and it waits for its tensor group's collectives
            compute += self.tensor_time(kind, stage, segment, device)
        return compute

    def compute_table(self, kind: str, stages: Sequence[int], device: Device) -> np.ndarray:
        """:meth:`compute_time` of ``kind`` (F, B, I or W) as an array [stage, segment] over ``stages``."""
        g = self.num_segments
        if kind not in self._flops:
            raise self._bad_kind(kind)
        if type(self).compute_time is not AnalyticCost.compute_time or device.profile:
            return np.array([[self.compute_time(kind, s, x, device) for x in range(g)] for s in stages], dtype=float)
        out = np.array([self._flops[kind][s] for s in stages], dtype=float).reshape(len(stages), g) \
            / (device.flops(self.dtype_bytes) * self.efficiency)
        if device.memory_bandwidth > 0:
            out = np.maximum(out, np.array([self._traffic[kind][s] for s in stages], dtype=float)[:, None]
                             / device.memory_bandwidth)
        if self.tensor_parallel > 1:  # (a segment's collectives depend on its length alone: once per length)
            lengths: dict[int, int] = {}
            for x, n in enumerate(self.segment_lengths):
                lengths.setdefault(n, x)
            rows = []
            for s in stages:
                at = {n: self.tensor_time(kind, s, x, device) for n, x in lengths.items()}
                rows.append([at[n] for n in self.segment_lengths])
            out += np.array(rows, dtype=float)
        return out

    def weight_traffic_bytes(self, kind: str, stage: int) -> float:
        """Bytes one action of ``kind`` moves for its stage's weights and gradients, whatever its tokens."""
        if kind not in self._traffic:
            raise self._bad_kind(kind)
        return self._traffic[kind][stage]

    def message_bytes(self, src_stage: int, dst_stage: int, segment: int) -> float:
        x = self.segment_lengths[self._seg(segment)]
        if self.sequence_parallel:  # each tensor rank sends its x/T tokens to its match on the next device
            x //= self.tensor_parallel
        return float(self.microbatch_size * x * self.spec.n_embd * self.dtype_bytes)

    def activation_bytes(self, stage: int, segment: int) -> float:
        return self._activation[stage][self._seg(segment)]

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        return self._residual[stage][self._seg(segment)]

    def rebuilt_layer_bytes(self, stage: int, segment: int) -> float:
        """Bytes of the layer (or attention sub-layer) a recomputing backward rebuilds at a time."""
        return self._rebuilt[stage][self._seg(segment)]

    def kv_gradient_bytes(self, stage: int, segment: int) -> float:
        return self._kv_gradient[stage][self._seg(segment)]

    def param_bytes(self, stage: int) -> float:
        return float(self._params[stage] * self.dtype_bytes)

    def model_state_bytes(self, stage: int) -> float:
        """:meth:`state_bytes` summed."""
        return float(sum(self.state_bytes(stage).values()))

    def state_bytes(self, stage: int) -> dict:
        """A stage's model state by category, the shared 16-bit casts included."""
        state = parameter_state(float(self._params[stage]))
        # transformers' BertEmbeddings keeps two int64 index rows as buffers (position and
        # token-type ids, a table's length each), held by the first stage with its weights
        state["parameters"] += 2.0 * 8 * self.spec.positions if stage == 0 and self.spec.post_norm else 0.0
        return {**state, "casts": self.held_cast_bytes(stage)}

    def tied_gradient_bytes(self, stage: int) -> float:
        """Bytes of a tied embedding's fp32 gradient an asynchronous end stage holds until applied."""
        ends = (0, self.num_stages - 1) if self.num_stages > 1 else ()
        return gradient_bytes(shared_head_params(self.spec)) if stage in ends else 0.0

    def _seg(self, segment: int) -> int:
        return checked_segment(segment, self.segment_lengths)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "model": self.spec.name,
            "num_stages": self.num_stages,
            "layers_per_stage": list(self.layers_per_stage),
            "segment_lengths": list(self.segment_lengths),
            "microbatch_size": self.microbatch_size,
            "efficiency": self.efficiency,
            "dtype_bytes": self.dtype_bytes,
            "stage_params": list(self._params),
            "stage_forward_flops": [sum(row) for row in self._flops["F"]],
            **({"tensor_parallel": self.tensor_parallel, "sequence_parallel": self.sequence_parallel}
               if self.tensor_parallel > 1 else {}),
        }
