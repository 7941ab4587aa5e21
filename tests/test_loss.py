"""The chunked cross-entropy (pipeflow.models.loss): torch's loss and gradients, without
an fp32 copy of the logits; what it keeps and what its backward holds are the memory
model's, byte for byte."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeflow.models.loss import chunk_rows, cross_entropy_sum
from pipeflow.planning.operators import Loss, Shape, head_forward, saved_bytes
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.planning.working_set import loss_backward_bytes, loss_forward_bytes

VOCAB = 50257  # GPT-2's: 83 rows a chunk
ROWS = 200  # three chunks, the last one short


def _logits(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(ROWS, VOCAB, generator=gen)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    targets[::7] = -100  # positions that are not scored (BERT's MLM)
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_chunked_loss_is_torchs_cross_entropy(dtype):
    """Over three chunks, at fp32 and bf16 logits, with ignored positions: the summed loss
    and the logits' gradient are torch's on the fp32 logits (to rounding: the softmax's
    terms are summed in another order)."""
    assert ROWS > 2 * chunk_rows(VOCAB)
    logits, targets = _logits(dtype)
    grad = torch.tensor(0.25)
    got = cross_entropy_sum(logits, targets)
    got.backward(grad)
    mine, logits.grad = logits.grad, None
    want = F.cross_entropy(logits.float(), targets, reduction="sum")
    want.backward(grad)
    assert got.dtype == torch.float32 and mine.dtype == dtype
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    scale = float(logits.grad.float().abs().max())
    torch.testing.assert_close(mine.float(), logits.grad.float(), rtol=0, atol=(1e-5 if dtype == torch.float32
                                                                                 else 1e-2) * scale)
    assert not mine[::7].any()  # an ignored position's logits get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_loss_keeps_and_holds_what_the_memory_model_says(dtype):
    """What the loss saves for its backward (the logits as they are, a log-sum-exp a row,
    the targets) is the operator list's Loss; its forward's most beside them is
    loss_forward_bytes (one fp32 chunk and a few columns), and its backward's is
    loss_backward_bytes: the logits' gradient, one fp32 chunk and the targets' two
    per-token tensors. (At bf16 torch's loss on logits.float() kept 4 bytes a logit and
    held 8 in its backward: 2 and 2 plus a chunk now.)"""
    from pipeflow.topology.kernel_scratch import most_live, profile_allocations

    logits, targets = _logits(dtype)
    c = logits.element_size()
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), profile_allocations() as made:
        loss = cross_entropy_sum(logits, targets)
    assert most_live(made) == loss_forward_bytes(ROWS, VOCAB) + 4 * ROWS  # (and the log-sum-exps, kept)
    spec = TransformerSpec("loss", n_layer=1, n_head=1, n_embd=8, vocab_size=VOCAB, seq_len=ROWS)
    (op,) = [o for o in head_forward(Shape(spec, 1, ROWS, ROWS, c)) if isinstance(o, Loss)]
    assert sum(kept) == saved_bytes([op]) == ROWS * VOCAB * c + 4 * ROWS + 8 * ROWS
    with profile_allocations() as sizes:
        loss.backward()
    assert most_live(sizes) == pytest.approx(loss_backward_bytes(ROWS, VOCAB, c), abs=64)
