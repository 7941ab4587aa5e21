"""The zero-bubble split (pipeflow.runtime.backward): I then W computes exactly what one
full backward B computes, and runs each matrix product once.

For stages of every model family (a GPT middle and last stage, a BERT stage, a
concurrent-branch stage with two inputs, a first stage fed token ids), against
``autograd.backward`` on the same forward: the input gradients and every parameter
gradient agree, and the matrix-product kernels (mm, addmm, bmm, baddbmm, linear's
decompositions) counted by a TorchDispatchMode are the same in number and shape.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeflow.models import bert, cbm
from pipeflow.models.gpt import build_stage, lm_loss
from pipeflow.runtime.backward import backward_input, backward_weight

GPT = dict(n_layer=4, n_head=4, n_embd=32, vocab_size=64, n_positions=64, seq_len=16, n_inner=None)
MATMULS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear"}


class MatmulCount(TorchDispatchMode):
    """Counts each matrix-product kernel by (op, shapes of its operands)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in MATMULS:
            self.seen[(name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))] += 1
        return func(*args, **(kwargs or {}))


def _case(name: str):
    """(module, make inputs -> (leaves, output, its gradient or None))."""
    torch.manual_seed(0)
    if name == "gpt_middle":
        module = build_stage(GPT, [1, 2, 1], 1, seed=0)

        def run():
            x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            out = module(x)
            return [x], out, torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    elif name == "gpt_last":
        module = build_stage(GPT, [2, 2], 1, seed=0)

        def run():
            x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            targets = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
            return [x], lm_loss(module(x), targets, 32.0), None
    elif name == "gpt_first":
        module = build_stage(GPT, [2, 2], 0, seed=0)

        def run():
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
            out = module(ids)
            return [], out, torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    elif name == "bert_middle":
        cfg = dict(GPT, vocab_size=68, family="bert")
        module = bert.build_stage(cfg, [1, 2, 1], 1, seed=0)

        def run():
            x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            out = module(x)
            return [x], out, torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    else:  # a concurrent-branch stage that cross-attends: two inputs
        from omegaconf import OmegaConf

        from pipeflow.config import CONF_DIR

        cfg = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "cbm_tiny.yaml"))
        cfg.pop("defaults", None)
        graph, specs = cbm.cbm_stage_graph(cfg, 2, 2)
        stage = next(s for s in range(len(specs)) if len(graph.preds[s]) == 2)
        module = cbm.build_cbm_stage(cfg, specs, stage, seed=0)
        shapes = {p: cbm.message_shape(cfg, specs[p], 2) for p in graph.preds[stage]}

        def run():
            gen = torch.Generator().manual_seed(1)
            xs = {p: torch.randn(s, generator=gen).requires_grad_(True) for p, s in shapes.items()}
            out = module(xs)
            return list(xs.values()), out, torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    return module, run


@pytest.mark.parametrize("name", ["gpt_middle", "gpt_last", "gpt_first", "bert_middle", "cbm_cross"])
def test_input_then_weight_equals_full_backward(name):
    module, run = _case(name)
    params = [p for p in module.parameters() if p.requires_grad]

    # B: one full backward
    module.zero_grad(set_to_none=True)
    leaves, out, g = run()
    with MatmulCount() as full:
        torch.autograd.backward(out, grad_tensors=g)
    want_inputs = [x.grad for x in leaves]
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    # I then W on a fresh forward of the same inputs
    module.zero_grad(set_to_none=True)
    leaves, out, g = run()
    with MatmulCount() as split:
        got_inputs, pending = backward_input(out, g, leaves, params)
        assert all(p.grad is None for p in params), "I must not touch the weight gradients"
        backward_weight(pending, params)
    got = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    assert full.seen, "the stage's backward runs matrix products"
    assert split.seen == full.seen, "I + W must run B's matrix products, each once"
    assert len(got_inputs) == len(want_inputs)
    for a, b in zip(got_inputs, want_inputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_input_pass_runs_only_the_input_side():
    """I alone runs fewer matrix products than B: the weight side waits for W."""
    module, run = _case("gpt_middle")
    params = list(module.parameters())
    leaves, out, g = run()
    with MatmulCount() as full:
        torch.autograd.backward(out, grad_tensors=g)
    leaves, out, g = run()
    with MatmulCount() as first:
        _, pending = backward_input(out, g, leaves, params)
    with MatmulCount() as second:
        backward_weight(pending, params)
    assert 0 < sum(first.seen.values()) < sum(full.seen.values())
    assert first.seen + second.seen == full.seen
