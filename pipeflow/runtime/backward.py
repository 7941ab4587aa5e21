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
  matrix products). The same call also returns the gradient arriving at each boundary
  node (its edges are asked for as inputs): exactly what the weight gradients are
  computed from.
- ``W`` computes, at each boundary node, just its weight-side outputs from that
  gradient. A matrix product (``AddmmBackward0``, ``MmBackward0``: every linear layer)
  whose weight-side edges lead straight to parameters, possibly through a transpose,
  autocast's cast or a split of a packed parameter (``nn.MultiheadAttention``'s
  cross-attention takes its query and key/value projections as pieces of one), is done
  by hand from the tensors the node saved: one GEMM per weight, added into ``.grad``
  (into its piece) as autograd adds it, and a sum per bias; so is a bias added apart
  from its product (``AddBackward0``: ``linear`` on an input it cannot flatten). Starting the autograd engine
  for each such node cost about 0.13 ms a call here, 15% of a W on a gpt_tiny stage.
  I plans these products before it runs and takes their operands (each linear layer's
  input) as it reaches each node, so where every boundary node is one, I frees the
  graph as it goes, as B does (in a recomputed block, the operands are the rebuilt
  block's: one rebuild, as in B):
  kept whole until W, the graph held every saved activation and each later kernel wrote
  to fresh memory (I + W was 1.23-1.35 x B on gpt_tiny's last stage, now 1.07-1.12).
  Any other boundary node restarts autograd there (a ``GradientEdge`` root), one node
  at a time, towards the edges into its parameter-only branches. One root per call
  matters: with several roots in one call, a root's input-side output would be
  propagated down the input path to the boundary nodes below it and counted again
  there.

So I + W runs each matrix product of B exactly once (tests count them). A stage whose
input needs no gradient (the first stage, fed token ids) has no input path: its I is
empty and its W is the whole backward. PyTorch's pipelining does the same split in
``_backward.py``; this is pipeflow's own walk of the graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class PendingWeight:
    """What W needs after I: per boundary node, its root, the gradient arriving there,
    and the edges into its parameter-only branches (or, for a stage without an input
    path, the whole backward from the output)."""

    roots: list = field(default_factory=list)  # per boundary node: (its GradientEdge roots, their gradients, branch edges)
    planned: list = field(default_factory=list)  # per matrix-product node: (its plan, the gradient of its output)
    whole: tuple | None = None  # (output, its gradient): W is the whole backward
    direct: list = field(default_factory=list)  # (parameter, gradient) that I computed (norms)
    holds: list = field(default_factory=list)  # the memory meter's handles on what this holds (until W)


# the backward nodes of the weight GEMMs: their weight gradients are W's work
MATMUL_NODES = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "BaddbmmBackward0", "MmBackward",
                          "LinearBackward0", "MatmulBackward0", "EmbeddingBackward0", "ConvolutionBackward0"})


def _walk(root, inputs: set, params: set) -> tuple[list, list]:
    """Each boundary node with the edges into its parameter-only branches, and the
    accumulators of the parameters that I computes itself (see backward_input).

    ``inputs`` and ``params`` are the accumulate-grad nodes of the input leaves and of
    the parameters. One walk down from the root lists every node's parents; the nodes
    from which the inputs (the parameters) can be reached are then those reached going
    up from them. (This runs at every I, so it is kept to plain loops over sets.)
    """
    parents: dict = {root: []}
    stack = [root]
    while stack:
        node = stack.pop()
        for kid, _ in node.next_functions:
            if kid is None:
                continue
            up = parents.get(kid)
            if up is None:
                parents[kid] = [node]
                stack.append(kid)
            else:
                up.append(node)
    to_input = _above([n for n in inputs if n in parents], parents)
    to_param = _above([n for n in params if n in parents], parents)
    out = []
    for node in parents:  # in the walk's order, so that W accumulates in the same order every time
        if node not in to_input:
            continue
        branch = [GradientEdge(k, nr) for k, nr in node.next_functions
                  if k is not None and k in to_param and k not in to_input]
        if branch:
            out.append((node, branch))
    # parameters whose gradient I computes itself: those reached only straight from
    # boundary nodes that are not matrix products (norms, scales)
    cheap = {n for n, _ in out if n.name() not in MATMUL_NODES}
    direct = [k for n, branch in out if n in cheap for k in (e.node for e in branch)
              if k in params and all(p in cheap for p in parents[k])]
    return out, list(dict.fromkeys(direct))


def _above(starts: list, parents: dict) -> set:
    """``starts`` and every node from which one of them can be reached."""
    seen = set(starts)
    stack = list(starts)
    while stack:
        for up in parents[stack.pop()]:
            if up not in seen:
                seen.add(up)
                stack.append(up)
    return seen


def accumulators(params: list[torch.Tensor]) -> frozenset:
    """The gradient-accumulator nodes of ``params``. Whoever holds this set keeps them
    alive, so autograd reuses the same nodes in every later forward and the set can be
    computed once per stage and handed to each :func:`backward_input`."""
    return frozenset(get_gradient_edge(p).node for p in params if p.requires_grad)


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, leaves: list[torch.Tensor],
                   params: list[torch.Tensor], param_nodes: frozenset | None = None,
                   free_graph: bool = True, keep=None) -> tuple[list, PendingWeight]:
    """I: the gradients of ``leaves`` (None where unused), and what W needs.

    ``grad`` is the gradient of ``out`` (None when ``out`` is the loss). Where W needs
    nothing of the graph but the operands its plans hold, I frees the graph as it goes
    (``free_graph=False`` keeps it until W, as before: ``benchmarks/bench_split.py``
    compares the two); otherwise W frees it. ``param_nodes``: ``accumulators(params)``,
    held by the caller across calls (computed here when not given). ``keep(tensor)``: a
    memory meter's count of a tensor held until W (:meth:`pipeflow.runtime.saved_bytes.SavedBytes.keep`):
    the planned products' operands, taken before the graph that saved them is freed, and
    the gradients arriving at the boundary nodes.
    """
    pending = PendingWeight()
    if out.grad_fn is None:
        return [None] * len(leaves), pending
    if not any(x.requires_grad for x in leaves):
        # no input path: W is the whole backward, from the output
        pending.whole = (out, grad)
        return [None] * len(leaves), pending
    inputs = {get_gradient_edge(x).node for x in leaves if x.requires_grad}
    boundary, direct = _walk(out.grad_fn, inputs, accumulators(params) if param_nodes is None else param_nodes)
    # A norm's weight and bias gradients are reductions, cheap beside the GEMMs that
    # make W worth deferring, and splitting a norm's backward runs a much slower kernel
    # on CPU (layer_norm_backward for the weights alone). So I takes them with the
    # input gradient, whole, and hands them to W, which accumulates them.
    direct_params = [node.variable for node in direct]
    skip = set(direct)
    boundary = [(n, b) for n, b in boundary if not all(e.node in skip for e in b)]
    # W's matrix products are planned now, their operands held by the plan; when every
    # boundary node has one, W needs nothing else of the graph and I frees it as it goes,
    # as a full backward does (a graph kept whole until W held every saved activation:
    # fresh memory for each later kernel, I + W 20% over B on gpt_tiny's last stage)
    plans = [_plan_by_hand(node, [e for e in b if e.node not in skip]) for node, b in boundary]
    # their operands are taken as I reaches each node (counted from before I frees the
    # graph that saved them: no dip)
    hooks = [node.register_prehook(functools.partial(_take_operands, plan, node, keep, pending.holds))
             for (node, _), plan in zip(boundary, plans) if plan is not None]
    retain = not free_graph or any(plan is None for plan in plans)
    # the gradients arriving at the boundary nodes come back from the same call: an
    # edge (node, i) asked for as an input yields the gradient of the node's i-th output
    edges = [[GradientEdge(node, i) for i in range(len(node._input_metadata))] for node, _ in boundary]
    try:
        got = torch.autograd.grad(out, [*leaves, *direct_params, *(e for es in edges for e in es)],
                                  grad_outputs=grad, retain_graph=retain, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    grads = got[: len(leaves)]
    at = len(leaves) + len(direct_params)
    pending.direct = [(p, g) for p, g in zip(direct_params, got[len(leaves):at]) if g is not None]
    for (node, branch), es, plan in zip(boundary, edges, plans):
        kept = [(e, _own(g)) for e, g in zip(es, got[at:at + len(es)]) if g is not None]
        at += len(es)
        if not kept:
            continue
        if plan is not None:
            pending.planned.append((plan, kept[0][1]))
        else:
            branch = [e for e in branch if e.node not in skip]
            pending.roots.append(([e for e, _ in kept], [g for _, g in kept], branch))
        if keep is not None:
            pending.holds += [keep(g) for _, g in kept]
    return list(grads), pending


def _own(g: torch.Tensor) -> torch.Tensor:
    """A gradient W keeps, in a storage of its own where it is a view of a much larger one
    (the cbm head's matching logit, one column of the head's whole output gradient:
    held as a view, the whole stayed alive until W)."""
    if g.layout == torch.strided and g.untyped_storage().nbytes() > 2 * g.numel() * g.element_size():
        return g.clone()
    return g


def backward_weight(pending: PendingWeight, params: list[torch.Tensor]) -> None:
    """W: accumulate the parameters' gradients into ``.grad`` from what I kept; frees the graph."""
    wanted = [p for p in params if p.requires_grad]
    if pending.whole is not None:
        # B itself: the stage's inputs need no gradient, so its parameters are the only
        # leaves (naming them as ``inputs`` made the engine prune the graph first, for nothing)
        out, grad = pending.whole
        torch.autograd.backward(out, grad_tensors=grad)
        return
    for param, g in pending.direct:
        param.grad = g if param.grad is None else param.grad + g
    deeper_roots, deeper_grads = [], []
    for plan, g in pending.planned:
        _run_by_hand(plan, g)
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


_SPLITS = ("SplitWithSizesBackward0", "SplitBackward0")


def _param_through(edge: GradientEdge):
    """(parameter, transposed, part) where ``edge`` leads straight to a parameter's
    accumulator, or through one transpose, or through autocast's cast of the parameter
    (``ToCopyBackward0``: the product's gradient is cast back to the parameter's dtype,
    as autograd casts it), or both, and possibly through a split of the parameter
    (``part``: (dim, start, length) of the piece; None: the whole parameter); None
    otherwise. Without the cast, every 16-bit zero-bubble stage fell back to keeping
    its whole graph from I until W; without the split, so did every stage with a
    cross-attention (``nn.MultiheadAttention`` splits its packed projection and its
    bias by query and key/value). Transposes count by their parity: a tensor-parallel
    piece of GPT-2's Conv1D weight goes through two (``weight.t()``, then ``linear``'s),
    which without it kept every GPT zero-bubble last stage's graph whole from I to W."""
    node, nr, transposed, cast, hops = edge.node, edge.output_nr, False, False, 0
    while node is not None and node.name() in ("TBackward0", "ToCopyBackward0") and hops < 4:
        hops += 1
        if node.name() == "ToCopyBackward0":
            if cast:  # (one cast at most)
                return None
            cast = True
        else:
            transposed = not transposed
        nxt = node.next_functions
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        node, nr = nxt[0]
    part = None
    if node is not None and node.name() in _SPLITS:
        dim = int(node._saved_dim)
        total = _saved_sizes(node, "_saved_self")
        if total is None:
            return None
        if node.name() == "SplitWithSizesBackward0":
            sizes = [int(n) for n in node._saved_split_sizes]
        else:
            step = int(node._saved_split_size)
            sizes = [min(step, total[dim] - i) for i in range(0, total[dim], step)]
        if nr >= len(sizes):
            return None
        part = (dim, sum(sizes[:nr]), sizes[nr])
        nxt = node.next_functions
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        node = nxt[0][0]
    param = getattr(node, "variable", None)  # an AccumulateGrad node holds its parameter
    return None if param is None else (param, transposed, part)


def _piece_shape(param: torch.Tensor, part) -> tuple:
    shape = list(param.shape)
    if part is not None:
        shape[part[0]] = part[2]
    return tuple(shape)


def _add_into(param: torch.Tensor, g: torch.Tensor, part) -> None:
    """``param.grad += g`` (on the piece ``part`` of it, where one), summed as autograd's
    accumulator sums (a split's backward fills the other pieces with zeros)."""
    if g.dtype != param.dtype:  # a 16-bit product of autocast's cast: back to the parameter's dtype
        g = g.to(param.dtype)
    if part is None:
        if param.grad is None:
            param.grad = g
        else:
            param.grad.add_(g)
        return
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    param.grad.narrow(*part).add_(g)


def _accumulate(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha, part=None) -> None:
    """``param.grad += alpha * a @ b``, summed as autograd's accumulator sums: the product
    first, then added in place, so the gradient is bitwise the one autograd gives (a
    fused ``addmm_`` rounds differently)."""
    prod = torch.mm(a, b) if alpha == 1 else torch.mm(a, b).mul_(alpha)
    _add_into(param, prod, part)


def _saved_sizes(node, attr: str) -> tuple | None:
    """The shape of a tensor ``node`` saved, read without unpacking it (a recomputed
    region's tensor would be rebuilt to be read), or None where the node did not save one."""
    sizes = getattr(node, attr + "_sym_sizes", None)
    if sizes is None:
        return None
    try:
        return tuple(int(n) for n in sizes)
    except (TypeError, RuntimeError):  # symbolic sizes: not planned by hand
        return None


def _take_operands(plan: tuple, node, keep, holds: list, grad_outputs):
    """A prehook on a planned node, run by I's engine just before the node itself: take
    the operands W needs from what the node saved, while the graph still has them (and,
    in a recomputed region, once the backward has rebuilt it: read here and by the
    node's own unpack, one rebuild). The meter counts them from here until W."""
    for item in plan[2]:
        if isinstance(item[2], str):
            # detached: the saved tensor's own history leads down to the stage's input
            # leaf, whose gradient accumulator holds it, and W needs the values alone
            # (held with its history, each I left its stage input alive until W)
            item[2] = getattr(node, item[2]).detach()
            if keep is not None:
                holds.append(keep(item[2]))


def _plan_by_hand(node, branch: list) -> tuple | None:
    """W of one matrix-product node, planned before I runs: (alpha, beta, work), where
    work lists [parameter, kind, operand, transposed] with kind ``right`` (x^T g),
    ``left`` (g w^T) or ``bias`` (a sum of g's rows). The operand is first the name of
    the node's saved tensor, checked by its shape alone; :func:`_take_operands` replaces
    it with the tensor when I reaches the node (held by the plan, so the graph itself
    need not outlive I). None where the node or its weight-side edges are not of the
    forms handled here."""
    name = node.name()
    if name == "AddBackward0":
        return _plan_bias_add(node, branch)
    if name not in ("AddmmBackward0", "MmBackward0") or len(node._input_metadata) != 1:
        return None
    if name == "AddmmBackward0":
        alpha, beta, first = node._saved_alpha, node._saved_beta, 1  # next_functions: (bias, mat1, mat2)
    else:
        alpha, beta, first = 1, 1, 0  # next_functions: (self, mat2)
    out = tuple(node._input_metadata[0].shape)  # the product's shape: g's
    if len(out) != 2:
        return None
    nexts = node.next_functions
    work = []
    for edge in branch:
        pos = next((i for i, (k, nr) in enumerate(nexts) if k is edge.node and nr == edge.output_nr), None)
        target = _param_through(edge)
        if pos is None or target is None:
            return None
        param, transposed, part = target
        piece = _piece_shape(param, part)
        if pos == first + 1:  # the right operand, mat2: its gradient is x^T g
            attr = "_saved_mat1" if name == "AddmmBackward0" else "_saved_self"
            x = _saved_sizes(node, attr)
            if x is None or len(x) != 2:
                return None
            shape = (x[1], out[1])
            work.append([param, "right", attr, transposed, part])
        elif pos == first:  # the left operand: g w^T
            w = _saved_sizes(node, "_saved_mat2")
            if w is None or len(w) != 2:
                return None
            work.append([param, "left", "_saved_mat2", transposed, part])
            shape = (out[0], w[0])
        else:  # addmm's added term, a bias broadcast along the rows
            if transposed or piece != out[1:]:
                return None
            work.append([param, "bias", None, False, part])
            continue
        # the parameter's shape (its piece's) must be the product's (transposed: its transpose's)
        dims = piece[::-1] if transposed else piece
        if dims != shape:
            return None
    return alpha, beta, work


def _plan_bias_add(node, branch: list) -> tuple | None:
    """W of an ``AddBackward0`` that adds a bias (or a piece of one) broadcast over the
    leading dimensions of the other term, a product's output (``linear`` on an input it
    cannot flatten: a matrix product, then the bias added): the bias's gradient is the
    gradient summed over those dimensions, as autograd's ``sum_to`` sums it."""
    if len(node._input_metadata) != 1 or len(branch) != 1:
        return None
    out = tuple(node._input_metadata[0].shape)
    edge = branch[0]
    pos = next((i for i, (k, nr) in enumerate(node.next_functions) if k is edge.node and nr == edge.output_nr), None)
    target = _param_through(edge)
    if pos is None or target is None or target[1] or len(out) < 2:
        return None
    param, _, part = target
    if _piece_shape(param, part) != out[-1:]:
        return None
    alpha = getattr(node, "_saved_alpha", 1) if pos == 1 else 1  # add(a, b, alpha): b's gradient is alpha g
    return 1, alpha, [[param, "bias", None, False, part]]


@torch.no_grad()
def _run_by_hand(plan: tuple, g: torch.Tensor) -> None:
    """Accumulate one planned matrix-product node's weight gradients from ``g``, the
    gradient of the node's output."""
    alpha, beta, work = plan
    for param, kind, operand, transposed, part in work:
        if kind == "bias":
            lead = tuple(range(g.dim() - 1))  # every dimension but the last, as sum_to sums them
            s = g.sum(lead) if beta == 1 else g.sum(lead).mul_(beta)
            _add_into(param, s, part)
            continue
        if kind == "right":
            a, b = (g.t(), operand) if transposed else (operand.t(), g)
        else:
            a, b = (operand, g.t()) if transposed else (g, operand.t())
        _accumulate(param, a, b, alpha, part)
