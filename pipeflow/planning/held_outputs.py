"""A stage's output as the runtime keeps it, for :class:`~pipeflow.planning.cost.AnalyticCost`
(a mixin: it reads the cost's shape and dtype): until its gradient returns where it was
sent, until the stage's own backward where its successor runs on the same device
(:mod:`pipeflow.runtime.messages`)."""

from __future__ import annotations

from .transformer import RESIDUAL_BYTES


class HeldOutputs:
    """A stage's output as the runtime keeps it, for :class:`~pipeflow.planning.cost.AnalyticCost`
    (a mixin: it reads the cost's shape and dtype): until its gradient returns where it
    was sent, until the stage's own backward where its successor runs on the same device."""

    def output_bytes(self, stage: int, segment: int) -> float:
        """A stage's output (the stream, fp32) stays with the stage until its
        gradient comes back and the backward starts; at 16 bits with the 16-bit copy it
        was sent as, which goes earlier (:meth:`sent_copy_bytes`)."""
        x = self.segment_lengths[self._seg(segment)]
        per_token = RESIDUAL_BYTES + (self.dtype_bytes if self.dtype_bytes < 4 else 0)
        return float(self.microbatch_size * x * self.spec.n_embd * per_token)

    def sent_copy_bytes(self, stage: int, segment: int) -> float:
        """Of :meth:`output_bytes`, the 16-bit copy it was sent as, which goes once a later
        message from the peer proves it arrived (0 at full precision: the output itself is sent)."""
        x = self.segment_lengths[self._seg(segment)]
        return float(self.microbatch_size * x * self.spec.n_embd * self.dtype_bytes) if self.dtype_bytes < 4 else 0.0

    def local_output_bytes(self, stage: int, segment: int) -> float:
        """A stage whose successor runs on the same device (a V-shaped placement: ZB-V,
        DualPipeV) keeps its output (fp32) from its forward to its backward; at 16 bits
        the successor restores a copy of its own from the 16-bit one it is handed, so
        the two are apart throughout. At full precision the successor's input is the
        output itself, counted with its activations (:meth:`shared_output_bytes`)."""
        return self._stream_bytes(segment) if self.dtype_bytes < 4 else 0.0

    def shared_output_bytes(self, stage: int, segment: int) -> float:
        """At full precision, a stage's output that its successor on the same device took
        as its input: the stage's alone once the successor's backward has let go of it,
        until the stage's own backward."""
        return self._stream_bytes(segment) if self.dtype_bytes >= 4 else 0.0

    def _stream_bytes(self, segment: int) -> float:
        """One microbatch's stream (fp32) over a segment: a stage's output."""
        x = self.segment_lengths[self._seg(segment)]
        return float(self.microbatch_size * x * self.spec.n_embd * RESIDUAL_BYTES)
