"""The language-model loss without a whole fp32 copy of the logits: cross-entropy a chunk
of rows at a time (:func:`pipeflow.planning.operators.chunk_rows`: an fp32 chunk of at
most ``CHUNK_ELEMENTS``), keeping the logits in the compute dtype and one log-sum-exp a
row. A head padded past the vocabulary gives its extra logits a zero gradient; rows whose
target is ``ignore_index`` count nothing. The memory model prices what it holds
(docs/training.md on ``pipeflow/models/loss.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..planning.operators import chunk_rows  # (the memory model prices the same chunks)

SCOPE = "pipeflow::cross_entropy"  # the profiler's name for the loss (pipeflow.runtime.op_trace)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``logits`` [N, V] against ``targets`` [N], an fp32 scalar;
    a row's gradient is ``(softmax(row) - onehot(target)) * g``, cast to the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, vocab: int) -> Tensor:
        n = logits.size(0)
        rows = chunk_rows(vocab)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0).unsqueeze(1)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        # one fp32 chunk for every chunk, as in the backward: a row's log-sum-exp is its
        # maximum plus the log of the sum of its exponentials shifted by it
        chunk = torch.empty(min(rows, n), vocab, dtype=torch.float32, device=logits.device)
        for lo in range(0, n, rows):
            p = chunk[:min(rows, n - lo)]
            p.copy_(logits[lo:lo + rows, :vocab])
            top = p.amax(dim=1, keepdim=True)
            p.sub_(top)
            picked = p.gather(1, safe[lo:lo + rows]).squeeze(1)  # the target's shifted logit
            p.exp_()
            sums = p.sum(dim=1).log_()
            total += ((sums - picked) * valid[lo:lo + rows]).sum()
            torch.add(sums, top.squeeze(1), out=lse[lo:lo + rows])
        ctx.save_for_backward(logits, lse, targets)
        ctx.ignore_index, ctx.vocab = ignore_index, vocab
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, lse, targets = ctx.saved_tensors
        vocab = ctx.vocab
        rows = chunk_rows(vocab)
        out = torch.empty_like(logits)
        out[:, vocab:].zero_()  # (a padded head's padding logits: no loss reads them)
        valid = targets != ctx.ignore_index
        safe = torch.where(valid, targets, 0).unsqueeze(1)
        # one fp32 chunk for every chunk: the logits cast into it as it reads them (a
        # subtraction of 16-bit logits and fp32 sums made an fp32 copy before its result)
        chunk = torch.empty(min(rows, logits.size(0)), vocab, dtype=torch.float32, device=logits.device)
        for lo in range(0, logits.size(0), rows):
            p = chunk[:min(rows, logits.size(0) - lo)]
            p.copy_(logits[lo:lo + rows, :vocab])
            p.sub_(lse[lo:lo + rows].unsqueeze(1))
            p.exp_()
            p.scatter_add_(1, safe[lo:lo + rows], torch.full_like(safe[lo:lo + rows], -1, dtype=p.dtype))
            p.mul_((grad * valid[lo:lo + rows]).unsqueeze(1))
            out[lo:lo + rows, :vocab].copy_(p)
        return out, None, None, None


def cross_entropy_sum(logits: Tensor, targets: Tensor, ignore_index: int = -100, vocab: int | None = None) -> Tensor:
    """Summed fp32 cross-entropy over the last dimension of ``logits`` (``targets``: the same
    leading shape), by :class:`ChunkedCrossEntropy`, over its first ``vocab`` entries (None:
    all)."""
    width = logits.size(-1)
    vocab = width if vocab is None else vocab
    if not 0 < vocab <= width:
        raise ValueError(f"the loss scores {vocab} words of {width} logits a token: need 1 to {width}")
    with torch.profiler.record_function(SCOPE):
        return ChunkedCrossEntropy.apply(logits.reshape(-1, width), targets.reshape(-1), ignore_index, vocab)
