"""The zero-bubble split of a stage's backward: I (input gradient) then W (weight gradient),
each matrix product of B run once. I runs ``autograd.grad`` along the input path alone,
also returning the gradient arriving at each boundary node; W computes those nodes'
weight-side outputs, a matrix product by hand from the operands I took, any other node
by autograd from there (docs/runtime.md, "The zero-bubble split")."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class PendingWeight:
    """What W needs after I: per boundary node, its root, the gradient arriving there and the
    edges into its parameter-only branches (or the whole backward, where no input path)."""

    roots: list = field(default_factory=list)  # per boundary node: (its GradientEdge roots, their gradients, branch edges)
    planned: list = field(default_factory=list)  # per matrix-product node: (its plan, the gradient of its output)
    whole: tuple | None = None  # (output, its gradient): W is the whole backward
    direct: list = field(default_factory=list)  # (parameter, gradient) that I computed (norms)
    holds: list = field(default_factory=list)  # the memory meter's handles on what this holds (until W)


# the backward nodes of the weight GEMMs: their weight gradients are W's work
MATMUL_NODES = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "BaddbmmBackward0", "MmBackward",
                          "LinearBackward0", "MatmulBackward0", "EmbeddingBackward0", "ConvolutionBackward0"})


def _walk(root, inputs: set, params: set) -> tuple[list, list]:
    """Each boundary node with the edges into its parameter-only branches, and the accumulators
    of the parameters that I computes itself. ``inputs``, ``params``: the accumulate-grad
    nodes of the input leaves and of the parameters. Runs at every I: plain loops over sets."""
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
    """The gradient-accumulator nodes of ``params``; held, they stay the same in every later
    forward, so the set is computed once per stage for :func:`backward_input`."""
    return frozenset(get_gradient_edge(p).node for p in params if p.requires_grad)


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, leaves: list[torch.Tensor],
                   params: list[torch.Tensor], param_nodes: frozenset | None = None,
                   free_graph: bool = True, keep=None) -> tuple[list, PendingWeight]:
    """I: the gradients of ``leaves`` (None where unused), and the :class:`PendingWeight` for W.
    ``grad``: the gradient of ``out`` (None when ``out`` is the loss). ``free_graph=False``
    keeps the graph until W even where W's plans need none of it. ``param_nodes``:
    :func:`accumulators` of ``params`` (computed when None). ``keep(tensor)`` counts what is
    held until W (:meth:`pipeflow.runtime.saved_bytes.SavedBytes.keep`)."""
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
    """A gradient W keeps, copied into its own storage where it is a view of a much larger one
    (else the whole, e.g. the cbm head's output gradient, stays alive until W)."""
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
    """(parameter, transposed, part) where ``edge`` leads to a parameter's accumulator directly
    or through transposes (counted by parity), autocast's cast (``ToCopyBackward0``) and a
    split of a packed parameter (``part``: (dim, start, length); None: all of it); None
    otherwise, and W falls back to autograd for that node."""
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
    accumulator sums."""
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
    """``param.grad += alpha * a @ b``: the product, then added in place, bitwise autograd's
    gradient (a fused ``addmm_`` rounds differently)."""
    prod = torch.mm(a, b) if alpha == 1 else torch.mm(a, b).mul_(alpha)
    _add_into(param, prod, part)


def _saved_sizes(node, attr: str) -> tuple | None:
    """The shape of a tensor ``node`` saved, read without unpacking it (which would rebuild a
    recomputed region's tensor); None where the node saved none."""
    sizes = getattr(node, attr + "_sym_sizes", None)
    if sizes is None:
        return None
    try:
        return tuple(int(n) for n in sizes)
    except (TypeError, RuntimeError):  # symbolic sizes: not planned by hand
        return None


def _take_operands(plan: tuple, node, keep, holds: list, grad_outputs):
    """Prehook on a planned node, run by I's engine just before it: take the operands W needs
    from what the node saved (in a recomputed region, after its one rebuild); ``keep``
    counts them from here until W."""
    for item in plan[2]:
        if isinstance(item[2], str):
            # detached: the saved tensor's own history leads down to the stage's input
            # leaf, whose gradient accumulator holds it, and W needs the values alone
            # (held with its history, each I left its stage input alive until W)
            item[2] = getattr(node, item[2]).detach()
            if keep is not None:
                holds.append(keep(item[2]))


def _plan_by_hand(node, branch: list) -> tuple | None:
    """W of one matrix-product node, planned before I: (alpha, beta, work), ``work`` listing
    [parameter, kind, operand, transposed] with kind ``right`` (x^T g), ``left`` (g w^T) or
    ``bias`` (g's rows summed). The operand is a saved tensor's name until
    :func:`_take_operands` puts the tensor there. None where the node is of another form."""
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
    """W of an ``AddBackward0`` adding a bias (or a piece of one) broadcast over a product's
    output (``linear`` on an input it cannot flatten): the bias's gradient is the gradient
    summed over the broadcast dimensions, as autograd's ``sum_to`` sums it."""
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
