"""What a backward holds while it runs, on top of what the forwards kept: B's working
set and the zero-bubble I's. The simulator's memory walk
(:mod:`pipeflow.sim.device_memory`) holds each at the backward's peak instant; the
measurements they are checked against are ``benchmarks/bench_split_memory.py`` (one
stage) and ``benchmarks/bench_memory.py`` (every device of a run).

:class:`BackwardWorkingSet` prices them from its fields and nothing else: the shape a
cost model prices (one tensor rank's), that cost model's per-stage tables and this
host's kernels. :class:`~pipeflow.planning.cost.AnalyticCost` builds one with its tables
and asks it for these memory terms (:class:`WorkingSetTerms`); the branched cost model
walks a branch's blocks with one of a branch's shape alone
(:mod:`pipeflow.planning.branched_memory`)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .optimizer_step import decay_tensors, step_workspace
from .products import down_weight_scratch, mlp_product_scratch, rerun_rotation_bytes, weight_phase_bytes, weight_products
from .operators import chunk_rows, head_residual, last_stage_saved, norm_saved_bytes
from .transformer import (RESIDUAL_BYTES, TransformerSpec, head_params, layer_params, matrix_inputs, norm_params,
                          recomputed_matrix_params, shared_head_params)


def checked_segment(segment: int, segment_lengths: Sequence[int]) -> int:
    """``segment`` where it is one of the sequence segments of ``segment_lengths``; else ValueError."""
    if not 0 <= segment < len(segment_lengths):
        raise ValueError(
            f"segment {segment} out of range: the cost model has {len(segment_lengths)} sequence segment(s) "
            f"(cost.segment_lengths={list(segment_lengths)})"
        )
    return segment



def loss_forward_bytes(rows: int, vocab: int) -> float:
    """What the loss's forward (:class:`pipeflow.models.loss.ChunkedCrossEntropy`) holds at
    its most beside the logits and its log-sum-exps, over ``rows`` tokens of ``vocab``
    logits: one chunk's fp32 logits with six fp32 columns (each row's maximum, target
    logit and sum, and the loss's terms), each token's target taken (int64) and whether it
    counts (a byte), and the loss's sum."""
    return float(4 * min(rows, chunk_rows(vocab)) * (vocab + 6) + 9 * rows + 4)


def loss_backward_bytes(rows: int, vocab: int, dtype_bytes: int, parallel: bool = False,
                        scored: int | None = None) -> float:
    """What the loss's backward (:class:`pipeflow.models.loss.ChunkedCrossEntropy`) holds at
    its most, over ``rows`` tokens of ``vocab`` logits: the logits' gradient (in the
    compute dtype, made whole at its start), one chunk's fp32 softmax with its two fp32
    columns (the -1 at each target, each row's share of the gradient), and each token's
    target taken (int64) and whether it counts (a byte). A padded head (``scored`` of its
    ``vocab`` logits read, model.vocab_multiple): the gradient is as wide as the logits, the
    chunk as the ``scored`` columns. A rank's cut of the vocabulary (``parallel``, the
    parallel cross-entropy): two fp32 rows of its logits."""
    if parallel:
        return float(2 * rows * vocab * 4)
    scored = vocab if scored is None else scored
    return float(rows * vocab * dtype_bytes + 4 * min(rows, chunk_rows(scored)) * (scored + 2) + 9 * rows)

@dataclass(frozen=True, eq=False)
class BackwardWorkingSet:
    """B's and I's working sets of a transformer stage (see the module's docstring), what
    a backward hands back and holds to its end, and what the optimizer step holds.

    Frozen: a cost model whose host's kernels are set after it was built takes a new one
    (``dataclasses.replace``). A block's walk alone (:meth:`stage_input_workspace`) needs
    only the first three fields."""

    spec: TransformerSpec  # one tensor rank's shard of the model
    microbatch_size: int
    dtype_bytes: int  # per element of the compute dtype (4: fp32)
    segment_lengths: tuple[int, ...] = ()  # a microbatch's sequence segments' tokens (Seq1F1B: several)
    layers_per_stage: tuple[int, ...] = ()
    # the cost model's tables, per stage (AnalyticCost._build_tables)
    rebuilt: Sequence = ()  # [stage][segment]: the layer a recomputing backward rebuilds (LayerCost.rebuilt)
    input_workspaces: Sequence = ()  # [stage][segment]: _input_workspace's three and one block's saved bytes
    params: Sequence = ()  # [stage]: the stage's parameters
    cast_params: Sequence = ()  # [stage]: the parameters its 16-bit casts copy (matrix products, the head)
    # this host's kernels where the stages run on CPUs (set by pipeflow.config.prepare)
    product_scratch: Callable | None = None  # pipeflow.topology.kernel_scratch.product_scratch: a 16-bit product's scratch
    attention_scratch: Callable | None = None  # pipeflow.topology.kernel_scratch.attention_scratch: the fused kernel's
    step_impl: str = "fused"  # torch's AdamW as the ranks run it: fused | foreach | single (runtime.optimizer.step_impl)
    own_casts: bool = False  # each microbatch casts the weights for itself (an asynchronous schedule's)
    # the phases computed, by their arguments: several terms of the memory walk read each
    _phases: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    def _seg(self, segment: int) -> int:
        return checked_segment(segment, self.segment_lengths)

    def workspace_bytes(self, stage: int, segment: int) -> float:
        """What a backward (B) holds at its most on top of the level before its frees (see
        :meth:`_backward_phase`)."""
        return self._backward_phase(stage, segment)[0]

    def held_cast_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`workspace_bytes` near a backward's end through shared casts (the
        simulator's ``held_cast_gradients``), where the down projection's 16-bit weight
        gradient is among the casts' gradients it holds, not on top of them."""
        return self._backward_phase(stage, segment, end=True)[0]

    def backward_freed_bytes(self, stage: int, segment: int) -> float:
        """Of what the forwards saved, what B has freed by the instant of
        :meth:`workspace_bytes`: the simulator takes it from the activations for that
        instant and counts the workspace's gradients and rebuilt layer whole as
        temporaries."""
        return self._backward_phase(stage, segment)[1]

    def fresh_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`workspace_bytes` of a backward into a stage that holds no parameter
        gradients yet (the first after an optimizer step; every one where each microbatch
        updates, PipeDream's): its peak is where what it holds and the gradients it has
        made by then are the most (:meth:`backward_grads_made_bytes`)."""
        return self._backward_phase(stage, segment, fresh=True)[0]

    def fresh_backward_freed_bytes(self, stage: int, segment: int) -> float:
        """:meth:`backward_freed_bytes` at the instant of :meth:`fresh_workspace_bytes`."""
        return self._backward_phase(stage, segment, fresh=True)[1]

    def backward_grads_made_bytes(self, stage: int, segment: int) -> float:
        """The parameter gradients (fp32) such a backward has made by the instant of
        :meth:`fresh_workspace_bytes`: the head's on a last stage (its backward runs
        first), and at a block's attention phase its MLP's (and that sub-layer's norm's)."""
        return self._backward_phase(stage, segment, fresh=True)[2]

    def _backward_phase(self, stage: int, segment: int, fresh: bool | None = False,
                        end: bool = False) -> tuple[float, float, float]:
        """:meth:`_backward_phase_of`, once per (stage, segment, fresh, end)."""
        key = (stage, segment, fresh, end)
        got = self._phases.get(key)
        if got is None:
            got = self._phases[key] = self._backward_phase_of(stage, segment, fresh, end)
        return got

    def _backward_phase_of(self, stage: int, segment: int, fresh: bool | None = False,
                           end: bool = False) -> tuple[float, float, float]:
        """B's most on top of the level before it, what it has freed of the saved
        activations by then, and (``fresh``: into a stage with no gradients) the
        gradients it has made by then. A block's backward runs its MLP's first, then its
        attention's (:meth:`_block_phases`; measured: with selective recomputation a
        whole sequence's peak is the MLP's, a later segment's the attention's). On the
        last stage the head's backward runs first (:meth:`_head_phases`)."""
        seg = self._seg(segment)
        x, spec, c = self.segment_lengths[seg], self.spec, self.dtype_bytes
        stream = x * self.microbatch_size * spec.n_embd * RESIDUAL_BYTES  # the stream's gradient
        last = stage == self.num_stages - 1
        phases = self._block_phases(stage, seg, fresh, end, stream)
        if self.own_casts and c < 4 and spec.recompute != "full":
            # an asynchronous schedule's microbatch casts the weights for itself (the
            # simulator holds them to its backward's end): each cast goes with its
            # weight's backward, so past the MLP's phase its casts have gone (measured,
            # bert PipeDream bf16 selective: 0.25 MiB)
            casts = spec.mlp_matrices * spec.n_embd * spec.ffn_width * c
            phases = phases[:1] + [(net - casts, freed, made) for net, freed, made in phases[1:]]
        if last:
            phases = self._head_phases(stage, x, phases, fresh, stream)
        if fresh is None:  # the attention's phase itself (cast_phase_bytes)
            return phases[1]
        net, freed, made = max(phases, key=lambda p: p[0] + p[2])
        return float(net), float(freed), float(made)

    def _received_bytes(self, tokens: int, last: bool) -> float:
        """What the gradient that arrived adds to a backward's working set (the executor
        holds it to the backward's end): at 16 bits restored to fp32, the message let go;
        at full precision nothing (the message itself, held as an input already); on the
        last stage none arrives (the head's backward makes the stream's gradient)."""
        c = self.dtype_bytes
        return 0.0 if last or c >= 4 else tokens * self.spec.n_embd * (RESIDUAL_BYTES - c)

    def _block_phases(self, stage: int, seg: int, fresh: bool | None, end: bool,
                      stream: float) -> list[tuple[float, float, float]]:
        """A block's backward's phases, (on top of the level, freed, made) each: its MLP's
        (:meth:`_mlp_phase`), then its attention's: the gradients of its output and
        queries (x tokens) and of the keys and values of the whole prefix (P tokens: a
        later Seq1F1B segment reaches back to the earlier ones'), beside the attention
        sub-layer it rebuilt (selective, full), the MLP sub-layer behind it, all it saved
        freed, its weights' gradients made."""
        spec, b, c = self.spec, self.microbatch_size, self.dtype_bytes
        x, P = self.segment_lengths[seg], sum(self.segment_lengths[: seg + 1])
        received = self._received_bytes(x * b, stage == self.num_stages - 1)
        kv_heads = spec.n_head if spec.kv_repeat else spec.kv_heads  # the kernel's K/V gradients
        attention = (b * c * (2 * x * spec.n_head + 2 * P * kv_heads) * spec.head_dim + stream + received
                     + self._attention_scratch(x, P))
        rebuilt = self.rebuilt[stage][seg]
        behind = self._mlp_saved(x * b)
        n = self.layers_per_stage[stage]
        # with full recomputation a later block's peak: the blocks passed have made their gradients
        passed = 4.0 * (n - 1) * layer_params(spec) if fresh and spec.recompute == "full" and n > 1 else 0.0
        made = (4.0 * self._mlp_params() if fresh else 0.0) + passed
        mlp, mlp_freed, mlp_made = self._mlp_phase(stage, x, fresh, end, stream, received)
        mlp_made += passed
        if spec.recompute == "full":  # the MLP's part of the rebuilt layer is gone by the attention's
            return [(rebuilt + mlp, 0.0, mlp_made), (rebuilt - behind + attention, 0.0, made)]
        if spec.recompute == "none":
            return [(mlp, mlp_freed, mlp_made), (attention - behind, behind, made)]
        # by the attention's backward the rebuilt region's own end has run its backward: a
        # post-norm block's first norm, its rebuilt input gone, and at 16 bits the output
        # projection, its cast (the rerun's own) gone with it (measured, bert GPipe bf16:
        # 0.285 MiB of the rebuilt region gone there)
        norm = x * b * norm_saved_bytes(spec) if spec.post_norm else 0.0
        gone = norm + (spec.n_embd * spec.n_head * spec.head_dim * c if c < 4 and spec.post_norm else 0.0)
        phases = [(mlp, mlp_freed, mlp_made), (rebuilt + attention - behind - gone, behind, made)]
        if spec.post_norm:
            # the rerun itself, first unpacked by the first norm's backward, ends past the
            # region's last save: its first norm's output (fp32) and the output projection's
            # beside the rebuilt region, the MLP sub-layer behind (measured, bert GPipe
            # bf16's first stage: 0B0's peak at the rerun's end)
            rerun = x * b * spec.n_embd * (RESIDUAL_BYTES + c)
            phases.append((rebuilt + rerun + stream + received - behind, behind, made))
        return phases

    def _mlp_phase(self, stage: int, x: int, fresh: bool | None, end: bool, stream: float,
                   received: float) -> tuple[float, float, float]:
        """A block's backward at its MLP's, the first it runs: on top of the level, what it
        has freed of the saved activations and (``fresh``) the gradients it has made. The
        MLP's hidden gradient (I wide, compute dtype; a gated MLP's two) beside the
        stream's (H, fp32) and the gradient that arrived, the down projection's weight
        gradient, the product's scratch; with full recomputation the rebuilt layer
        beside it (:meth:`_block_phases`)."""
        spec, b, c = self.spec, self.microbatch_size, self.dtype_bytes
        # Into the first block it passes the gradient that arrived is the stream's
        # gradient; the attention's phase is past the MLP sub-layer's add, a stream's
        # gradient of its own beside it, as into every later block (where a stage's
        # blocks peak alike, each rebuilt in turn by full recomputation, the later ones
        # do; otherwise the first, before any block has freed what it saved). On the last
        # stage the head's backward makes the stream's gradient.
        own = (stage == self.num_stages - 1 or spec.post_norm
               or (spec.recompute == "full" and self.layers_per_stage[stage] > 1))
        # a gated MLP's product backward makes two I-wide gradients (the gate activation's
        # and the up projection's) while the down projection's input gradient is live
        mlp = x * b * (2 if spec.mlp == "gated" else 1) * spec.ffn_width * c + (stream if own else 0.0) + received
        # the down projection's weight gradient: at fp32 made into .grad (a backward into a
        # stage with none yet) or beside it until added; at 16 bits the gradient of its
        # shared cast, which waits for the cast's backward, beside the 16-bit copy of its
        # output gradient the products took (measured, gpt 1F1B bf16's first stage)
        down = spec.n_embd * spec.ffn_width
        made = 0.0
        if c < 4 and spec.recompute == "full" and spec.mlp == "gated":
            # the rebuilt block casts its weights anew (models.recompute), so the down
            # projection's 16-bit weight gradient and its output gradient's 16-bit copy
            # go with its backward: most there (beside the hidden gradient and its
            # product's scratch, or the weight gradient's product's) or in the gate and
            # up product's after, its two I-wide gradients made where the hidden product
            # and the down projection's cast have gone (measured, llama 1F1B bf16)
            hidden = x * b * spec.ffn_width * c
            scratch = self.product_scratch
            at_down = down * c + x * b * spec.n_embd * c + max(
                down_weight_scratch(spec, x * b, scratch),
                hidden + (scratch(x * b, spec.n_embd, spec.ffn_width, False) if scratch else 0))
            mlp += max(at_down, 2 * hidden - down * c) - 2 * hidden
        elif c < 4:
            mlp += (0 if end else down * c) + x * b * spec.n_embd * c
        elif fresh:
            made = 4.0 * (down + (spec.n_embd if spec.mlp_bias else 0))
        elif spec.mlp != "gated":  # (a gated MLP's is added to .grad before the product's backward)
            mlp += 4.0 * down
        # a gated MLP's product's backward runs after the down projection's, which has
        # freed its input, the product (measured, Llama 1,024 wide at 2k tokens, fp32 and
        # bf16: three I-wide gradients live, that one freed)
        gated_freed = x * b * spec.ffn_width * c if spec.mlp == "gated" and spec.recompute != "full" else 0.0
        # a post-norm block's backward starts with its norm's, which frees the input it
        # saved (rebuilt, with full recomputation) and makes a stream's gradient of its
        # own before the MLP's (measured, bert)
        norm = x * b * norm_saved_bytes(spec) if spec.post_norm else 0.0
        freed = (norm if spec.recompute != "full" else 0.0) + gated_freed
        return mlp - norm + self._mlp_product_scratch(x * b), freed, made

    def _head_phases(self, stage: int, x: int, phases: list, fresh: bool | None,
                     stream: float) -> list[tuple[float, float, float]]:
        """A last stage's backward's phases: the head's runs first, holding the loss's
        (:func:`loss_backward_bytes`), and has freed what the head kept, and made its
        gradients, before the blocks' ``phases``; after it the final norm's
        (:meth:`_final_norm`)."""
        spec, b = self.spec, self.microbatch_size
        head = last_stage_saved(spec, x, b, self.dtype_bytes)
        head_made = 4.0 * (head_params(spec) - (shared_head_params(spec) if stage == 0 else 0)) if fresh else 0.0
        phases = [(n - head, f + head, m + head_made) for n, f, m in phases]
        phases.append((loss_backward_bytes(x * b, spec.vocab_size, self.dtype_bytes, spec.vocab_parallel,
                                          spec.scored_vocab), 0.0, 0.0))
        final, held = self._final_norm(x * b, stream - head)  # (after the head, its stream's gradient made)
        if final:
            phases.append((final, head - held, head_made))
        return phases

    def cast_phase_bytes(self, stage: int, segment: int) -> float:
        """A backward through shared casts an earlier forward made, at the attention of the
        first or the last block it passes (whichever holds more): on top of the level less
        :meth:`cast_phase_freed_bytes`, that attention's working set and the 16-bit
        gradients of every shared cast it has passed, which wait for the casts' backward at
        its end (the head's, the MLP matrices, the blocks' attention matrices behind it; a
        recomputed region casts anew and its gradients flow at once). Measured: Seq1F1B's
        later segments at bf16 with selective recomputation peak there, their MLP weights'
        16-bit gradients beside the rebuilt attention."""
        return self._cast_phase(stage, segment)[0]

    def cast_phase_freed_bytes(self, stage: int, segment: int) -> float:
        """What that backward has freed of the microbatch's saved bytes by then: the blocks'
        behind it and, in its block, the MLP's (see :meth:`_backward_phase`)."""
        return self._cast_phase(stage, segment)[1]

    def _cast_phase(self, stage: int, segment: int) -> tuple[float, float]:
        """:meth:`_cast_phase_of`, once per (stage, segment)."""
        key = ("cast", stage, segment)
        got = self._phases.get(key)
        if got is None:
            got = self._phases[key] = self._cast_phase_of(stage, segment)
        return got

    def _cast_phase_of(self, stage: int, segment: int) -> tuple[float, float]:
        """(:meth:`cast_phase_bytes`, :meth:`cast_phase_freed_bytes`): B's attention phase
        with the casts' gradients it holds there, at its first block or its last."""
        spec, c, n = self.spec, self.dtype_bytes, self.layers_per_stage[stage]
        if c >= 4 or n == 0:
            return 0.0, 0.0
        seg = self._seg(segment)
        net, freed, _ = self._backward_phase(stage, segment, fresh=None)
        block_saved = self.input_workspaces[stage][seg][3]  # one block's saved bytes
        q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
        attention = 0 if spec.recompute != "none" else spec.n_embd * (2 * q + 2 * kv) * c
        mlp = 0 if spec.recompute == "full" else spec.mlp_matrices * spec.n_embd * spec.ffn_width * c
        head = self.held_cast_bytes(stage) - n * (attention + mlp)  # the head's cast, on the last stage
        # at the attention of the j-th block the backward passes (j = 0: its first), the
        # MLP casts' gradients of j + 1 blocks and the attention casts' of j held, the j
        # blocks behind freed: linear in j, so the most is at its first block or its last
        best = max(((head + (j + 1) * mlp + j * attention, j * block_saved) for j in {0, n - 1}),
                   key=lambda hf: hf[0] - hf[1])
        # the phase's net is on top of the level less what it freed (as B's own point)
        return float(net + freed + best[0]), float(freed + best[1])

    def weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """What a zero-bubble W holds at its most on top of its level, before it lets go of
        what I kept for it (:func:`weight_phase_bytes`)."""
        return self._weight_phase(stage, segment, False)

    def fresh_weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`weight_workspace_bytes` of a W into a stage with no gradients yet."""
        return self._weight_phase(stage, segment, True)

    def _weight_phase(self, stage: int, segment: int, fresh: bool) -> float:
        tokens = self.microbatch_size * self.segment_lengths[self._seg(segment)]
        products = weight_products(self.spec, self.layers_per_stage[stage], stage == self.num_stages - 1, tokens)
        return weight_phase_bytes(products, self.dtype_bytes, self.product_scratch, fresh)

    def _attention_scratch(self, queries: int, keys: int) -> float:
        """What the fused attention's backward holds beyond the gradients of Q, K and V on
        this host (``attention_scratch``: :func:`pipeflow.topology.kernel_scratch.attention_scratch`,
        set where the stages run on CPUs; nothing where the scores are computed eagerly)."""
        scratch, spec = self.attention_scratch, self.spec
        if scratch is None or spec.attention != "sdpa" or spec.dropout_masks:
            return 0.0
        kv_heads = spec.n_head if spec.kv_repeat else spec.kv_heads
        return float(scratch(self.microbatch_size, spec.n_head, kv_heads, queries, keys, spec.head_dim, spec.causal))

    def _mlp_product_scratch(self, tokens: int) -> float:
        return mlp_product_scratch(self.spec, tokens, self.dtype_bytes, self.product_scratch)

    def _mlp_params(self) -> float:
        """A block's MLP sub-layer's parameters: its matrices, their biases, its norm's."""
        spec, H, I = self.spec, self.spec.n_embd, self.spec.ffn_width
        return spec.mlp_matrices * H * I + norm_params(spec) + ((spec.mlp_matrices - 1) * I + H if spec.mlp_bias else 0)

    def _mlp_saved(self, x_b: int) -> float:
        """What a block's MLP sub-layer saves for ``x_b`` tokens (its norm's and its dropout
        mask's too): its products' inputs, the activation's input (and a gated MLP's
        other operands)."""
        spec, c = self.spec, self.dtype_bytes
        _, mlp_in = matrix_inputs(spec, c)
        return x_b * ((mlp_in * spec.n_embd + (4 if spec.mlp == "gated" else 2) * spec.ffn_width) * c
                      + norm_saved_bytes(spec) + (spec.n_embd if spec.dropout_masks else 0))

    def input_workspace_bytes(self, stage: int, segment: int) -> float:
        """What the zero-bubble I holds at its most on top of the level before it (see
        :meth:`stage_input_workspace`); B's is :meth:`workspace_bytes`."""
        return self.input_workspaces[stage][self._seg(segment)][0]

    def input_kept_bytes(self, stage: int, segment: int) -> float:
        """What I has kept for W by the instant of :meth:`input_workspace_bytes` (the
        residuals; the products' inputs among them were saved activations until then)."""
        return self.input_workspaces[stage][self._seg(segment)][1]

    def input_freed_bytes(self, stage: int, segment: int) -> float:
        """What I has taken from the activations the forward saved by that instant (freed,
        or kept for W: then counted in :meth:`input_kept_bytes` too). The workspace less
        the level's move (kept less freed) are the gradients on the way."""
        return self.input_workspaces[stage][self._seg(segment)][2]

    def stage_input_workspace(self, n: int, one, x: int, last: bool,
                              phase: list | None = None) -> tuple[float, float, float]:
        """I's most on top of its level, for a stage of ``n`` blocks of ``x`` tokens.

        I walks down the stage as B does, but W still needs each matrix product's input
        and output gradient, so it frees only the rest of what a block saved and keeps
        the output gradients: after each block the level has moved by the block's
        residual less its saved bytes (``LayerCost.residual - LayerCost.saved``: ``one``; the
        products' inputs are in both), up or down, and the most it holds is at the first
        block or the last one; inside a block, at its MLP's activation or its attention
        (:meth:`_input_block_phases`). On the last stage the head runs first
        (:meth:`_input_head`). Returns (the most, what I has kept by then, what it has
        taken from the saved activations by then: :meth:`input_kept_bytes`,
        :meth:`input_freed_bytes`; ``phase``, a list, gets the block's phase: 0 the
        MLP's, 1 the attention's, 2 its rerun's rotation), split as the runtime's profile
        names them (runtime.memory=profile).
        Measured: ``benchmarks/bench_split_memory.py``."""
        phases = self._input_block_phases(one, x, last)
        block, kept, freed = max(phases, key=lambda p: p[0])
        if phase is not None:
            phase.append(phases.index((block, kept, freed)))
        rise = max(0.0, (n - 1) * (one.residual - one.saved))
        if rise:  # the most is at the last block: the others have traded their saved bytes for residuals
            kept += (n - 1) * one.residual
            freed += (n - 1) * one.saved
        if not last:
            return float(block + rise), float(kept), float(freed)
        return self._input_head(x, block, rise, kept, freed)

    def _input_head(self, x: int, block: float, rise: float, kept: float, freed: float) -> tuple[float, float, float]:
        """:meth:`stage_input_workspace` of a last stage, whose blocks' most is ``block`` + ``rise``
        (``kept``, ``freed`` by then): the head runs first, holding the loss's backward
        (:func:`loss_backward_bytes`), and moves the level by what it keeps for W (its input and the logits'
        gradient) less what it saved, and by the gradient it hands the blocks (the
        stream's, fp32: on a stage below it arrived as a message); then the final norm's
        backward (:meth:`_final_norm`), then the blocks'. The most of the three."""
        spec, b, c = self.spec, self.microbatch_size, self.dtype_bytes
        x_b = x * b
        head_kept, head_saved = head_residual(spec, x, b, c), last_stage_saved(spec, x, b, c)
        head_moves = head_kept - head_saved + x_b * spec.n_embd * RESIDUAL_BYTES
        # (the logits' gradient, kept for W)
        head = loss_backward_bytes(x_b, spec.vocab_size, c, spec.vocab_parallel, spec.scored_vocab)
        if head >= head_moves + rise + block and head >= self._final_norm(x_b, head_moves)[0]:
            return float(head), float(x_b * spec.vocab_size * c), 0.0
        final, held = self._final_norm(x_b, head_moves)
        if final > head_moves + rise + block:  # the blocks' saved bytes all held yet
            return float(final), float(head_kept), float(head_saved - held)
        return float(head_moves + rise + block), float(head_kept + kept), float(head_saved + freed)

    def _input_block_phases(self, one, x: int, last: bool) -> list[tuple[float, float, float]]:
        """I in one block (``one``: :class:`~pipeflow.planning.layer_cost.LayerCost`), (the
        most on top of the level, kept, taken from the saved activations) at each point it
        may peak: its MLP's activation (:meth:`_input_mlp`), its attention
        (:meth:`_input_attention`), with the MLP sub-layer behind, all it saved gone and
        its products' inputs and output gradients kept; and, with selective
        recomputation of a rotary attention, its rerun. With full recomputation the
        rebuilt layer is beside either; with selective, the rebuilt attention sub-layer
        beside the attention's (the MLP's backward, before it, moves the level by about
        nothing: its kept gradients replace what it saved). Split as the runtime's
        profile names them: at the MLP's activation the activation function's input is
        freed and the down projection's input taken (GeLU's output; a gated MLP's
        product later)."""
        spec, c = self.spec, self.dtype_bytes
        x_b = x * self.microbatch_size
        mlp, mlp_kept = self._input_mlp(x_b, last)
        attention = self._input_attention(x, last)
        t = one.rebuilt
        act_in = x_b * spec.ffn_width * c
        # at the attention the MLP sub-layer is behind: it has freed what it saved (its
        # norm's too), keeping its products' inputs and output gradients (about as much)
        qkv_in, mlp_in = matrix_inputs(spec, c)
        mlp_saved = self._mlp_saved(x_b)
        mlp_resid = x_b * c * (mlp_in * spec.n_embd + spec.mlp_matrices * spec.ffn_width + spec.n_embd)
        behind = mlp_resid - mlp_saved
        # By the end of the fused kernel's backward I has kept all W needs of the block
        # (what its products read, rebuilt or saved, and their output gradients) but, where
        # Q, K and V are one product (GPT-2's c_attn), that product's output gradient,
        # concatenated from the kernel's three only after (measured, gpt and bert ZB-H1
        # bf16): the rest of the attention's working set is temporary. Without
        # recomputation what the attention's products read were saved activations, taken.
        q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
        attn_kept = one.residual - ((q + 2 * kv) * x_b * c if spec.qkv_inputs == 1 else 0)
        taken = (qkv_in * spec.n_embd + q) * x_b * c
        if spec.recompute == "full":
            # beside the rebuilt layer, whose products' inputs I takes for W as it passes them
            # what the rebuilt layer's products read counts as kept from the rebuild on: at
            # its MLP's phase the attention's and the MLP's inputs (a gated MLP's down
            # projection input, the product, too)
            rebuilt_kept = taken + mlp_in * spec.n_embd * x_b * c + (act_in if spec.mlp == "gated" else 0.0)
            # at the attention the rebuilt MLP sub-layer is behind: what it saved and W
            # does not keep has gone, its output gradients are kept, and its weights'
            # 16-bit casts (the rerun's own) went with their backward (measured, bert
            # ZB-H1 bf16: the attention's instant 0.7 MiB under the MLP's)
            casts = spec.mlp_matrices * spec.n_embd * spec.ffn_width * c if c < 4 else 0.0
            phases = [(t + mlp, mlp_kept + rebuilt_kept, 0.0),
                      (t + attention + behind - casts, attn_kept, 0.0)]
        elif spec.recompute == "selective":
            phases = [(mlp, mlp_kept, act_in), (t + attention + behind, attn_kept, mlp_saved)]
            rotation, casts = rerun_rotation_bytes(spec, x_b, c)
            if rotation:
                # the attention's rerun, first unpacked by its output projection's backward,
                # peaks rotating Q (or K): the MLP sub-layer behind, the stream's gradient
                # (and the restored message) beside the rebuilt projections
                stream = x_b * spec.n_embd * RESIDUAL_BYTES if c < 4 else 0.0
                phases.append((behind + stream + self._received_bytes(x_b, last) + rotation, mlp_resid + casts,
                               mlp_saved))
        else:
            phases = [(mlp, mlp_kept, act_in), (attention + behind, attn_kept, mlp_saved + taken)]
        return self._input_stream_and_norms(phases, x_b, last)

    def _input_mlp(self, x_b: int, last: bool) -> tuple[float, float]:
        """I at a block's MLP's activation, for ``x_b`` tokens: on top of the level, and
        what it has kept for W. The down projection's input gradient (and the gate
        activation's), a temporary, beside the up projection's output gradient, kept
        (I wide each, compute dtype). By then the activation's backward has freed the
        input it saved (I wide; measured, gated or not), unless the MLP was rebuilt: a
        rebuilt layer is a temporary; and I has taken the down projection's input for W
        (a GeLU's output; measured: a gated MLP's product is taken later)."""
        spec, c = self.spec, self.dtype_bytes
        gated = spec.mlp == "gated"
        mlp, kept = (3 if gated else 2) * x_b * spec.ffn_width * c, x_b * spec.ffn_width * c
        kept += 0 if gated else x_b * spec.ffn_width * c
        if c < 4:
            # At 16 bits the products' output gradients W keeps are 16-bit casts of the
            # stream's gradient (fp32), which stays beside them, the down projection's
            # beside the MLP's; the gradient that arrived is restored to fp32 for the whole
            # of I (measured, gpt ZB-H1 bf16: at fp32 the output gradients are the stream's
            # gradient itself).
            down = x_b * spec.n_embd * c
            mlp, kept = mlp + down + self._received_bytes(x_b, last), kept + down
        return mlp, kept

    def _input_attention(self, x: int, last: bool) -> float:
        """I at a block's attention (without the sub-layers around it), on top of the
        level: the output projection's output gradient and the gradients of Q, K and V
        (at full precision the attention output's gradient is not live beside all three);
        at 16 bits the stream's gradient (fp32) beside them, whose 16-bit cast is the
        output gradient (q wide) the fused kernel's backward holds, and the gradient that
        arrived, restored (see :meth:`_input_mlp`)."""
        spec, c = self.spec, self.dtype_bytes
        x_b = x * self.microbatch_size
        q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
        attention = (spec.n_embd + q + 2 * kv) * x_b * c + self._attention_scratch(x, x)
        if c < 4:
            attention += x_b * (spec.n_embd * RESIDUAL_BYTES + q * c) + self._received_bytes(x_b, last)
        return attention

    def _input_stream_and_norms(self, phases: list, x_b: int, last: bool) -> list[tuple[float, float, float]]:
        """:meth:`_input_block_phases` less what a post-norm block's norms have freed by
        then, and on a pre-norm last stage at 16 bits the stream's gradient the head hands
        the blocks, which the head's moves count already (:meth:`_input_head`)."""
        spec = self.spec
        if spec.post_norm:
            # a post-norm block starts with its norm's backward, which frees the input it
            # saved (rebuilt, with full recomputation); the attention sub-layer ends with
            # the other, whose backward runs before the attention's: its saved input freed
            # too (without recomputation; rebuilt, with selective or full; the MLP's norm is behind)
            norm = x_b * norm_saved_bytes(spec)
            saved = spec.recompute != "full"
            phases = [(phases[0][0] - norm, phases[0][1], phases[0][2] + (norm if saved else 0.0)),
                      (phases[1][0] - norm, phases[1][1], phases[1][2] + (norm if spec.recompute == "none" else 0.0))]
        if last and self.dtype_bytes < 4 and not spec.post_norm:
            # the stream's gradient the head hands the blocks (in its moves) is the very
            # tensor the attention's phases count at 16 bits (measured, gpt_medium's last
            # stage, ZB-H1 bf16 with selective recomputation at 2k tokens: 1.028 with both)
            stream = x_b * spec.n_embd * RESIDUAL_BYTES
            phases = phases[:1] + [(net - stream, k, f) for net, k, f in phases[1:]]
        return phases

    def _final_norm(self, x_b: float, level: float) -> tuple[float, float]:
        """A last stage's final norm's backward, on top of ``level`` (the head's done, the
        norm's saved bytes counted freed): transformers' RMSNorm, written in Python, runs
        autograd through its square, mean, reciprocal root and products, four fp32 rows of
        H a token at once, its normalised input (one row) freed by then and its fp32
        input still held (measured: Llama at 1,024 wide, 2k tokens, bf16, ZB-H1: the last
        stage's I peaks there, 3.9 rows over its start, the MLP's 3.5). Returns (the most,
        what of the norm's saved bytes it holds then); LayerNorm's fused kernel: (0, 0)."""
        spec = self.spec
        if spec.norm != "rmsnorm":
            return 0.0, 0.0
        row = x_b * spec.n_embd * RESIDUAL_BYTES
        held = x_b * norm_saved_bytes(spec) - row
        return float(level + held + 4 * row), float(held)

    def input_gradient_bytes(self, stage: int, segment: int) -> float:
        """The gradient a backward makes for its stage's input (the stream, fp32)."""
        if stage == 0:
            return 0.0
        return float(self.microbatch_size * self.segment_lengths[self._seg(segment)] * self.spec.n_embd * 4)

    def held_cast_bytes(self, stage: int) -> float:
        """The step's shared 16-bit casts (2 B per matrix-product weight), but a recomputed
        region's, which casts its weights anew in its forward and its rerun (one block's
        at a time, :func:`layer_cost`'s rebuilt); a later microbatch's backward holds
        their gradients to its end (pipeflow.sim.device_memory's ``held_cast_gradients``)."""
        if self.dtype_bytes >= 4:
            return 0.0
        return 2.0 * (self.cast_params[stage] - self.layers_per_stage[stage] * recomputed_matrix_params(self.spec))

    def step_workspace_bytes(self, stage: int) -> float:
        """What the optimizer step holds while it runs (:mod:`pipeflow.planning.optimizer_step`,
        by ``step_impl``, set from the config and the topology): fused, nothing; foreach,
        4 B/param; a tensor at a time (single), its most in the module's order. It matters
        where a step runs while activations are live (the asynchronous schedules, which
        step inside the walk, and a stage whose activations recomputation made small)."""
        first, last = stage == 0, stage == self.num_stages - 1
        return step_workspace(self.step_impl, self.params[stage],
                              lambda: decay_tensors(self.spec, self.layers_per_stage[stage], first, last))



class WorkingSetTerms:
    """The memory terms a cost model prices by its :class:`BackwardWorkingSet`, the one
    thing this mixin reads (``working_set``): mixed into
    :class:`~pipeflow.planning.cost.AnalyticCost` where the terms sit in its method
    order (beneath :class:`~pipeflow.planning.tensor_cost.TensorShards`, which takes a
    tensor rank's share of ``input_gradient_bytes``)."""

    working_set: BackwardWorkingSet

    def workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.workspace_bytes`."""
        return self.working_set.workspace_bytes(stage, segment)

    def held_cast_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.held_cast_workspace_bytes`."""
        return self.working_set.held_cast_workspace_bytes(stage, segment)

    def backward_freed_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.backward_freed_bytes`."""
        return self.working_set.backward_freed_bytes(stage, segment)

    def fresh_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.fresh_workspace_bytes`."""
        return self.working_set.fresh_workspace_bytes(stage, segment)

    def fresh_backward_freed_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.fresh_backward_freed_bytes`."""
        return self.working_set.fresh_backward_freed_bytes(stage, segment)

    def backward_grads_made_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.backward_grads_made_bytes`."""
        return self.working_set.backward_grads_made_bytes(stage, segment)

    def cast_phase_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.cast_phase_bytes`."""
        return self.working_set.cast_phase_bytes(stage, segment)

    def cast_phase_freed_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.cast_phase_freed_bytes`."""
        return self.working_set.cast_phase_freed_bytes(stage, segment)

    def weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.weight_workspace_bytes`."""
        return self.working_set.weight_workspace_bytes(stage, segment)

    def fresh_weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.fresh_weight_workspace_bytes`."""
        return self.working_set.fresh_weight_workspace_bytes(stage, segment)

    def input_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.input_workspace_bytes`."""
        return self.working_set.input_workspace_bytes(stage, segment)

    def input_kept_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.input_kept_bytes`."""
        return self.working_set.input_kept_bytes(stage, segment)

    def input_freed_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.input_freed_bytes`."""
        return self.working_set.input_freed_bytes(stage, segment)

    def input_gradient_bytes(self, stage: int, segment: int) -> float:
        """:meth:`BackwardWorkingSet.input_gradient_bytes`."""
        return self.working_set.input_gradient_bytes(stage, segment)

    def held_cast_bytes(self, stage: int) -> float:
        """:meth:`BackwardWorkingSet.held_cast_bytes`."""
        return self.working_set.held_cast_bytes(stage)

    def step_workspace_bytes(self, stage: int) -> float:
        """:meth:`BackwardWorkingSet.step_workspace_bytes`."""
        return self.working_set.step_workspace_bytes(stage)

    def one_tensor_step_bytes(self, elements: float) -> float:
        """What an AdamW of one fp32 tensor of ``elements`` holds while it steps, in the
        working set's ``step_impl`` (a sharded stage's tied copy's own optimizer)."""
        return step_workspace(self.working_set.step_impl, elements, lambda: [elements])

    def own_casts(self) -> "WorkingSetTerms":
        """This cost model as an asynchronous schedule's backward sees it, each microbatch
        holding casts of its own (see :meth:`BackwardWorkingSet._backward_phase_of`): the
        simulator's ``own_casts`` terms."""
        view = copy.copy(self)
        view.working_set = dataclasses.replace(self.working_set, own_casts=True)
        return view
