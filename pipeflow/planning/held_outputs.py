"""A stage's output as the runtime keeps it (:mod:`pipeflow.runtime.messages`), priced for
:class:`~pipeflow.planning.cost.AnalyticCost`."""

from __future__ import annotations

from .transformer import RESIDUAL_BYTES


class HeldOutputs:
    """:class:`~pipeflow.planning.cost.AnalyticCost`'s mixin for a stage's output (reads the
    cost's shape and dtype): held until its gradient returns where it was sent, or until the
    stage's own backward where its successor runs on the same device."""

    def output_bytes(self, stage: int, segment: int) -> float:
        """Bytes of a stage's output (the stream, fp32) held until its gradient comes back and
        the backward starts; at 16 bits with the 16-bit copy it was sent as (:meth:`sent_copy_bytes`)."""
        x = self.segment_lengths[self._seg(segment)]
        per_token = RESIDUAL_BYTES + (self.dtype_bytes if self.dtype_bytes < 4 else 0)
        return float(self.microbatch_size * x * self.spec.n_embd * per_token)

    def sent_copy_bytes(self, stage: int, segment: int) -> float:
        """Of :meth:`output_bytes`, the 16-bit copy it was sent as, which goes once a later
        message from the peer proves it arrived (0 at full precision: the output itself is sent)."""
        x = self.segment_lengths[self._seg(segment)]
        return float(self.microbatch_size * x * self.spec.n_embd * self.dtype_bytes) if self.dtype_bytes < 4 else 0.0

    def local_output_bytes(self, stage: int, segment: int) -> float:
        """Bytes a stage whose successor runs on the same device (ZB-V, DualPipeV) keeps from its
        forward to its backward: at 16 bits its fp32 output (the successor restores its own copy);
        0 at full precision, where the output is the successor's input
        (:meth:`shared_output_bytes`)."""
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
