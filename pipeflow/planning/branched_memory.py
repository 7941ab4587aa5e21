"""The working sets (bytes) of a concurrent-branch model's B, I and W and the region a
recomputation rebuilds, for :class:`~pipeflow.planning.branched_cost.BranchedAnalyticCost`:
a branch's blocks walk as GPT blocks of its shape; cross-attention and the head add their own."""

from __future__ import annotations

import dataclasses

from .cost import layer_cost
from .saved_tensors import norm_saved_bytes
from .products import mlp_product_scratch, weight_phase_bytes, weight_product_scratch
from .working_set import BackwardWorkingSet


class BranchedWorkingSet:
    """:class:`~pipeflow.planning.branched_cost.BranchedAnalyticCost`'s working-set mixin (reads its
    ``stages``, ``spec``, ``tokens``, ``interactions``, ``microbatch_size``, ``dtype_bytes``,
    ``recompute``)."""

    def forward_workspace_bytes(self, stage: int, segment: int) -> float:
        """The head's forward's most on top of what it keeps, in bytes: at the loss's
        log-softmax, its output (compute dtype) beside an fp32 copy of the MLM logits. 0 for a
        block stage (its forwards stay below its backwards' working sets)."""
        if self.stages[stage][0] != "head":
            return 0.0
        b, c, tv = self.microbatch_size, self.dtype_bytes, self.tokens["text"] * self.vocab
        return float(b * ((1 + tv) * c + tv * max(c, 4)))

    def workspace_bytes(self, stage: int, segment: int) -> float:
        """A backward's most on top of the level before its frees, in bytes (:meth:`_mlp_phase`);
        the head's, the loss's and log-softmax's gradients (two fp32 rows of V per text token)."""
        return self._mlp_phase(stage, segment)[0]

    def backward_freed_bytes(self, stage: int, segment: int) -> float:
        """What a backward has freed of the saved activations by the instant of
        :meth:`workspace_bytes` (see :meth:`_mlp_phase`)."""
        return self._mlp_phase(stage, segment)[1]

    def held_cast_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`workspace_bytes` near the end of a backward through shared casts (the simulator
        counts the casts' gradients itself): the MLP's working set without its weights' gradients."""
        return self._mlp_phase(stage, segment, end=True)[0]

    def _mlp_phase(self, stage: int, segment: int, end: bool = False) -> tuple[float, float]:
        """(held, freed) bytes at a block's MLP backward, where it peaks: the hidden gradient beside
        the arrived gradient (less the messages the walk holds) and the down projection's weight
        gradient, or at 16 bits with shared casts the up projection's product (both 16-bit weight
        gradients held, the MLP's inputs freed; not with ``end``). Full recomputation adds the
    rebuilt block, selective takes the larger."""
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
        """The stages reading a branch stage's output: its branch's next (the head after the last),
        and the other branch's stage at the same depth where that block is an interaction."""
        branch, lo, hi = self.stages[stage]
        other = "text" if branch == "vision" else "vision"
        same = [i for i, (br, l, _) in enumerate(self.stages) if br == branch and l == hi]
        same = same or [i for i, (br, _, _) in enumerate(self.stages) if br == "head"]
        return same + [i for i, (br, l, _) in enumerate(self.stages) if br == other and l == hi and hi in self.interactions]

    def input_workspace_bytes(self, stage: int, segment: int) -> float:
        """The zero-bubble I's most on top of the level before it, in bytes: a GPT block stage's
        of the branch's shape (``BackwardWorkingSet.stage_input_workspace``); the head's, its
        backward's."""
        if self.stages[stage][0] == "head":
            return self.workspace_bytes(stage, segment)
        return self._input_split(stage)[0]

    def input_kept_bytes(self, stage: int, segment: int) -> float:
        """What I has kept for W by its peak, in bytes (an interaction block's cross-attention
        comes after the peak; the head keeps nothing by then)."""
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
        """The region a backward rebuilds and holds while it runs, in bytes (``full``: a block
        with its cross-attention; ``selective``: the larger attention sub-layer), with its
        weights' 16-bit casts made anew; 0 without recomputation."""
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
        """(on top of the level before its frees, freed, made) bytes of a backward into a stage with no
        gradients, which makes them as it goes: the most of its MLP's instant and the attention
        phases (:meth:`_attention_phases`); with full recomputation, at a rebuilt block's MLP."""
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
        """A backward's most through an earlier forward's shared casts, at the attention of the first or
        last block it passes (the 16-bit gradients of the casts passed held; an interaction's
        cross-attention adds its own gradients and key/value product), in bytes. 0 at fp32."""
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
        """(held, freed, made) bytes at the attention of the first and of the last block a backward
        passes: through shared casts the casts' 16-bit gradients held, or with ``fresh`` (a stage
        with no gradients yet) their gradients made instead."""
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
        """A zero-bubble W's most on top of its level, in bytes, before it lets go of what I kept
        for it (:func:`~pipeflow.planning.products.weight_phase_bytes`)."""
        return weight_phase_bytes(self._weight_products(stage), self.dtype_bytes,
                                  getattr(self, "product_scratch", None), False)

    def fresh_weight_workspace_bytes(self, stage: int, segment: int) -> float:
        """:meth:`weight_workspace_bytes` of a W into a stage with no gradients yet."""
        return weight_phase_bytes(self._weight_products(stage), self.dtype_bytes,
                                  getattr(self, "product_scratch", None), True)

    def _weight_products(self, stage: int) -> list[tuple[int, int, int]]:
        """(rows, columns, tokens) of the weight-gradient products W runs, in order: the head's MLM
        projection and matching MLP; per block the MLP's down and up, an interaction's
        cross-attention (output, key/value, query), the self-attention's output and packed Q/K/V."""
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
