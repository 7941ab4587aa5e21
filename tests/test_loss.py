"""The chunked cross-entropy (pipeflow.models.loss): torch's loss and gradients, without
an fp32 copy of the logits; what it keeps and what its backward holds are the memory
model's, byte for byte."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeflow.models.loss import chunk_rows, cross_entropy_sum
from pipeflow.planning.layer_operators import head_forward
from pipeflow.planning.operators import Loss, Shape
from pipeflow.planning.saved_tensors import saved_bytes
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.planning.loss_memory import loss_backward_bytes, loss_forward_bytes

VOCAB = 50257  # GPT-2's: 83 rows a chunk
PADDED = 50304  # model.vocab_multiple=64: the head's width, of which the loss scores VOCAB
ROWS = 200  # three chunks, the last one short
WIDTHS = pytest.mark.parametrize("width", [VOCAB, PADDED], ids=["unpadded", "padded"])


def _logits(dtype, width=VOCAB):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(ROWS, width, generator=gen)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    targets[::7] = -100  # positions that are not scored (BERT's MLM)
    return logits, targets


@WIDTHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_chunked_loss_is_torchs_cross_entropy(dtype, width):
    """Over three chunks, at fp32 and bf16 logits, with ignored positions: the summed loss
    and the logits' gradient are torch's on the fp32 logits (to rounding: the softmax's
    terms are summed in another order). A padded head's logits: torch's loss over the
    words' columns, and the padding's columns (however large) get a zero gradient."""
    assert ROWS > 2 * chunk_rows(VOCAB)
    logits, targets = _logits(dtype, width)
    with torch.no_grad():
        logits[:, VOCAB:] = 1e4  # (read, they would swamp every row's softmax)
    grad = torch.tensor(0.25)
    got = cross_entropy_sum(logits, targets, vocab=VOCAB)
    got.backward(grad)
    mine, logits.grad = logits.grad, None
    want = F.cross_entropy(logits[:, :VOCAB].float(), targets, reduction="sum")
    want.backward(grad)
    assert got.dtype == torch.float32 and mine.dtype == dtype and mine.shape == (ROWS, width)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    scale = float(logits.grad.float().abs().max())
    torch.testing.assert_close(mine.float(), logits.grad.float(), rtol=0, atol=(1e-5 if dtype == torch.float32
                                                                                 else 1e-2) * scale)
    assert not mine[::7].any()  # an ignored position's logits get no gradient
    assert not mine[:, VOCAB:].any()


def test_the_loss_refuses_more_words_than_logits():
    logits, targets = _logits(torch.float32)
    with pytest.raises(ValueError, match="scores 50258 words of 50257 logits a token: need 1 to 50257"):
        cross_entropy_sum(logits, targets, vocab=VOCAB + 1)


@WIDTHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_loss_keeps_and_holds_what_the_memory_model_says(dtype, width):
    """What the loss saves for its backward (the logits as they are, a log-sum-exp a row,
    the targets) is the operator list's Loss; its forward's most beside them is
    loss_forward_bytes (one fp32 chunk and a few columns), and its backward's is
    loss_backward_bytes: the logits' gradient, one fp32 chunk and the targets' two
    per-token tensors. (At bf16 torch's loss on logits.float() kept 4 bytes a logit and
    held 8 in its backward: 2 and 2 plus a chunk now.)"""
    from pipeflow.topology.kernel_scratch import most_live, profile_allocations

    logits, targets = _logits(dtype, width)
    c = logits.element_size()
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), profile_allocations() as made:
        loss = cross_entropy_sum(logits, targets, vocab=VOCAB)
    # (a padded head: the spec's vocabulary is the head's width, the loss's the words')
    spec = TransformerSpec.from_config({"n_layer": 1, "n_head": 1, "n_embd": 8, "vocab_size": VOCAB,
                                        "vocab_multiple": 64 if width == PADDED else 1, "seq_len": ROWS})
    assert (spec.vocab_size, spec.scored_vocab) == (width, VOCAB)
    assert most_live(made) == loss_forward_bytes(ROWS, spec.scored_vocab) + 4 * ROWS  # (and the log-sum-exps)
    (op,) = [o for o in head_forward(Shape(spec, 1, ROWS, ROWS, c)) if isinstance(o, Loss)]
    assert sum(kept) == saved_bytes([op]) == ROWS * width * c + 4 * ROWS + 8 * ROWS
    with profile_allocations() as sizes:
        loss.backward()
    assert most_live(sizes) == pytest.approx(loss_backward_bytes(ROWS, width, c, scored=spec.scored_vocab), abs=64)


@pytest.mark.parametrize("family,table", [("gpt", "wte.weight"), ("bert", "embeddings.word_embeddings.weight")])
def test_a_padded_head_trains_as_the_unpadded_one(family, table):
    """model.vocab_multiple=64 (260 words, 320 rows): the words' rows start as the
    unpadded model's and the padding's at zero; the loss and every gradient are the
    unpadded model's (to the products' rounding), the padding rows' gradients zero, so
    they stay zero; the cost model counts the padded tables."""
    from pipeflow.models import bert, gpt
    from pipeflow.planning.transformer import total_params

    module, loss = (gpt, gpt.lm_loss) if family == "gpt" else (bert, bert.mlm_loss)
    shape = dict(name="t", family=family, n_layer=2, n_head=2, n_embd=32, vocab_size=260, n_positions=64, seq_len=16)
    models = [module.build_model({**shape, "vocab_multiple": m}, 0) for m in (1, 64)]
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randint(0, 260, (2, 16), generator=gen), torch.randint(0, 260, (2, 16), generator=gen)
    if family == "bert":
        t[:, ::3] = -100
    losses = [loss(m(x), t, 32.0, 260) for m in models]
    for value in losses:
        value.backward()
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6)
    plain, padded = (dict(m.named_parameters()) for m in models)
    assert padded[table].shape == (320, 32) and torch.equal(padded[table][:260], plain[table])
    assert not padded[table][260:].any() and not padded[table].grad[260:].any()
    for name, p in plain.items():
        torch.testing.assert_close(padded[name].grad[:p.size(0)], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    spec = TransformerSpec.from_config({**shape, "vocab_multiple": 64})
    assert total_params(spec) == sum(p.numel() for p in padded.values())
