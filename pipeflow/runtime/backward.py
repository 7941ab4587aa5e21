"""The zero-bubble split of a stage's backward: I (input gradient) then W (weight gradient),
with nothing of the backward computed twice.

A stage's autograd graph, walked from its output towards its leaves, has two kinds of
node: those from which the stage's input can be reached (the *input path*: every
activation gradient, layer by layer) and those that lead only to parameters. The nodes
where the two meet are the *boundary*: a linear layer's ``AddmmBackward`` (its input
gradient is on the input path, its weight and bias gradients are not), a LayerNorm's
backward, an embedding's backward, ...

- ``I`` runs ``autograd.grad`` towards the input leaves alone. Autograd executes only the
  input path and, at a boundary node, only the outputs that path needs (the engine hands
  each node the mask of outputs that are wanted, so ``AddmmBackward`` does one of its two
  matrix products). A pre-hook on each boundary node keeps the gradient arriving at it:
  exactly what the weight gradients are computed from.
- ``W`` restarts autograd at each boundary node with that gradient (a ``GradientEdge``
  root), one boundary node at a time, towards the edges into its parameter-only
  branches: the node computes just its weight-side outputs. One root per call matters:
  with several roots in one call, a root's input-side output would be propagated down
  the input path to the boundary nodes below it and counted again there. The
  gradients on those edges go to the parameters: accumulated directly where the edge
  is a parameter's accumulator (a linear layer's weight and bias, a norm's), through
  one more autograd call where a branch has more nodes (a transposed weight, say).

So I + W runs each matrix product of B exactly once (tests count them). A stage whose
input needs no gradient (the first stage, fed token ids) has no input path: its I is
empty and its W is the whole backward. PyTorch's pipelining does the same split in
``_backward.py``; this is pipeflow's own walk of the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class PendingWeight:
    """What W needs after I: per boundary node, its root, the gradient arriving there,
    and the edges into its parameter-only branches (or, for a stage without an input
    path, the whole backward from the output)."""

    roots: list = field(default_factory=list)  # per boundary node: (its GradientEdge roots, their gradients, branch edges)
    whole: tuple | None = None  # (output, its gradient): W is the whole backward
    direct: list = field(default_factory=list)  # (parameter, gradient) that I computed (norms)


# the backward nodes of the weight GEMMs: their weight gradients are W's work
MATMUL_NODES = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "BaddbmmBackward0", "MmBackward",
                          "LinearBackward0", "MatmulBackward0", "EmbeddingBackward0", "ConvolutionBackward0"})


def _walk(root, inputs: set, params: set) -> tuple[list, list]:
    """Each boundary node with the edges into its parameter-only branches, and the
    accumulators of the parameters that I computes itself (see backward_input).

    ``inputs`` and ``params`` are the accumulate-grad nodes of the input leaves and of
    the parameters. One iterative post-order walk marks, for every node, whether the
    inputs and whether the parameters can be reached from it.
    """
    to_input: dict = {}
    to_param: dict = {}
    edges: dict = {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            kids = [k for k, _ in edges[node]]
            to_input[node] = node in inputs or any(to_input[k] for k in kids)
            to_param[node] = node in params or any(to_param[k] for k in kids)
            continue
        if node in to_input:
            continue  # reached before, by another path
        to_input[node] = False  # visiting: each node is expanded once
        edges[node] = [(k, nr) for k, nr in node.next_functions if k is not None]
        stack.append((node, True))
        stack.extend((k, False) for k, _ in edges[node] if k not in to_input)
    parents: dict = {}
    for node, kids in edges.items():
        for k, _ in kids:
            parents.setdefault(k, []).append(node)
    out = []
    for node, kids in edges.items():
        if to_input[node]:
            branch = [GradientEdge(k, nr) for k, nr in kids if to_param[k] and not to_input[k]]
            if branch:
                out.append((node, branch))
    # parameters whose gradient I computes itself: those reached only straight from
    # boundary nodes that are not matrix products (norms, scales)
    cheap = {n for n, _ in out if n.name() not in MATMUL_NODES}
    direct = [k for n, branch in out if n in cheap for k in (e.node for e in branch)
              if k in params and all(p in cheap for p in parents[k])]
    return out, list(dict.fromkeys(direct))


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, leaves: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[list, PendingWeight]:
    """I: the gradients of ``leaves`` (None where unused), and what W needs.

    ``grad`` is the gradient of ``out`` (None when ``out`` is the loss). The graph is
    kept for W; W frees it.
    """
    pending = PendingWeight()
    if out.grad_fn is None:
        return [None] * len(leaves), pending
    if not any(x.requires_grad for x in leaves):
        # no input path: W is the whole backward, from the output
        pending.whole = (out, grad)
        return [None] * len(leaves), pending
    inputs = {get_gradient_edge(x).node for x in leaves if x.requires_grad}
    pnodes = {get_gradient_edge(p).node for p in params if p.requires_grad}
    boundary, direct = _walk(out.grad_fn, inputs, pnodes)
    # A norm's weight and bias gradients are reductions, cheap beside the GEMMs that
    # make W worth deferring, and splitting a norm's backward runs a much slower kernel
    # on CPU (layer_norm_backward for the weights alone). So I takes them with the
    # input gradient, whole, and hands them to W, which accumulates them.
    direct_params = [node.variable for node in direct]
    skip = set(direct)
    boundary = [(n, b) for n, b in boundary if not all(e.node in skip for e in b)]
    captured: dict = {}
    handles = []
    for node, _ in boundary:
        def keep(grad_outputs, node=node):
            captured[node] = grad_outputs
        handles.append(node.register_prehook(keep))
    try:
        got = torch.autograd.grad(out, [*leaves, *direct_params], grad_outputs=grad, retain_graph=True,
                                  allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    grads = got[: len(leaves)]
    pending.direct = [(p, g) for p, g in zip(direct_params, got[len(leaves):]) if g is not None]
    for node, branch in boundary:
        branch = [e for e in branch if e.node not in skip]
        got = [(GradientEdge(node, i), g) for i, g in enumerate(captured.get(node, ())) if g is not None]
        if got:
            pending.roots.append(([e for e, _ in got], [g for _, g in got], branch))
    return list(grads), pending


def backward_weight(pending: PendingWeight, params: list[torch.Tensor]) -> None:
    """W: accumulate the parameters' gradients into ``.grad`` from what I kept; frees the graph."""
    wanted = [p for p in params if p.requires_grad]
    if pending.whole is not None:
        out, grad = pending.whole
        torch.autograd.backward(out, grad_tensors=grad, inputs=wanted)
        return
    for param, g in pending.direct:
        param.grad = g if param.grad is None else param.grad + g
    deeper_roots, deeper_grads = [], []
    for roots, grads, branch in pending.roots:
        # each boundary node runs once in W, so its saved tensors can go with this call
        got = torch.autograd.grad(roots, branch, grad_outputs=grads, allow_unused=True)
        for edge, g in zip(branch, got):
            if g is None:
                continue
            param = getattr(edge.node, "variable", None)  # an AccumulateGrad node holds its parameter
            if param is not None:
                param.grad = g if param.grad is None else param.grad + g
            else:
                deeper_roots.append(edge)
                deeper_grads.append(g)
    if deeper_roots:
        torch.autograd.backward(deeper_roots, grad_tensors=deeper_grads, inputs=wanted)
