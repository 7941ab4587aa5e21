"""What the zero-bubble I holds while it runs, on top of its level, in bytes."""

from __future__ import annotations

from typing import Sequence

from .loss_memory import loss_backward_bytes
from .products import rerun_rotation_bytes
from .saved_tensors import head_residual, last_stage_saved, norm_saved_bytes
from .transformer import RESIDUAL_BYTES, TransformerSpec, matrix_inputs


class InputWorkingSet:
    """I's working set: a mixin of :class:`~pipeflow.planning.working_set.BackwardWorkingSet`, whose shape,
    ``input_workspaces`` and B's helpers it reads."""

    spec: TransformerSpec
    microbatch_size: int
    dtype_bytes: int
    input_workspaces: Sequence

    def input_workspace_bytes(self, stage: int, segment: int) -> float:
        """What I holds at its most on top of the level before it."""
        return self.input_workspaces[stage][self._seg(segment)][0]

    def input_kept_bytes(self, stage: int, segment: int) -> float:
        """What I has kept for W (its residuals) by the instant of :meth:`input_workspace_bytes`."""
        return self.input_workspaces[stage][self._seg(segment)][1]

    def input_freed_bytes(self, stage: int, segment: int) -> float:
        """What I has taken from the saved activations by that instant (freed, or kept for W)."""
        return self.input_workspaces[stage][self._seg(segment)][2]

    def stage_input_workspace(self, n: int, one, x: int, last: bool,
                              phase: list | None = None) -> tuple[float, float, float]:
        """(the most, kept by then, taken by then) of I for a stage of ``n`` blocks of ``x`` tokens
        (``one``: a block's :class:`~pipeflow.planning.layer_cost.LayerCost`). ``phase``, a list, gets
        the block's phase at the most: 0 MLP, 1 attention, 2 the rerun's rotation."""
        # I frees only what W does not need and keeps the products' output gradients: after
        # each block the level moves by one.residual - one.saved, so the most is at the
        # first block or the last; on the last stage the head runs first (_input_head).
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
        """:meth:`stage_input_workspace` of a last stage (head, final norm, blocks)."""
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
        """(on top of the level, kept, taken) of I in one block at each point it may peak."""
        # (the MLP's backward moves the level by about nothing: its kept gradients replace
        # what it saved; at its activation GeLU's output is taken, a gated MLP's product later)
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
        """(on top of the level, kept for W) of I at a block's MLP activation, for ``x_b`` tokens."""
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
        """I at a block's attention, on top of the level: the output projection's output gradient and dQ,
        dK, dV (at 16 bits the fp32 stream's gradient and the restored message too)."""
        spec, c = self.spec, self.dtype_bytes
        x_b = x * self.microbatch_size
        q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
        attention = (spec.n_embd + q + 2 * kv) * x_b * c + self._attention_scratch(x, x)
        if c < 4:
            attention += x_b * (spec.n_embd * RESIDUAL_BYTES + q * c) + self._received_bytes(x_b, last)
        return attention

    def _input_stream_and_norms(self, phases: list, x_b: int, last: bool) -> list[tuple[float, float, float]]:
        """:meth:`_input_block_phases` less what a post-norm block's norms have freed, and on a pre-norm
        16-bit last stage the stream's gradient the head's moves count already."""
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
