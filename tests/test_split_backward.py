"""The zero-bubble split (pipeflow.runtime.backward): I then W computes exactly what one
full backward B computes, and runs each matrix product once.

For stages of every model family (a GPT middle and last stage, a BERT stage, a
Llama stage, a concurrent-branch stage with two inputs, a first stage fed token ids),
with fused and eager attention, against ``autograd.backward`` on the same forward: the
input gradients and every parameter gradient agree, and the matrix-product kernels (mm,
addmm, bmm, baddbmm, linear's decompositions) and the fused attention's kernels counted
by a TorchDispatchMode are the same in number and shape. The fused attention's backward
node is neither a matrix product nor a norm: it lies on the input path, so I runs it,
once, and W never does.
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
# matrix products by kernel family; the in-place forms accumulate into their first operand
GEMMS = {"aten.mm": 0, "aten.addmm": 1, "aten.addmm_": 1}
BATCHED = {"aten.bmm": 0, "aten.baddbmm": 1, "aten.baddbmm_": 1}
# the fused attention's kernels (CPU; CUDA's flash, memory-efficient and cuDNN ones)
FUSED = {f"aten._scaled_dot_product_{k}" for k in ("flash_attention_for_cpu", "flash_attention",
                                                     "efficient_attention", "cudnn_attention")}
FUSED |= {f"{k}_backward" for k in FUSED}


class MatmulCount(TorchDispatchMode):
    """Counts each matrix-product kernel by (family, the product's sizes m, k, n as a
    sorted triple): B and I + W may orient a weight gradient's product differently
    (x^T g or, transposed, g^T x) and may accumulate it in place, but each product
    must be computed, once, in one form or the other."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        for family, table in (("gemm", GEMMS), ("bmm", BATCHED)):
            if name in table:
                a, b = args[table[name]], args[table[name] + 1]
                batch = a.shape[:-2]
                self.seen[(family, tuple(batch), tuple(sorted((a.shape[-2], a.shape[-1], b.shape[-1]))))] += 1
        if name in FUSED:
            self.seen[("attention", name, tuple(args[0].shape))] += 1
        assert name not in {"aten.matmul", "aten.linear"}, "composite ops decompose before dispatch"
        return func(*args, **(kwargs or {}))


def _case(name: str):
    """(module, make inputs -> (leaves, output, its gradient or None))."""
    torch.manual_seed(0)
    if name in ("gpt_middle", "gpt_middle_eager"):
        module = build_stage(dict(GPT, attention="eager" if name.endswith("eager") else "sdpa"), [1, 2, 1], 1, seed=0)

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
    elif name in ("llama_middle", "llama_middle_eager"):
        from omegaconf import OmegaConf

        from pipeflow.config import compose, prepare_training
        from pipeflow.models import hf_causal

        cfg = compose("train", ["model=llama_tiny", "logger=none", "model.seq_len=16",
                                f"model.attention={'eager' if name.endswith('eager') else 'sdpa'}"])
        model = prepare_training(cfg).config.model
        module = hf_causal.build_stage(OmegaConf.to_container(model, resolve=True), [1, 2, 1], 1, seed=0)

        def run():
            x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            out = module(x)
            return [x], out, torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
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


CASES = ["gpt_middle", "gpt_middle_eager", "gpt_last", "gpt_first", "bert_middle", "llama_middle",
         "llama_middle_eager", "cbm_cross"]


@pytest.mark.parametrize("name", CASES)
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
    with MatmulCount() as forward:
        leaves, out, g = run()
    with MatmulCount() as in_i:
        got_inputs, pending = backward_input(out, g, leaves, params)
    assert all(p.grad is None for p in params), "I must not touch the weight gradients"
    with MatmulCount() as in_w:
        backward_weight(pending, params)
    got = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    assert full.seen, "the stage's backward runs matrix products"
    assert in_i.seen + in_w.seen == full.seen, "I + W must run B's matrix products and attention kernels, each once"
    calls = sum(n for key, n in forward.seen.items() if key[0] == "attention")
    # a first stage fed token ids has no input path: its W is the whole backward
    runs, other = (in_i, in_w) if leaves else (in_w, in_i)
    fused = sum(n for key, n in runs.seen.items() if key[0] == "attention" and key[1].endswith("_backward"))
    assert (calls > 0) is ("eager" not in name), "the fused kernel, unless eager"
    assert fused == calls, "one fused attention backward per forward call, run by I"
    assert not [key for key in other.seen if key[0] == "attention"], "W runs no attention kernel"
    assert len(got_inputs) == len(want_inputs)
    for a, b in zip(got_inputs, want_inputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def _wide_mlp():
    """A gpt_tiny-sized MLP (512 rows of 128 into 512): big enough that a fused
    ``addmm_`` into ``.grad`` rounds differently from a product added afterwards."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    seeds = iter(range(100, 200))

    def run():
        x = torch.randn(4, 128, 128, generator=torch.Generator().manual_seed(next(seeds))).requires_grad_(True)
        out = module(x)
        return [x], out, torch.randn(out.shape, generator=torch.Generator().manual_seed(next(seeds)))
    return module, run


@pytest.mark.parametrize("name", ["wide_mlp", *CASES])
def test_split_accumulates_bitwise_as_autograd(name):
    """Two microbatches of I then W leave exactly (bitwise) the weight gradients two
    full backwards leave: W adds each product to ``.grad`` as autograd's accumulator
    does, so a zero-bubble schedule's losses equal 1F1B's to the last bit."""
    module, run = _wide_mlp() if name == "wide_mlp" else _case(name)
    params = [p for p in module.parameters() if p.requires_grad]
    module.zero_grad(set_to_none=True)
    for _ in range(2):
        leaves, out, g = run()
        torch.autograd.backward(out, grad_tensors=g)
    want = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    if name == "wide_mlp":
        module, run = _wide_mlp()  # the same weights and the same two microbatches again
        params = [p for p in module.parameters() if p.requires_grad]
    for _ in range(2):
        leaves, out, g = run()
        _, pending = backward_input(out, g, leaves, params)
        backward_weight(pending, params)
    got = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


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


class _Products(torch.nn.Module):
    """Weights in every position W takes by hand or leaves to autograd: x @ W (no
    transpose), W @ x (left operand), addmm with a scaled bias, a weight reused twice,
    and a weight behind a reshape (autograd's fallback)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.right = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
        self.left = torch.nn.Parameter(torch.randn(6, 6, generator=gen))
        self.bias = torch.nn.Parameter(torch.randn(8, generator=gen))
        self.flat = torch.nn.Parameter(torch.randn(64, generator=gen))

    def forward(self, x):  # x: (6, 8)
        y = torch.addmm(self.bias, x, self.right, beta=0.5, alpha=2.0)
        y = self.left @ y
        y = y @ self.right.t()
        return torch.tanh(y @ self.flat.view(8, 8)) * 2


def test_weight_gradients_by_hand_match_autograd():
    """W's hand-made GEMMs (and its fallback) give autograd's gradients, accumulating
    onto gradients already there, as a second microbatch's W does."""
    module = _Products()
    params = list(module.parameters())
    xs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    gs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    module.zero_grad(set_to_none=True)
    want_inputs = []
    for x, g in zip(xs, gs):
        x = x.clone().requires_grad_(True)
        torch.autograd.backward(module(x), grad_tensors=g)
        want_inputs.append(x.grad)
    want = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    for x, g, wi in zip(xs, gs, want_inputs):
        x = x.clone().requires_grad_(True)
        got_inputs, pending = backward_input(module(x), g, [x], params)
        torch.testing.assert_close(got_inputs[0], wi)
        backward_weight(pending, params)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)


@pytest.mark.parametrize("name", ["gpt_middle", "gpt_last", "cbm_cross"])
def test_input_pass_frees_the_graph_when_w_holds_what_it_needs(name):
    """Where every boundary node is a matrix product W does by hand, I frees the graph as
    a full backward does (W keeps only each product's operand and output gradient): a
    second backward through it fails, and W still gives autograd's gradients. The
    cross-attention's projections take pieces of a packed weight and bias (split by
    query and key/value), and the query's bias is added apart from its product: W does
    those by hand too (they kept the whole graph until W before)."""
    module, run = _case(name)
    params = list(module.parameters())
    leaves, out, g = run()
    torch.autograd.backward(out, grad_tensors=g)
    want = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    leaves, out, g = run()
    _, pending = backward_input(out, g, leaves, params)
    assert pending.planned and not pending.roots
    with pytest.raises(RuntimeError, match="second time|freed"):
        torch.autograd.backward(out, grad_tensors=g)
    module.zero_grad(set_to_none=True)
    backward_weight(pending, params)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)


def test_a_weight_behind_two_transposes_is_done_by_hand():
    """A tensor-parallel piece of GPT-2's Conv1D weight ([in, out], transposed for
    ``F.linear``, which transposes it again): the two transposes cancel, W does the
    products by hand and I frees the graph (it kept every GPT zero-bubble last stage's
    graph whole until W under tensor parallelism before)."""
    import torch.nn.functional as F

    class Pieces(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.column = torch.nn.Parameter(torch.randn(8, 12, generator=g))  # [in, out]
            self.column_bias = torch.nn.Parameter(torch.randn(12, generator=g))
            self.row = torch.nn.Parameter(torch.randn(12, 8, generator=g))

        def forward(self, x):
            h = torch.tanh(F.linear(x, self.column.t(), self.column_bias))
            return F.linear(h, self.row.t())  # (row-parallel: no bias before the sum)

    module = Pieces()
    params = list(module.parameters())
    x0, g = torch.randn(6, 8), torch.randn(6, 8)
    x = x0.clone().requires_grad_(True)
    torch.autograd.backward(module(x), grad_tensors=g)
    want = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    out = module(x)
    got, pending = backward_input(out, g, [x], params)
    assert pending.planned and not pending.roots
    with pytest.raises(RuntimeError, match="second time|freed"):
        torch.autograd.backward(out, grad_tensors=g)
    backward_weight(pending, params)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)


def test_input_pass_keeps_nothing_of_the_stage_input_for_w():
    """What W holds after I (each product's operand, detached, and its output gradient)
    does not reach the stage's input: the input is freed with I, not with W (an operand
    kept with its autograd history held the input's accumulator, which holds the input)."""
    import gc
    import weakref

    module, run = _case("gpt_middle")
    params = list(module.parameters())
    leaves, out, g = run()
    alive = [weakref.ref(x) for x in leaves]
    _, pending = backward_input(out, g, leaves, params)
    del leaves, out, g, _
    gc.collect()
    assert pending.planned and all(r() is None for r in alive)
    backward_weight(pending, params)
    assert all(p.grad is not None for p in params)


def test_input_pass_keeps_the_graph_for_autograds_fallback():
    """A weight W cannot take by hand (behind a reshape) keeps the graph for W's autograd."""
    module = _Products()
    params = list(module.parameters())
    x = torch.randn(6, 8).requires_grad_(True)
    out = module(x)
    _, pending = backward_input(out, torch.ones_like(out), [x], params)
    assert pending.roots and pending.planned
    backward_weight(pending, params)
    assert all(p.grad is not None for p in params)


def test_free_graph_false_keeps_the_graph_until_w():
    """The comparison bench_split makes: with free_graph=False, I leaves the graph whole."""
    module, run = _case("gpt_last")
    params = list(module.parameters())
    leaves, out, g = run()
    grads, pending = backward_input(out, g, leaves, params, free_graph=False)
    again = torch.autograd.grad(out, leaves, grad_outputs=g, retain_graph=True)  # the graph is still there
    assert all(torch.equal(a, b) for a, b in zip(again, grads))
    backward_weight(pending, params)
    assert all(p.grad is not None for p in params)
