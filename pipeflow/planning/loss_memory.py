"""What the chunked loss (:class:`pipeflow.models.loss.ChunkedCrossEntropy`) holds beside the logits."""

from __future__ import annotations

from .operators import chunk_rows


def loss_forward_bytes(rows: int, vocab: int) -> float:
    """Bytes the loss's forward holds at its most beside the logits, over ``rows`` tokens."""
    return float(4 * min(rows, chunk_rows(vocab)) * (vocab + 6) + 9 * rows + 4)


def loss_backward_bytes(rows: int, vocab: int, dtype_bytes: int, parallel: bool = False,
                        scored: int | None = None) -> float:
    """Bytes the loss's backward holds at its most: the logits' gradient, one fp32 softmax chunk of the
    ``scored`` columns, targets; a rank's vocabulary cut (``parallel``): two fp32 rows of its logits."""
    if parallel:
        return float(2 * rows * vocab * 4)
    scored = vocab if scored is None else scored
    return float(rows * vocab * dtype_bytes + 4 * min(rows, chunk_rows(scored)) * (scored + 2) + 9 * rows)
