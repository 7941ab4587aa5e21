"""The memory contract: every term (a cost model's method returning bytes) a device's memory walk
(:mod:`pipeflow.sim.device_walk`) asks for, with its category and lifetime (:data:`TERMS`, glossary
docs/memory_terms.md), and the walk's compositions of them. A cost model prices each required term or
lists it in ``absent_terms``; :func:`price` refuses any other (:class:`MissingTerm`), never zero by
default."""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.memory_categories import CATEGORIES, MEASURED, STATE


@dataclass(frozen=True)
class Term:
    name: str  # the cost model's method
    category: str  # where the walk counts it (pipeflow.formats.memory_categories.CATEGORIES; a few span several)
    lifetime: str  # from when to when a device holds it
    args: tuple = ("stage", "segment")
    fallback: str | None = None  # a refinement: what the walk takes where a cost model does not price it
    tag: str | None = None  # the runtime's tag, where it is not the category (memory_categories.APART)

    def __post_init__(self) -> None:
        tags = (self.tag or self.category).split(", ")
        unknown = (set(self.category.split(", ")) - set(CATEGORIES)) | (set(tags) - set(MEASURED))
        if unknown:
            raise ValueError(f"memory term {self.name!r}: {', '.join(sorted(unknown))} is no memory category "
                             "(pipeflow.formats.memory_categories)")


_S, _SS = ("stage",), ("src_stage", "dst_stage", "segment")
TERMS: dict[str, Term] = {t.name: t for t in (
    Term("state_bytes", ", ".join(STATE), "the stage's model state by category (parameters and optimizer state the "
         "whole run; gradients from the first backward to the step; casts from the first forward to the step)",
         _S),
    Term("param_bytes", "gradients", "what a REDUCE all-reduces (the stage's gradients)", _S),
    Term("activation_bytes", "activations", "what a forward keeps for its backward, from F to the end of B (or I)"),
    Term("kv_gradient_bytes", "activations", "Seq1F1B: an earlier segment's key/value gradient, from the "
         "microbatch's first backward on the stage to that segment's own", tag="kv"),
    Term("forward_late_saved_bytes", "activations", "what a forward saves only after its most (out of the level "
         "at that instant)"),
    Term("forward_workspace_bytes", "temporaries", "a forward's most on top of what it keeps (a head's loss "
         "operands, a tensor group's MLP), for that instant"),
    Term("output_bytes", "outputs", "a stage's output and the copy it is sent as, from F until its backward is done"),
    Term("sent_copy_bytes", "outputs", "each further copy sent to another successor elsewhere, until proven arrived"),
    Term("local_output_bytes", "outputs", "an output whose successors are all on this device, to its own backward"),
    Term("shared_output_bytes", "outputs", "an output a successor here reads as its input, to its own backward"),
    Term("message_bytes", "inputs, outputs", "a message's receive buffer (inputs) from the action before the one that "
         "needs it, or a gradient sent back (outputs) until proven arrived", _SS),
    Term("workspace_bytes", "temporaries", "a backward's most on top of the level before its frees (the "
         "gradients it makes and frees, a rebuilt layer), for that instant"),
    Term("rebuilt_layer_bytes", "temporaries", "the layer a recomputing backward rebuilds, for that instant "
         "(where workspace_bytes is 0)"),
    Term("backward_freed_bytes", "activations", "what a backward has freed by its most (out of the level then)"),
    Term("backward_grads_made_bytes", "gradients", "the gradients a first backward into a stage has made by its most"),
    Term("input_gradient_bytes", "temporaries", "the fp32 input gradients a backward hands back, at its end"),
    Term("cast_phase_bytes", "temporaries", "a backward through an earlier forward's casts: its most at the blocks' "
         "attention"),
    Term("cast_phase_freed_bytes", "activations", "what that backward has freed by then"),
    Term("input_kept_bytes", "residuals", "what a zero-bubble I has kept for its W by its most, for that instant"),
    Term("input_freed_bytes", "activations", "what I has freed by its most"),
    Term("weight_residual_bytes", "residuals", "what I keeps for W, from I to W"),
    Term("weight_workspace_bytes", "temporaries", "a W's most on top of what I kept, for that instant"),
    Term("step_workspace_bytes", "temporaries", "an optimizer step's buffers beside the gradients, for that instant", _S),
    Term("tied_gradient_bytes", "gradients", "a tied copy's gradient (an embedding the first and last stages share), "
         "held to the STEP that applies it", _S),
    Term("held_cast_bytes", "temporaries", "16-bit cast gradients a backward through shared casts holds at its end",
         _S, fallback="state_bytes"),
    Term("held_cast_workspace_bytes", "temporaries", "that backward's working set then", fallback="workspace_bytes"),
    Term("input_workspace_bytes", "temporaries", "a zero-bubble I's most, priced apart from B's",
         fallback="workspace_bytes"),
    Term("fresh_workspace_bytes", "temporaries", "workspace_bytes of a backward into a stage with no gradients yet",
         fallback="workspace_bytes"),
    Term("fresh_backward_freed_bytes", "activations", "backward_freed_bytes of such a backward",
         fallback="backward_freed_bytes"),
    Term("fresh_weight_workspace_bytes", "temporaries", "weight_workspace_bytes of a W into a stage with no "
         "gradients yet", fallback="weight_workspace_bytes"),
)}
REQUIRED = frozenset(n for n, t in TERMS.items() if t.fallback is None)

# the walk's own compositions of the terms above (term_value composes them; a cost model
# never prices them)
COMPOSED = {
    "state": "one category of state_bytes",
    "during_backward": "a backward's working set: workspace_bytes (plus what it freed), else rebuilt_layer_bytes",
    "held_cast_gradients": "the end of a backward through shared casts: held casts, working set, input gradients",
    "during_input": "a zero-bubble I's working set: input_workspace_bytes less what it keeps, plus what it freed",
    "waiting_message_bytes": "a gradient waiting for a first stage's W at full precision: the message",
    "restored_gradient_bytes": "that gradient at 16 bits: the fp32 copy restored from the message",
    "sharded_optimizer_state": "ZeRO-1's slice of a stage's optimizer state, the tied copy's whole",
    "flat_gradients": "a replicated stage's gradients laid end to end for their all-reduce or reduce-scatter",
    "scattered_gradients": "ZeRO-2/3's gradients that go at the reduce-scatter",
    "gradient_slice": "ZeRO-2's slice of the summed gradient",
    "flat_parameters": "a fully sharded stage's fp32 parameters as a GATHER lays them end to end",
    "own_share": "a fully sharded stage's share of them",
    "parameter_shard": "a fully sharded stage's own share between gathers, the tied copy whole",
    "sharded_step_workspace": "a ZeRO-1/2 step's buffers beside the state",
    "extra_versions": "an asynchronous policy's weight versions beyond the first",
    "nothing": "no bytes: a term the layout a search prices a walk as does not hold",
}


class MissingTerm(TypeError):
    """A cost model that neither prices a memory term nor declares it absent."""


def missing_terms(cls) -> list[str]:
    """Sentences naming the terms ``cls`` neither prices nor declares absent, or does both."""
    absent = set(getattr(cls, "absent_terms", ()))
    out = [f"{n} (neither priced nor in absent_terms)" for n in sorted(REQUIRED - absent) if not hasattr(cls, n)]
    out += [f"{n} (priced and also in absent_terms)" for n in sorted(absent) if hasattr(cls, n)]
    out += [f"{n} (in absent_terms but not a memory term)" for n in sorted(absent - set(TERMS))]
    return out


def price(cost, name: str, *args) -> float:
    """The bytes of required term ``name`` from ``cost`` (0 where declared absent); :class:`MissingTerm`
    otherwise."""
    fn = getattr(cost, name, None)
    if fn is not None:
        return float(fn(*args))
    term = TERMS.get(name)
    if term is None or term.fallback is not None:
        raise MissingTerm(f"{name!r} is not a required memory term (pipeflow.sim.memory_terms.TERMS)")
    if name in getattr(cost, "absent_terms", ()):
        return 0.0
    raise MissingTerm(f"cost model {type(cost).__name__} prices no {name!r} ({term.category}: {term.lifetime}); "
                      f"implement it or list it in its absent_terms")


def refinement(cost, name: str):
    """A refinement's method on ``cost``, or None where the walk takes its fallback."""
    if TERMS[name].fallback is None:
        raise MissingTerm(f"{name!r} is a required memory term, not a refinement")
    return getattr(cost, name, None)


def _state(key, cost, value) -> float:  # ("state", stage, category)
    held = cost.state_bytes(key[1])
    if key[2] not in held:  # (a category added to STATE that this cost model's state_bytes does not price)
        raise MissingTerm(f"cost model {type(cost).__name__}'s state_bytes prices no {key[2]!r} "
                          f"(pipeflow.formats.memory_categories.STATE)")
    return float(held[key[2]])


def _during_backward(key, cost, value) -> float:  # ("during_backward", stage, segment, ...)
    # a cost model that prices the backward's working set as a whole (workspace_bytes
    # includes the rebuilt layer) or only the rebuilt layer (rebuilt_layer_bytes)
    v = value(("workspace_bytes", *key[1:]))
    if not v:
        return value(("rebuilt_layer_bytes", *key[1:3]))
    return v + value(("backward_freed_bytes", *key[1:]))  # the workspace whole; what B has freed leaves the activations


def _held_cast_gradients(key, cost, value) -> float:  # ("held_cast_gradients", stage, segment)
    # At 16 bits a step's forwards share one cast of each weight (Precision.shared_casts),
    # made by the step's first forward on the stage. The autograd engine runs the ready
    # node with the highest sequence number first, and a cast's backward is older than
    # every node of a later microbatch's graph: it waits for the end of that
    # microbatch's backward, holding the 16-bit gradient of its weight until then. So
    # near the end of such a backward, its activations freed, the stage holds every
    # cast's 16-bit gradient, the last block's working set and the input gradients
    # (fp32) it hands back.
    fn = refinement(cost, "held_cast_bytes")  # a recomputed region's rerun casts anew
    casts = float(fn(key[1])) if fn is not None else value(("state", key[1], "casts"))
    if not casts:
        return 0.0
    ws = "held_cast_workspace_bytes" if refinement(cost, "held_cast_workspace_bytes") else "workspace_bytes"
    return casts + value((ws, *key[1:])) + value(("input_gradient_bytes", *key[1:]))


def _during_input(key, cost, value) -> float:  # ("during_input", stage, segment)
    # the zero-bubble I's working set, where the cost model prices it apart from B's
    fn = refinement(cost, "input_workspace_bytes")
    if fn is None:
        return value(("during_backward", *key[1:]))
    return float(fn(*key[1:])) - value(("input_kept_bytes", *key[1:])) + value(("input_freed_bytes", *key[1:]))


def _waiting_gradient(key, cost, value) -> float:  # (name, stage, successor, segment)
    # a gradient waiting for a first stage's W: at full precision the message itself,
    # at 16 bits the fp32 copy the executor restored from it (the message let go)
    msg = value(("message_bytes", *key[1:]))
    c = getattr(cost, "dtype_bytes", 4)
    if key[0] == "restored_gradient_bytes":
        return msg * 4 / c if c < 4 else 0.0  # fp32
    return 0.0 if c < 4 else msg


def _sharded_optimizer_state(key, cost, value) -> float:  # (name, stage, replicas)
    # ZeRO-1's slice of a stage's optimizer state (pipeflow.runtime.sharded): its moments
    # of one replica's share of the parameters laid end to end; a tied copy's own stay
    # whole on every replica
    whole = value(("state", key[1], "optimizer_state"))
    tied = 2.0 * value(("tied_gradient_bytes", key[1]))
    return tied + max(0.0, whole - tied) / key[2]


def _flat_gradients(key, cost, value) -> float:  # (name, stage)
    # a replicated stage's gradients laid end to end for its all-reduce or (ZeRO-2)
    # reduce-scatter, the tied copy's apart (summed on their own); ZeRO-2's padding to
    # n shares (under n elements a group) left out
    return max(0.0, value(("state", key[1], "gradients")) - value(("tied_gradient_bytes", key[1])))


def _sharded_step_workspace(key, cost, value) -> float:  # (name, stage, replicas, level)
    # what a ZeRO-1/2 step holds beside the state (pipeflow.runtime.sharded): under ZeRO-1
    # the share's gradient gathered from the whole ones, and but for the fused kernel the
    # share's denominator (fp32; the two weight-decay groups priced as one, over by the
    # vectors' share); then the tied copy's own AdamW, as the unsharded step prices it
    tied = value(("tied_gradient_bytes", key[1]))
    flat = value(("flat_parameters", key[1]))
    shares = (key[3] == "optimizer") + (getattr(cost, "step_impl", "fused") != "fused")  # (ZeRO-3: as ZeRO-2)
    one = getattr(cost, "one_tensor_step_bytes", None)  # (a cost model without working sets: a denominator)
    return max(shares * flat / key[2], (one(tied / 4) if one else tied) if tied else 0.0)


def _flat_parameters(key, cost, value) -> float:  # (name, stage)
    # a fully sharded stage's fp32 parameters as a GATHER lays them end to end, the tied
    # copy's apart (never sharded)
    return max(0.0, value(("state", key[1], "parameters")) - value(("tied_gradient_bytes", key[1])))


def _parameter_shard(key, cost, value) -> float:  # (name, stage, replicas)
    # a fully sharded stage's own share of its fp32 parameters between gathers, the tied copy whole
    tied = value(("tied_gradient_bytes", key[1]))
    return tied + max(0.0, value(("state", key[1], "parameters")) - tied) / key[2]


# the walk's compositions (COMPOSED), each from the terms it composes: key, cost, value -> bytes
COMPOSE = {
    "state": _state,
    "during_backward": _during_backward,
    "held_cast_gradients": _held_cast_gradients,
    "during_input": _during_input,
    "waiting_message_bytes": _waiting_gradient,
    "restored_gradient_bytes": _waiting_gradient,
    "sharded_optimizer_state": _sharded_optimizer_state,
    "flat_gradients": _flat_gradients,
    "sharded_step_workspace": _sharded_step_workspace,
    # ZeRO-2/3's gradients that go at the reduce-scatter, the tied copy's apart (the flat's
    # bytes; a term of its own, so that the search can price a walk of ZeRO-2 as ZeRO-1's)
    "scattered_gradients": lambda key, cost, value: value(("flat_gradients", key[1])),
    # (name, stage, replicas): ZeRO-2's slice of the summed gradient
    "gradient_slice": lambda key, cost, value: value(("flat_gradients", key[1])) / key[2],
    "flat_parameters": _flat_parameters,
    # (name, stage, replicas): a fully sharded stage's share of its parameters laid end to end, the tied copy's apart
    "own_share": lambda key, cost, value: value(("flat_parameters", key[1])) / key[2],
    "parameter_shard": _parameter_shard,
    "nothing": lambda key, cost, value: 0.0,
}


def term_value(key: tuple, cost, per_device=None, cache: dict | None = None) -> float:
    """A term's bytes: the cost model's own (:func:`price`), a composition (:data:`COMPOSE`), a refinement
    or its fallback."""
    if cache is not None and key in cache:
        return cache[key]
    name = key[0]

    def value(k: tuple) -> float:
        return term_value(k, cost, per_device, cache)

    compose = COMPOSE.get(name)
    if name in REQUIRED and key[-1] != "fresh" and key[-1] != "own_casts":  # the cost model's own method
        v = price(cost, name, *key[1:])
    elif compose is not None:
        v = compose(key, cost, value)
    elif name == "extra_versions":  # ("extra_versions", device, stage): its versions beyond the first
        stats = per_device[key[1]] if per_device is not None and key[1] < len(per_device) else None
        versions = getattr(stats, "peak_weight_versions", 1) or 1
        v = (versions - 1) * value(("state", key[2], "parameters")) if versions > 1 else 0.0
    elif key[-1] == "own_casts":  # (..., "own_casts"): an asynchronous schedule's, whose
        # microbatches cast the weights for themselves, where the cost model prices it apart
        view = getattr(cost, "own_casts", None)
        v = term_value(key[:-1], view() if view is not None else cost, per_device)
    elif key[-1] == "fresh":  # (name, stage, segment, "fresh"): a backward into a stage with no
        # gradients yet, where the cost model prices it apart (fresh_<name>), else as any
        fn = refinement(cost, f"fresh_{name}") if f"fresh_{name}" in TERMS else None
        v = float(fn(*key[1:-1])) if fn is not None else value((name, *key[1:-1]))
    elif name in TERMS:  # a refinement asked for by name
        fn = refinement(cost, name)
        v = float(fn(*key[1:])) if fn is not None else value((TERMS[name].fallback, *key[1:]))
    else:
        raise MissingTerm(f"{name!r} is neither a memory term nor one of the walk's compositions "
                          f"(pipeflow.sim.memory_terms.TERMS, COMPOSED)")
    if cache is not None:
        cache[key] = v
    return v


# the terms of one stage (the stage at key[1]) and of a stage boundary (key[1] and key[2]):
# a priced term's by its args, a composition's named
ONE_STAGE = frozenset({n for n, t in TERMS.items() if t.args[0] == "stage"} | {
    "state", "during_backward", "during_input", "held_cast_gradients", "sharded_optimizer_state", "flat_gradients",
    "scattered_gradients", "gradient_slice", "flat_parameters", "own_share", "parameter_shard",
    "sharded_step_workspace"})
TWO_STAGES = frozenset({n for n, t in TERMS.items() if t.args[:2] == ("src_stage", "dst_stage")} | {
    "waiting_message_bytes", "restored_gradient_bytes"})


def like_stage(key: tuple, kind_of: list[int]) -> tuple:
    """The term of the first stage of each stage's kind (``kind_of[stage]``,
    :meth:`~pipeflow.planning.cost.AnalyticCost.stage_kinds`): the same bytes, valued once."""
    name = key[0]
    if name in ONE_STAGE:
        return (name, kind_of[key[1]], *key[2:])
    if name in TWO_STAGES:
        return (name, kind_of[key[1]], kind_of[key[2]], *key[3:])
    return key
