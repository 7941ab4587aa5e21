"""What a backward holds while it runs on top of what the forwards kept, in bytes: B's working set
(:class:`BackwardWorkingSet`; the zero-bubble I's is its mixin,
:mod:`pipeflow.planning.input_working_set`) and the terms a cost model prices by it
(:class:`WorkingSetTerms`)."""
# Checked against benchmarks/bench_split_memory.py (one stage) and benchmarks/bench_memory.py
# (every device of a run).

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .input_working_set import InputWorkingSet
from .loss_memory import loss_backward_bytes
from .model_state import cast_bytes
from .optimizer_step import decay_tensors, step_workspace
from .products import down_weight_scratch, mlp_product_scratch, weight_phase_bytes, weight_products
from .saved_tensors import last_stage_saved, norm_saved_bytes
from .transformer import (RESIDUAL_BYTES, TransformerSpec, head_params, layer_params, matrix_inputs, norm_params,
                          recomputed_matrix_params, shared_head_params)


def checked_segment(segment: int, segment_lengths: Sequence[int]) -> int:
    """``segment`` where it is one of ``segment_lengths``'s; else ValueError."""
    if not 0 <= segment < len(segment_lengths):
        raise ValueError(
            f"segment {segment} out of range: the cost model has {len(segment_lengths)} sequence segment(s) "
            f"(cost.segment_lengths={list(segment_lengths)})"
        )
    return segment


@dataclass(frozen=True, eq=False)
class BackwardWorkingSet(InputWorkingSet):
    """B's and I's working sets of a transformer stage and the step's, priced from its fields alone."""

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
        """What a backward (B) holds at its most on top of the level before its frees."""
        return self._backward_phase(stage, segment)[0]

    def held_cast_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`workspace_bytes` near a backward's end through shared casts."""
        return self._backward_phase(stage, segment, end=True)[0]

    def backward_freed_bytes(self, stage: int, segment: int) -> float:
        """Of what the forwards saved, what B has freed by the instant of :meth:`workspace_bytes`."""
        return self._backward_phase(stage, segment)[1]

    def fresh_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`workspace_bytes` of a backward into a stage with no gradients yet."""
        return self._backward_phase(stage, segment, fresh=True)[0]

    def fresh_backward_freed_bytes(self, stage: int, segment: int) -> float:
        """:meth:`backward_freed_bytes` at the instant of :meth:`fresh_workspace_bytes`."""
        return self._backward_phase(stage, segment, fresh=True)[1]

    def backward_grads_made_bytes(self, stage: int, segment: int) -> float:
        """The fp32 gradients such a backward has made by its most."""
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
        """(most on top of the level, saved bytes freed by then, gradients made by then) of B: a block's MLP
        phase, then its attention's; on a last stage the head's first."""
        # (measured: with selective recomputation a whole sequence's peak is the MLP's, a later segment's the attention's)
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
        """What the arrived gradient adds to B: its fp32 restore at 16 bits; 0 at fp32 or on the last stage."""
        c = self.dtype_bytes
        return 0.0 if last or c >= 4 else tokens * self.spec.n_embd * (RESIDUAL_BYTES - c)

    def _block_phases(self, stage: int, seg: int, fresh: bool | None, end: bool,
                      stream: float) -> list[tuple[float, float, float]]:
        """A block's backward's phases, (on top of the level, freed, made) each: its MLP's, then its
        attention's (gradients of Q for x tokens and of K, V for the prefix's P tokens)."""
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
        """(on top of the level, freed, made) of a block's backward at its MLP."""
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
        """``phases`` with a last stage's head's first and its final norm's after."""
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
        """A backward through shared casts at the attention of its first or last block (whichever is more):
        on top of the level, the 16-bit gradients of the casts it has passed included."""
        # (Seq1F1B's later segments at bf16 with selective recomputation peak there, measured)
        return self._cast_phase(stage, segment)[0]

    def cast_phase_freed_bytes(self, stage: int, segment: int) -> float:
        """What that backward has freed of the microbatch's saved bytes by then."""
        return self._cast_phase(stage, segment)[1]

    def _cast_phase(self, stage: int, segment: int) -> tuple[float, float]:
        """:meth:`_cast_phase_of`, once per (stage, segment)."""
        key = ("cast", stage, segment)
        got = self._phases.get(key)
        if got is None:
            got = self._phases[key] = self._cast_phase_of(stage, segment)
        return got

    def _cast_phase_of(self, stage: int, segment: int) -> tuple[float, float]:
        """(:meth:`cast_phase_bytes`, :meth:`cast_phase_freed_bytes`)."""
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
        """What a zero-bubble W holds at its most on top of its level (:func:`weight_phase_bytes`)."""
        return self._weight_phase(stage, segment, False)

    def fresh_weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`weight_workspace_bytes` of a W into a stage with no gradients yet."""
        return self._weight_phase(stage, segment, True)

    def _weight_phase(self, stage: int, segment: int, fresh: bool) -> float:
        tokens = self.microbatch_size * self.segment_lengths[self._seg(segment)]
        products = weight_products(self.spec, self.layers_per_stage[stage], stage == self.num_stages - 1, tokens)
        return weight_phase_bytes(products, self.dtype_bytes, self.product_scratch, fresh)

    def _attention_scratch(self, queries: int, keys: int) -> float:
        """The fused attention backward's scratch on this host (0: none set, or eager)."""
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
        """What a block's MLP sub-layer saves for ``x_b`` tokens (its norm's and dropout mask's too)."""
        spec, c = self.spec, self.dtype_bytes
        _, mlp_in = matrix_inputs(spec, c)
        return x_b * ((mlp_in * spec.n_embd + (4 if spec.mlp == "gated" else 2) * spec.ffn_width) * c
                      + norm_saved_bytes(spec) + (spec.n_embd if spec.dropout_masks else 0))

    def _final_norm(self, x_b: float, level: float) -> tuple[float, float]:
        """(the most on top of ``level``, the norm's saved bytes held then) of a last stage's final-norm
        backward: RMSNorm's autograd holds four fp32 rows; LayerNorm's fused kernel (0, 0)."""
        # (measured, Llama 1,024 wide, 2k tokens, bf16, ZB-H1: the last stage's I peaks here)
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
        """The step's shared 16-bit casts but a recomputed region's (which casts anew)."""
        return cast_bytes(self.cast_params[stage] - self.layers_per_stage[stage] * recomputed_matrix_params(self.spec),
                          self.dtype_bytes)

    def step_workspace_bytes(self, stage: int) -> float:
        """What the optimizer step holds while it runs, by ``step_impl``
        (:mod:`pipeflow.planning.optimizer_step`)."""
        first, last = stage == 0, stage == self.num_stages - 1
        return step_workspace(self.step_impl, self.params[stage],
                              lambda: decay_tensors(self.spec, self.layers_per_stage[stage], first, last))


class WorkingSetTerms:
    """:class:`~pipeflow.planning.cost.AnalyticCost`'s memory terms priced by its ``working_set``
    (:class:`BackwardWorkingSet`): each method is its namesake there."""

    working_set: BackwardWorkingSet

    def workspace_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.workspace_bytes(stage, segment)

    def held_cast_workspace_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.held_cast_workspace_bytes(stage, segment)

    def backward_freed_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.backward_freed_bytes(stage, segment)

    def fresh_workspace_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.fresh_workspace_bytes(stage, segment)

    def fresh_backward_freed_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.fresh_backward_freed_bytes(stage, segment)

    def backward_grads_made_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.backward_grads_made_bytes(stage, segment)

    def cast_phase_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.cast_phase_bytes(stage, segment)

    def cast_phase_freed_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.cast_phase_freed_bytes(stage, segment)

    def weight_workspace_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.weight_workspace_bytes(stage, segment)

    def fresh_weight_workspace_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.fresh_weight_workspace_bytes(stage, segment)

    def input_workspace_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.input_workspace_bytes(stage, segment)

    def input_kept_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.input_kept_bytes(stage, segment)

    def input_freed_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.input_freed_bytes(stage, segment)

    def input_gradient_bytes(self, stage: int, segment: int) -> float:
        return self.working_set.input_gradient_bytes(stage, segment)

    def held_cast_bytes(self, stage: int) -> float:
        return self.working_set.held_cast_bytes(stage)

    def step_workspace_bytes(self, stage: int) -> float:
        return self.working_set.step_workspace_bytes(stage)

    def one_tensor_step_bytes(self, elements: float) -> float:
        """What an AdamW of one fp32 tensor of ``elements`` holds while it steps."""
        return step_workspace(self.working_set.step_impl, elements, lambda: [elements])

    def own_casts(self) -> "WorkingSetTerms":
        """This cost model as an asynchronous schedule's backward sees it (each microbatch its own casts)."""
        view = copy.copy(self)
        view.working_set = dataclasses.replace(self.working_set, own_casts=True)
        return view
