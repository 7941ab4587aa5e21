"""The language-model loss without a whole fp32 copy of the logits: cross-entropy a chunk
of rows at a time (every family's LM and MLM loss on one rank; a vocabulary-parallel
head has its own, :func:`pipeflow.models.tensor_parallel.parallel_cross_entropy`).

``F.cross_entropy(logits.float(), ...)`` made an fp32 copy of the logits at 16 bits, kept
an fp32 log-softmax of every logit for its backward, and in the backward held two fp32
tensors of every logit (the log-softmax's gradient and the cast's). For GPT-2's 50,257
words that is 200 KB a token each. :class:`ChunkedCrossEntropy` keeps the logits as
the head made them (in the compute dtype) and one log-sum-exp a row; its forward and
backward visit ``rows`` rows at a time (:func:`chunk_rows`: an fp32 chunk of at most
``CHUNK_ELEMENTS``, :mod:`pipeflow.planning.operators`), so beside the logits' gradient
(in the compute dtype, made once) the backward holds one fp32 chunk. The memory model
prices exactly that (:func:`pipeflow.planning.operators.head_forward`,
:func:`pipeflow.planning.working_set.loss_backward_bytes`).

A head padded past the vocabulary (``model.vocab_multiple``) hands over logits as wide
as it is; the loss reads the first ``vocab`` of each row and gives the others a zero
gradient in the one gradient tensor it makes (a slice of the logits before the loss would
make a second, the slice's backward padding the loss's gradient out).

The gradient of a row is ``(softmax(row) - onehot(target)) * g``: ``exp(row - lse)``
with the target's entry less one, in fp32, cast to the logits' dtype. Rows whose
target is ``ignore_index`` (an unmasked position of BERT's MLM) count nothing and get
a zero gradient, as with torch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..planning.operators import chunk_rows  # (the memory model prices the same chunks)

SCOPE = "pipeflow::cross_entropy"  # the profiler's name for the loss (pipeflow.runtime.op_trace)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``logits`` [N, V] against ``targets`` [N] (see the
    module's docstring); an fp32 scalar."""

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
    """Summed cross-entropy over the last dimension of ``logits`` (any leading shape,
    ``targets`` the same leading shape), in fp32, by :class:`ChunkedCrossEntropy`; over
    its first ``vocab`` entries where the head is padded past the vocabulary (the rest get
    a zero gradient), None: all of them."""
    width = logits.size(-1)
    vocab = width if vocab is None else vocab
    if not 0 < vocab <= width:
        raise ValueError(f"the loss scores {vocab} words of {width} logits a token: need 1 to {width}")
    with torch.profiler.record_function(SCOPE):
        return ChunkedCrossEntropy.apply(logits.reshape(-1, width), targets.reshape(-1), ignore_index, vocab)
