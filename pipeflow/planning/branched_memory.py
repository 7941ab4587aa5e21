"""The working sets of a concurrent-branch model's backwards (B, I, W), and the region a
recomputation rebuilds: what :class:`~pipeflow.planning.branched_cost.BranchedAnalyticCost`
prices on top of what its stages keep, each instant the simulator's memory walk
(:mod:`pipeflow.sim.device_memory`) may peak at. A branch's blocks are GPT blocks (their
walks are a transformer's, :mod:`pipeflow.planning.working_set`, of the branch's
shape); an interaction block's cross-attention and the fused head add their own."""

from __future__ import annotations

import dataclasses

from .cost import layer_cost
from .operators import norm_saved_bytes
from .products import mlp_product_scratch, weight_phase_bytes, weight_product_scratch
from .working_set import BackwardWorkingSet


class BranchedWorkingSet:
    """B's, I's and W's working sets of a concurrent-branch stage (mixed into
    :class:`~pipeflow.planning.branched_cost.BranchedAnalyticCost`: ``stages``, ``spec``,
    ``tokens``, ``interactions``, ``microbatch_size``, ``dtype_bytes``, ``recompute``)."""

    def forward_workspace_bytes(self, stage: int, segment: int) -> float:
        """What the head's forward holds at its most on top of what it keeps: at the loss's
        log-softmax, the head's output (the matching logit and the MLM logits, concatenated
        in the compute dtype: one tensor to send) and the fp32 MLM logits the softmax reads
        (a copy: the logits' slice of that output is not contiguous; at 16 bits the
        contiguous 16-bit copy is let go once cast). Measured: cbm GPipe on 4 ranks, the
        head's forward and its first backward within a few bytes of each other. The blocks'
        forwards: not priced (below their backwards' working sets)."""
        if self.stages[stage][0] != "head":
            return 0.0
        b, c, tv = self.microbatch_size, self.dtype_bytes, self.tokens["text"] * self.vocab
        return float(b * ((1 + tv) * c + tv * max(c, 4)))

    def workspace_bytes(self, stage: int, segment: int) -> float:
        """What a backward holds at its most on top of the level before its frees
        (:meth:`_mlp_phase`); the head's, the loss's and the log-softmax's gradients over
        the vocabulary (two fp32 rows of V per text token)."""
        return self._mlp_phase(stage, segment)[0]

    def backward_freed_bytes(self, stage: int, segment: int) -> float:
        """What a backward has freed of the saved activations by the instant of
        :meth:`workspace_bytes` (see :meth:`_mlp_phase`)."""
        return self._mlp_phase(stage, segment)[1]

    def held_cast_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`workspace_bytes` near a backward's end through shared casts (the
        simulator's ``held_cast_gradients``, which counts every cast's 16-bit gradient
        itself): the MLP's working set without its weights' gradients or frees."""
        return self._mlp_phase(stage, segment, end=True)[0]

    def _mlp_phase(self, stage: int, segment: int, end: bool = False) -> tuple[float, float]:
        """A block's backward peaks in its MLP's: the hidden gradient (I wide, c) beside
        the gradient that arrived, as the executor hands it to the backward (fp32: several
        successors' summed, at 16 bits restored to fp32, the messages let go; the walk
        holds the messages to the backward's end, so only the difference is on top), at
        full precision in the down projection's product (its weight gradient beside
        ``.grad``, measured: cbm 1F1B fp32 on 4 ranks, the text embedding stage). At 16
        bits where the MLP's weights are shared casts (no recomputation of it) the peak
        is later, in the up projection's weight-gradient product: both projections'
        16-bit weight gradients held for the casts' backward, the up projection's input
        gradient, and the activation's input and the down projection's input freed
        (measured: cbm 1F1B bf16 on 4 ranks, the text stages' backwards). Full
        recomputation adds the rebuilt block; selective, the larger of the two."""
        branch = self.stages[stage][0]
        b, c = self.microbatch_size, self.dtype_bytes
        if branch == "head":
            return float(2.0 * b * self.tokens["text"] * self.vocab * 4), 0.0
        spec, x = self.spec[branch], self.tokens[branch]
        H, I = spec.n_embd, spec.ffn_width
        arrived = b * x * H * 4 - sum(self.message_bytes(stage, t, segment) for t in self._succs(stage))
        scratch = mlp_product_scratch(spec, b * x, c, getattr(self, "product_scratch", None), up=True)
        grads = b * x * I * c + arrived + scratch
        freed = 0.0
        if c >= 4:
            grads += 4 * H * I
        elif self.recompute != "full" and not end:
            grads += b * x * H * c + 2 * H * I * c
            freed = 2.0 * b * x * I * c
            grads -= freed
        rebuilt = self.rebuilt_layer_bytes(stage, segment)
        return float(max(rebuilt, grads) if self.recompute == "selective" else rebuilt + grads), freed

    def _succs(self, stage: int) -> list[int]:
        """The stages reading a branch stage's output (pipeflow.planning.cbm_shape's
        graph): its branch's next stage (the head after the last), and the other
        branch's stage starting at the same depth where that block is an interaction."""
        branch, lo, hi = self.stages[stage]
        other = "text" if branch == "vision" else "vision"
        same = [i for i, (br, l, _) in enumerate(self.stages) if br == branch and l == hi]
        same = same or [i for i, (br, _, _) in enumerate(self.stages) if br == "head"]
        return same + [i for i, (br, l, _) in enumerate(self.stages) if br == other and l == hi and hi in self.interactions]

    def input_workspace_bytes(self, stage: int, segment: int) -> float:
        """The zero-bubble I's most on top of the level before it: a block stage's walks
        as a GPT block stage's of the branch's shape
        (:meth:`BackwardWorkingSet.stage_input_workspace`; an interaction block's
        cross-attention is not its peak); the head's is its backward's."""
        if self.stages[stage][0] == "head":
            return self.workspace_bytes(stage, segment)
        return self._input_split(stage)[0]

    def input_kept_bytes(self, stage: int, segment: int) -> float:
        """What I has kept for W by its peak: a block stage's walks as a GPT block
        stage's of the branch's shape (:meth:`BackwardWorkingSet.stage_input_workspace`; an
        interaction block's cross-attention comes last, after the peak); the head's
        none (its peak is the loss's gradients, before it keeps anything)."""
        return self._input_split(stage)[1]

    def input_freed_bytes(self, stage: int, segment: int) -> float:
        """What I has taken from the forward's saved activations by then (see
        :meth:`input_kept_bytes`)."""
        return self._input_split(stage)[2]

    def _input_split(self, stage: int) -> tuple[float, float, float]:
        branch, lo, hi = self.stages[stage]
        if branch == "head":
            return 0.0, 0.0, 0.0
        walk = BackwardWorkingSet(self.spec[branch], self.microbatch_size, self.dtype_bytes)
        x = self.tokens[branch]
        # the region it rebuilds is the stage's own (an interaction block's cross-attention)
        one = dataclasses.replace(layer_cost(walk.spec, x, x, self.microbatch_size, self.dtype_bytes),
                                  rebuilt=self.rebuilt_layer_bytes(stage, 0))
        phase: list = []
        most, kept, freed = walk.stage_input_workspace(hi - lo, one, x, False, phase)
        # An interaction block's cross-attention (between its MLP's and its self-attention's) is
        # behind a peak at the stage's last block's attention, or in a block before the last
        # (measured: cbm ZB-H1 selective, the text stage's I peaks in its last self-attention)
        rise = (hi - lo - 1) * (one.residual - one.saved) > 0
        behind = rise and phase[0] == 1 and lo in self.interactions
        if behind or any(blk in self.interactions for blk in range(lo + 1, hi)):
            resid, saved = self._cross_residual(stage), self._cross_saved(stage)
            most, kept, freed = most + resid - saved, kept + resid, freed + saved
        if phase[0] == 1:
            # nn.MultiheadAttention's backward holds a copy of its output's gradient and the packed
            # in-projection's (3H) beside the kernel's: 4H a token more than GPT's (cbm ZB-H1 selective)
            most += 4.0 * self.microbatch_size * x * walk.spec.n_embd * self.dtype_bytes
        return most, kept, freed

    def rebuilt_layer_bytes(self, stage: int, segment: int) -> float:
        """model.recompute: the region a backward rebuilds, one at a time, and holds while
        it runs (full: a block with its cross-attention; selective: the larger attention
        sub-layer), with its weights' 16-bit casts, made anew."""
        branch, lo, hi = self.stages[stage]
        return max((self._block_rebuilt(branch, blk) for blk in range(lo, hi)), default=0.0)

    def _block_rebuilt(self, branch: str, blk: int) -> float:
        """:meth:`rebuilt_layer_bytes` of one block of a branch."""
        if branch == "head" or self.recompute == "none":
            return 0.0
        b, c = self.microbatch_size, self.dtype_bytes
        spec, x = self.spec[branch], self.tokens[branch]
        other = "text" if branch == "vision" else "vision"
        H, Ho, y = spec.n_embd, self.spec[other].n_embd, self.tokens[other]
        one = layer_cost(spec, x, x, b, c).rebuilt
        cross_kept = b * x * (3 * H * c + 4 * spec.n_head) + b * y * ((1 if Ho == H else 2) * Ho * c + 2 * H * c)
        cross_casts = (2 * H * H + 2 * H * Ho) * c if c < 4 else 0
        cross = blk in self.interactions
        if self.recompute == "full":
            # (the other branch's norm reads the block's input: its statistics are new)
            return float(one + (cross_kept + b * x * (4 * H + 8) + b * y * 8 + cross_casts if cross else 0))
        return float(max(one, cross_kept + cross_casts if cross else 0))

    def fresh_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`workspace_bytes` of a backward into a stage that holds no parameter
        gradients yet (the step's first on it), beside :meth:`backward_grads_made_bytes`."""
        return self._fresh_phase(stage, segment)[0]

    def fresh_backward_freed_bytes(self, stage: int, segment: int) -> float:
        """:meth:`backward_freed_bytes` at the instant of :meth:`fresh_workspace_bytes`."""
        return self._fresh_phase(stage, segment)[1]

    def backward_grads_made_bytes(self, stage: int, segment: int) -> float:
        """The parameter gradients (fp32) such a backward has made by the instant of
        :meth:`fresh_workspace_bytes` (see :meth:`_fresh_phase`)."""
        return self._fresh_phase(stage, segment)[2]

    def _fresh_phase(self, stage: int, segment: int) -> tuple[float, float, float]:
        """A backward into a stage with no gradients makes them as it goes: at full
        precision into ``.grad``, at 16 bits where its microbatch's forward made the
        casts (the step's first backward is the first forward's) each cast's backward as
        soon as its block's is done (it is younger than every node of the blocks before
        it). At a block's MLP the down projection's is made by then (its 16-bit gradient
        not held); at the self-attention of the first or the last block it passes, or an
        interaction block's cross-attention, the blocks' it passed and its MLP's (and
        cross-attention's) are made and their saved bytes freed (the phases of
        :meth:`cast_phase_bytes`; measured: cbm GPipe bf16 selective on 4 ranks, the text
        stage of blocks 1-2 peaks in its first backward at block 1's self-attention).
        With full recomputation each block is rebuilt in turn, so the most is at a
        block's MLP, of those it passes, where the rebuilt region and the gradients made
        by then (the blocks' it passed, whole) are: measured, cbm GPipe bf16 full on 2
        ranks, the same stage peaks at block 1's MLP (the interaction block: its rebuilt
        region is the larger), block 2's gradients and the down projection's made.
        Returns (on top of the level before its frees, freed, made)."""
        branch, lo, hi = self.stages[stage]
        ws, freed = self._mlp_phase(stage, segment)
        if branch == "head":
            return ws, 0.0, 0.0
        spec, c = self.spec[branch], self.dtype_bytes
        H, I = spec.n_embd, spec.ffn_width
        # the down projection's weight gradient: fp32, held beside .grad (or at 16 bits
        # shared, held for the cast) where the stage has gradients; made here
        beside = 4.0 * H * I if c >= 4 else (H * I * c if self.recompute != "full" else 0.0)
        down = 4.0 * (H * I + H)
        if self.recompute != "full":
            best = (ws - beside, freed, down)
            for work, gone, made in self._attention_phases(stage, fresh=True):
                if work - gone + made > best[0] + best[2]:
                    best = (work - gone, gone, made)
            return float(best[0]), float(best[1]), float(best[2])
        base = ws - self.rebuilt_layer_bytes(stage, segment) - beside
        best, made = (float("-inf"), 0.0, 0.0), 0.0
        for blk in reversed(range(lo, hi)):
            here = (base + self._block_rebuilt(branch, blk), 0.0, made + down)
            if here[0] + here[2] > best[0] + best[2]:
                best = here
            made += 4.0 * self._block_params(branch, blk)
        return float(best[0]), float(best[1]), float(best[2])

    def cast_phase_bytes(self, stage: int, segment: int) -> float:
        """A backward through shared casts an earlier forward made (the transformer's
        :meth:`~pipeflow.planning.working_set.BackwardWorkingSet.cast_phase_bytes`), at
        the attention of the first or the last block it passes: that attention's working
        set and the 16-bit gradients of the shared casts it has passed (the MLP's of each
        block so far, the attention's of the blocks behind where nothing is recomputed).
        An interaction block's cross-attention runs its backward first: the rebuilt
        sub-layer (recomputation), the gradients of its queries, of the keys and values
        over the other branch's tokens and of both streams, and the product of the
        key/value weight gradient (its result and the host's scratch). Measured: cbm
        GPipe bf16 with selective recomputation on 4 ranks, the vision stage's later
        backwards peak in that product, three MLPs' gradients beside it."""
        return self._cast_phase(stage)[0]

    def cast_phase_freed_bytes(self, stage: int, segment: int) -> float:
        """What that backward has freed of the microbatch's saved bytes by then: the blocks'
        behind it and its block's MLP's."""
        return self._cast_phase(stage)[1]

    def _cast_phase(self, stage: int) -> tuple[float, float]:
        if self.dtype_bytes >= 4:
            return 0.0, 0.0
        held, freed, _ = max(self._attention_phases(stage, fresh=False), key=lambda p: p[0] - p[1],
                             default=(0.0, 0.0, 0.0))
        return float(held), float(freed)

    def _attention_phases(self, stage: int, fresh: bool) -> list[tuple[float, float, float]]:
        """(held, freed, made) at the attention of the first and of the last block a
        backward passes (see :meth:`cast_phase_bytes`): through shared casts (``fresh``
        false) the casts' 16-bit gradients held; into a stage with no gradients where its
        microbatch made the casts (``fresh``), their gradients made instead."""
        branch, lo, hi = self.stages[stage]
        b, c = self.microbatch_size, self.dtype_bytes
        if branch == "head" or hi <= lo:
            return []
        spec, x = self.spec[branch], b * self.tokens[branch]
        other = "text" if branch == "vision" else "vision"
        H, I, Ho, y = spec.n_embd, spec.ffn_width, self.spec[other].n_embd, b * self.tokens[other]
        one = layer_cost(spec, self.tokens[branch], self.tokens[branch], b, c)
        scratch = getattr(self, "product_scratch", None)
        mlp_cast = 0 if self.recompute == "full" or fresh else 2 * H * I * c
        mlp_saved = 0 if self.recompute == "full" else x * ((H + 2 * I) * c + norm_saved_bytes(spec))
        mlp_params = 2 * H * I + I + H + 2 * H
        rebuilt = self.rebuilt_layer_bytes(stage, 0)
        out = []
        for j in {0, hi - lo - 1}:
            blk = hi - 1 - j
            behind = range(blk + 1, hi)
            held = (j + 1) * mlp_cast
            if self.recompute == "none" and not fresh:
                held += sum(4 * H * H + ((2 * H * H + 2 * H * Ho) if k in self.interactions else 0) for k in behind) * c
            made = 4.0 * (sum(self._block_params(branch, k) for k in behind) + mlp_params) if fresh else 0.0
            freed = j * one.saved + mlp_saved
            stream = x * H * 4
            # the self-attention's: Q, K, V and output gradients (past the cross-attention's)
            cross = 4.0 * self._cross_params(branch) if fresh and blk in self.interactions else 0.0
            # at its last product, the packed in-projection's weight gradient (its result, the
            # host's scratch), what of the rebuilt attention that product reads (its input and
            # the cast of its weight) all that is left of it (measured: cbm GPipe bf16
            # selective 4 ranks, the text stage of blocks 1-2 in its first backward)
            # (full recomputation: the rebuilt block, as at its start)
            inproj = 3 * H * H * c + weight_product_scratch(scratch, 3 * H, x, H) if self.recompute != "full" else 0
            region = {"none": 0, "selective": x * H * c + 3 * H * H * c}.get(self.recompute, rebuilt)
            out.append((held + region + inproj + 4 * x * H * c + stream, freed, made + cross))
            if blk in self.interactions:  # its cross-attention's, before it
                out.append((held + rebuilt + x * H * c + y * 2 * H * c + stream + y * Ho * 4 + 2 * H * Ho * c
                            + weight_product_scratch(scratch, 2 * H, y, Ho), freed, made))
        return out

    def weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """What a zero-bubble W holds at its most on top of its level, before it lets go of
        what I kept for it (:func:`~pipeflow.planning.working_set.weight_phase_bytes`)."""
        return weight_phase_bytes(self._weight_products(stage), self.dtype_bytes,
                                  getattr(self, "product_scratch", None), False)

    def fresh_weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`weight_workspace_bytes` of a W into a stage with no gradients yet."""
        return weight_phase_bytes(self._weight_products(stage), self.dtype_bytes,
                                  getattr(self, "product_scratch", None), True)

    def _weight_products(self, stage: int) -> list[tuple[int, int, int]]:
        """(rows, columns, tokens) of the weights W computes by a matrix product, in the
        order it runs them: the head's MLM projection and matching MLP; a block's MLP down
        and up projections, an interaction block's cross-attention (output, the packed
        projection's key/value piece over the other branch's tokens, its query piece), the
        self-attention's output and packed Q/K/V projections."""
        branch, lo, hi = self.stages[stage]
        b = self.microbatch_size
        if branch == "head":
            Hv, Ht = self.spec["vision"].n_embd, self.spec["text"].n_embd
            return [(self.vocab, Ht, b * self.tokens["text"]), (1, Ht, b), (Ht, Hv + Ht, b)]
        spec, x = self.spec[branch], b * self.tokens[branch]
        other = "text" if branch == "vision" else "vision"
        H, Ho, y = spec.n_embd, self.spec[other].n_embd, b * self.tokens[other]
        out = []
        for blk in reversed(range(lo, hi)):
            out += [(H, spec.ffn_width, x), (spec.ffn_width, H, x)]
            if blk in self.interactions:
                out += [(H, H, x), (2 * H, Ho, y), (H, H, x)]
            out += [(H, H, x), (3 * H, H, x)]
        return out
