"""Tensor parallelism in the analytic cost: one rank of a device's tensor group of T, split as
:mod:`pipeflow.models.tensor_parallel` splits a stage, with sequence parallelism and the
collectives it waits for (docs/simulation.md, "Tensor parallelism")."""

from __future__ import annotations

import dataclasses

from .layer_cost import LayerCost
from .saved_tensors import last_stage_saved, norm_saved_bytes
from .transformer import RESIDUAL_BYTES, TransformerSpec
from .loss_memory import loss_forward_bytes

AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"


def vocabulary_split(spec: TransformerSpec, tensor: int) -> bool:
    """Whether the embedding and the head are vocabulary-parallel (T divides V) or replicated."""
    return tensor > 1 and spec.vocab_size % tensor == 0


def shard_spec(spec: TransformerSpec, tensor: int) -> TransformerSpec:
    """The shape one rank of a tensor group of ``tensor`` holds: h/T query heads, kv/T key/value
    heads (one where T is a multiple of kv), I/T of the MLP's width, V/T of the vocabulary
    where T divides it; the hidden size whole."""
    T = tensor
    if T == 1:
        return spec
    kv = spec.kv_heads
    return dataclasses.replace(
        spec,
        n_head=spec.n_head // T,
        n_kv_head=kv // T if kv % T == 0 else 1,
        head_dim_override=spec.head_dim,
        n_inner=spec.ffn_width // T,
        vocab_size=spec.vocab_size // T if vocabulary_split(spec, T) else spec.vocab_size,
        vocab_parallel=vocabulary_split(spec, T),
    )


def sequence_parallel_layer(spec: TransformerSpec, one: LayerCost, tokens: int, microbatch_size: int,
                            tensor: int) -> LayerCost:
    """One layer's :class:`LayerCost` (of the rank's :func:`shard_spec`) with sequence
    parallelism: what its norms and dropout masks keep, and the stream input a
    recomputed block or region keeps, on x/T tokens."""
    H, T = spec.n_embd, tensor
    norm, mask = norm_saved_bytes(spec), (H if spec.dropout_masks else 0)
    if spec.recompute == "full":
        saved, rebuilt = H * RESIDUAL_BYTES, 2 * norm + 2 * mask
    elif spec.recompute == "selective":
        # the region keeps its input (the stream); outside it the MLP's norm and mask (and a
        # pre-norm block's attention norm, which sits before the region)
        saved, rebuilt = H * RESIDUAL_BYTES + (1 if spec.post_norm else 2) * norm + mask, 0
    else:
        saved, rebuilt = 2 * norm + 2 * mask, 0
    per_token = microbatch_size * tokens * (T - 1) / T
    return dataclasses.replace(one, saved=one.saved - per_token * saved, rebuilt=one.rebuilt - per_token * rebuilt)


def layer_collectives(kind: str, tokens: int, microbatch_size: int, spec: TransformerSpec, dtype_bytes: int,
                      sequence_parallel: bool) -> list[tuple[str, float]]:
    """(collective, bytes of the whole tensor) one layer's action of ``kind`` runs over its
    tensor group, model.recompute's rerun included; none for W (weight gradients need none)."""
    elems = float(microbatch_size * tokens * spec.n_embd)
    c, r = elems * dtype_bytes, elems * RESIDUAL_BYTES
    # forward: each sub-layer's exit sums the row-parallel product (compute dtype); with
    # sequence parallelism its entry gathers the stream's tokens (fp32)
    exit_, entry = [(RS, c)] if sequence_parallel else [(AR, c)], [(AG, r)] if sequence_parallel else []
    if kind == "F":
        return 2 * (entry + exit_)
    if kind not in ("B", "I"):
        return []
    # backward: the entry's gradient summed (fp32), and with sequence parallelism the
    # exit's gradient gathered (compute dtype)
    back = ([(RS, r), (AG, c)] if sequence_parallel else [(AR, r)]) * 2
    if spec.recompute == "full":
        back += 2 * (entry + exit_)
    elif spec.recompute == "selective":  # the attention sub-layer's rerun
        back += entry + exit_
    return back


def stage_collectives(kind: str, tokens: int, microbatch_size: int, spec: TransformerSpec, dtype_bytes: int,
                      sequence_parallel: bool, tensor: int, first: bool, last: bool) -> list[tuple[str, float]]:
    """(collective, bytes) a first or last stage runs over its group beyond its layers': a
    vocabulary-parallel embedding's sum of its lookups (fp32; sequence parallel: cut to the
    rank's tokens), the head's gather of its input's tokens, and a vocabulary-parallel head's
    input-gradient sum and the loss's three small fp32 all-reduces."""
    elems = float(microbatch_size * tokens * spec.n_embd)
    r = elems * RESIDUAL_BYTES
    split = vocabulary_split(spec, tensor)
    out: list[tuple[str, float]] = []
    if first:
        if kind == "F" and split:
            out.append((AR, r))
        if kind in ("B", "I") and sequence_parallel:
            out.append((AG, r))
    if last:
        if kind == "F":
            if sequence_parallel:
                out.append((AG, r))
            if split:
                out += [(AR, float(microbatch_size * tokens * 4))] * 3
        if kind in ("B", "I") and split:
            out.append((RS if sequence_parallel else AR, r))
    return out


def collectives_time(links, collectives: list, device) -> float:
    """Seconds ``device``'s tensor group spends in ``collectives`` ((op, bytes) pairs) on
    ``links`` (a :class:`~pipeflow.topology.tensor.TensorTopology`), alike ones priced once
    and counted."""
    counts: dict[tuple[str, float], int] = {}
    for one in collectives:
        counts[one] = counts.get(one, 0) + 1
    return sum(k * links.collective_time(op, device, n) for (op, n), k in counts.items())


class TensorShards:
    """:class:`~pipeflow.planning.cost.AnalyticCost`'s tensor-parallel mixin: with sequence
    parallelism a stage's output, its 16-bit copy and the stream's gradient are on the rank's
    x/T tokens; and the collectives' time an action waits for."""

    tensor_parallel: int = 1
    sequence_parallel: bool = False
    tensor_links = None  # the run's TensorTopology (place_tensor_groups)

    def place_tensor_groups(self, topology) -> None:
        """Price the tensor groups' collectives on ``topology`` (a
        :class:`~pipeflow.topology.tensor.TensorTopology` of this cost's T)."""
        if self.tensor_parallel > 1 and getattr(topology, "tensor_parallel", 1) != self.tensor_parallel:
            raise ValueError(f"pipeline.tensor_parallel={self.tensor_parallel}: topology '{topology.name}' is not "
                             f"grouped in tensor groups of {self.tensor_parallel} (pipeflow.topology.tensor)")
        self.tensor_links = topology
        self._tensor_times = {}
        self._tensor_shape = None  # this cost model's number among the shapes the topology has priced

    def layer_collective_time(self, kind: str, segment: int, device) -> float:
        """Seconds one layer's action of ``kind`` waits for its group's collectives."""
        x = self.segment_lengths[self._seg(segment)]
        return self._collective_time(layer_collectives(kind, x, self.microbatch_size, self.spec, self.dtype_bytes,
                                                       self.sequence_parallel), device)

    def tensor_time(self, kind: str, stage: int, segment: int, device) -> float:
        """Seconds an action of ``kind`` on ``stage`` waits for its group's collectives
        (0 at T = 1): its layers' and the embedding's or the head's."""
        if self.tensor_parallel == 1:
            return 0.0
        key = (kind, stage, segment, device)
        got = self._tensor_times.get(key) if self.tensor_links is not None else None
        if got is None:
            x = self.segment_lengths[self._seg(segment)]
            first, last = stage == 0, stage == self.num_stages - 1
            # what the time depends on: the same for every cost model of this shape on the
            # topology (a search builds thousands), so the topology keeps it
            memo = getattr(self.tensor_links, "cost_memo", None)
            if memo is not None and self._tensor_shape is None:  # (the spec hashed once per cost model)
                self._tensor_shape = memo.setdefault(("shape", self.spec, self.microbatch_size, self.dtype_bytes,
                                                      self.sequence_parallel), len(memo))
            shape = (kind, x, self._tensor_shape, first, last, self.layers_per_stage[stage], device)
            got = memo.get(shape) if memo is not None else None
            if got is None:
                # (the whole model's vocabulary decides whether T splits it, not the shard's)
                extra = stage_collectives(kind, x, self.microbatch_size, self.full_spec, self.dtype_bytes,
                                          self.sequence_parallel, self.tensor_parallel, first, last)
                got = (self.layers_per_stage[stage] * self.layer_collective_time(kind, segment, device)
                       + self._collective_time(extra, device))
                if memo is not None:
                    memo[shape] = got
            if self.tensor_links is not None:
                self._tensor_times[key] = got
        return got

    def _collective_time(self, collectives: list, device) -> float:
        if not collectives:
            return 0.0
        if self.tensor_links is None:
            raise ValueError(f"pipeline.tensor_parallel={self.tensor_parallel}: the cost model prices the tensor "
                             f"groups' collectives on the run's topology; call place_tensor_groups(topology) first")
        return collectives_time(self.tensor_links, collectives, device)

    def forward_workspace_bytes(self, stage: int, segment: int) -> float:
        """A forward's most beyond what it keeps, in bytes: the larger of a tensor group's MLP
        (:meth:`_tensor_forward_workspace`) and a last stage's loss
        (:func:`~pipeflow.planning.loss_memory.loss_forward_bytes`)."""
        return self._forward_most(stage, segment)[0]

    def forward_late_saved_bytes(self, stage: int, segment: int) -> float:
        """Of what a forward keeps, what it saves after its most
        (:meth:`forward_workspace_bytes`): a tensor group's head and loss, over the whole
        tokens (the head gathers them); at the loss's most its targets."""
        return self._forward_most(stage, segment)[1]

    def _forward_most(self, stage: int, segment: int) -> tuple[float, float]:
        """(workspace, saved after it) of :meth:`forward_workspace_bytes`'s instant."""
        x, b = self.segment_lengths[self._seg(segment)], self.microbatch_size
        tensor = self._tensor_forward_workspace(stage, segment)
        late = (float(last_stage_saved(self.spec, x, b, self.dtype_bytes))
                if tensor and stage == self.num_stages - 1 else 0.0)
        if stage != self.num_stages - 1 or self.spec.vocab_parallel:
            return tensor, late
        loss = loss_forward_bytes(x * b, self.spec.scored_vocab)  # (a padded head's chunk: the scored columns)
        targets = 8.0 * x * b
        return (tensor, late) if tensor - late >= loss - targets else (loss, targets)

    def _tensor_forward_workspace(self, stage: int, segment: int) -> float:
        """A tensor-parallel forward's most beyond what it keeps, in bytes: at its last block's MLP
        output projection, the partial product and the all-reduce's copy beside the MLP's input
        norm (and, sequence parallel, that input gathered). 0 without tensor parallelism, after a
        post-norm block (BERT) or with full recomputation."""
        spec = self.spec
        if (self.tensor_parallel == 1 or spec.post_norm or spec.recompute == "full"
                or not self.layers_per_stage[stage]):
            return 0.0
        x, b, H, c = self.segment_lengths[self._seg(segment)], self.microbatch_size, spec.n_embd, self.dtype_bytes
        own = x / self.tensor_parallel if self.sequence_parallel else x  # the rank's tokens of the stream
        held = (2 if spec.qkv_inputs == 1 else 1) * own * b * H * RESIDUAL_BYTES
        gathered = x * b * H * RESIDUAL_BYTES if self.sequence_parallel else 0.0
        summed = 2 * x * b * H * c + (own * b * H * c if self.sequence_parallel else 0.0)
        return float(held + gathered + summed)


    def _per_rank(self, value: float) -> float:
        return value / self.tensor_parallel if self.sequence_parallel else value

    def output_bytes(self, stage: int, segment: int) -> float:
        return self._per_rank(super().output_bytes(stage, segment))

    def sent_copy_bytes(self, stage: int, segment: int) -> float:
        return self._per_rank(super().sent_copy_bytes(stage, segment))

    def local_output_bytes(self, stage: int, segment: int) -> float:
        return self._per_rank(super().local_output_bytes(stage, segment))

    def shared_output_bytes(self, stage: int, segment: int) -> float:
        return self._per_rank(super().shared_output_bytes(stage, segment))

    def input_gradient_bytes(self, stage: int, segment: int) -> float:
        return self._per_rank(super().input_gradient_bytes(stage, segment))
