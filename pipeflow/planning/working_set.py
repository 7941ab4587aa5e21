"""What a backward holds while it runs, on top of what the forwards kept: B's working
set and the zero-bubble I's, for :class:`~pipeflow.planning.cost.AnalyticCost` (a mixin:
it reads the cost's shape, tables and dtype). The simulator's memory walk
(:mod:`pipeflow.sim.memory`) holds each at the backward's peak instant; the
measurements they are checked against are ``benchmarks/bench_split_memory.py`` (one
stage) and ``benchmarks/bench_memory.py`` (every device of a run)."""

from __future__ import annotations

from .transformer import RESIDUAL_BYTES, head_residual_width, last_stage_saved, norm_saved_bytes


class BackwardWorkingSet:
    """B's and I's working sets of a transformer stage (see the module's docstring)."""

    def workspace_bytes(self, stage: int, segment: int) -> float:
        """What a backward (B or I) holds at its most on top of the level before its frees:
        in a block, the MLP's hidden gradient (I wide, compute dtype; a gated MLP's two)
        beside the residual stream's (H, fp32), and with recomputation the layer it rebuilt (full: both at
        once; selective: the rebuilt attention sub-layer is gone before the MLP's
        gradients come, so the larger); on the last stage the head's backward runs first,
        holding the loss's gradient over the vocabulary and the log-softmax's (two fp32
        rows of V), and has freed what the head kept before the blocks' phase."""
        x = self.segment_lengths[self._seg(segment)]
        spec, b = self.spec, self.microbatch_size
        # a gated MLP's product backward makes two I-wide gradients (the gate activation's
        # and the up projection's) while the down projection's input gradient is live
        mlp = (2 if spec.mlp == "gated" else 1) * spec.ffn_width
        grads = x * b * (mlp * self.dtype_bytes + spec.n_embd * RESIDUAL_BYTES)
        rebuilt = self._transient[stage][self._seg(segment)]
        blocks = max(rebuilt, grads) if spec.recompute == "selective" else rebuilt + grads
        if stage != self.num_stages - 1:
            return float(blocks)
        head = last_stage_saved(spec, x, b, self.dtype_bytes)
        return float(max(2.0 * x * b * spec.vocab_size * 4, blocks - head))

    def backward_freed_bytes(self, stage: int, segment: int) -> float:
        """Of what the forwards saved, what B has freed by the instant of
        :meth:`workspace_bytes` (the head's, on a last stage whose blocks hold the most):
        the simulator takes it from the activations for that instant and counts the
        workspace's gradients and rebuilt layer whole as temporaries."""
        if stage != self.num_stages - 1:
            return 0.0
        x = self.segment_lengths[self._seg(segment)]
        head = last_stage_saved(self.spec, x, self.microbatch_size, self.dtype_bytes)
        rows = 2.0 * x * self.microbatch_size * self.spec.vocab_size * 4
        ws = self.workspace_bytes(stage, segment)
        return float(head) if ws > rows else 0.0

    def input_workspace_bytes(self, stage: int, segment: int) -> float:
        """What the zero-bubble I holds at its most on top of the level before it (see
        :meth:`_input_workspace`); B's is :meth:`workspace_bytes`."""
        return self._input_ws[stage][self._seg(segment)][0]

    def input_kept_bytes(self, stage: int, segment: int) -> float:
        """Of :meth:`input_workspace_bytes`, what has moved the level of what the stage
        keeps by that instant (the residual I has kept so far less what it has freed):
        the rest are the gradients on the way. The simulator files it with the
        activations, the runtime's profile with the residuals."""
        return self._input_ws[stage][self._seg(segment)][1]

    def _input_workspace(self, n: int, one, x: int, last: bool) -> tuple[float, float]:
        """I's most on top of its level, for a stage of ``n`` blocks of ``x`` tokens.

        I walks down the stage as B does, but W still needs each matrix product's input
        and output gradient, so it frees only the rest of what a block saved and keeps
        the output gradients: after each block the level has moved by the block's
        residual less its saved bytes (``LayerCost.residual - LayerCost.saved``: ``one``; the
        products' inputs are in both), up or down, and the most it holds is at the first
        block or the last one. Inside a block, at its MLP's activation: the gradient of
        the down projection's input (kept in B too, but there the product had freed its
        input, which W keeps here), and the gradients of the up projection's output (and
        the gate's: a gated MLP), which W keeps (I wide each, compute dtype); or, if
        more, at its attention: the output projection's output gradient and the
        gradients of Q, K and V. With full recomputation the rebuilt
        layer is beside either; with selective, the rebuilt attention sub-layer beside
        the attention's (the MLP's backward, before it, moves the level by about
        nothing: its kept gradients replace what it saved). On the
        last stage the head runs first, holding the two fp32 rows of V of B, and moves
        the level by what it keeps for W (its input and the logits' gradient) less what
        it saved. Returns (the most, of which what I keeps: :meth:`input_kept_bytes`).
        Measured: ``benchmarks/bench_split_memory.py``."""
        spec, b, c = self.spec, self.microbatch_size, self.dtype_bytes
        x_b = x * b
        gated = spec.mlp == "gated"
        # at the MLP's activation: the down projection's input gradient (and the gate
        # activation's), a temporary, beside the up projection's output gradient, kept
        mlp, mlp_kept = (3 if gated else 2) * x_b * spec.ffn_width * c, x_b * spec.ffn_width * c
        # the attention sub-layer's: the output projection's output gradient (kept) and
        # the gradients of Q, K and V (measured: the gradient of the attention's output is
        # not live beside all three)
        q, kv = spec.n_head * spec.head_dim, spec.kv_heads * spec.head_dim
        attention, attention_kept = (spec.n_embd + q + 2 * kv) * x_b * c, spec.n_embd * x_b * c
        t = one.transient
        if spec.recompute == "full":
            # beside the rebuilt layer, whose products' inputs I takes for W as it passes them
            branches = [(t + mlp, mlp_kept + x_b * spec.ffn_width * c), (t + attention, attention_kept + q * x_b * c)]
        elif spec.recompute == "selective":
            branches = [(mlp, mlp_kept), (t + attention, attention_kept + q * x_b * c)]
        else:
            branches = [(mlp, mlp_kept), (attention, attention_kept)]
        block, kept = max(branches)
        if spec.post_norm:  # a post-norm block starts with its norm's backward, which frees its input
            block -= x_b * norm_saved_bytes(spec)
            kept -= x_b * norm_saved_bytes(spec)
        rise = max(0.0, (n - 1) * (one.residual - one.saved))
        if not last:
            return float(block + rise), float(kept + rise)
        # the head's own kept bytes, less what it saved, and the gradient it hands the
        # blocks (the residual stream's, fp32: on a stage below it arrived as a message)
        head_kept = head_residual_width(spec) * x_b * c
        head_moves = head_kept - last_stage_saved(spec, x, b, c) + x_b * spec.n_embd * RESIDUAL_BYTES
        head = 2.0 * x_b * spec.vocab_size * 4  # the loss's and the log-softmax's gradients; the second, kept
        if head >= head_moves + rise + block:
            return float(head), float(x_b * spec.vocab_size * c)
        return float(head_moves + rise + block), float(head_moves + rise + kept)
