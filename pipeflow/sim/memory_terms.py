"""The bytes of one term of a device's memory walk (:mod:`pipeflow.sim.memory`): a key
such as ``("activation_bytes", stage, segment)`` valued by the cost model, or one of
the walk's own compositions of such terms (a backward's working set, the gradients
held through shared casts, a zero-bubble I's, a first stage's waiting gradient, an
asynchronous policy's weight versions)."""

from __future__ import annotations


def term_value(key: tuple, cost, per_device=None, cache: dict | None = None) -> float:
    """A term's bytes from the cost model (a cost model without the method: 0, never a guess)."""
    if cache is not None and key in cache:
        return cache[key]
    name = key[0]
    if name in _METHODS and key[-1] != "fresh" and key[-1] != "own_casts":  # the cost model's own method
        fn = getattr(cost, name, None)
        v = float(fn(*key[1:])) if fn is not None else 0.0
    elif name == "state":  # ("state", stage, category)
        fn = getattr(cost, "state_bytes", None)
        if fn is not None:
            v = float(fn(key[1])[key[2]])
        else:  # a cost model that does not split its model state: weights, and the rest of it
            w = float(cost.param_bytes(key[1]))
            rest = max(0.0, float(getattr(cost, "model_state_bytes", lambda s: 0.0)(key[1])) - w)
            v = {"parameters": w, "optimizer_state": rest}.get(key[2], 0.0)
    elif name == "during_backward":  # ("during_backward", stage, segment)
        # a cost model that prices the backward's working set as a whole (workspace_bytes
        # includes the rebuilt layer) or only the rebuilt layer (transient_bytes)
        v = term_value(("workspace_bytes", *key[1:]), cost, per_device, cache)
        if not v:
            v = term_value(("transient_bytes", *key[1:3]), cost, per_device, cache)
        else:  # the workspace counted whole; what B has freed by then leaves the activations
            v += term_value(("backward_freed_bytes", *key[1:]), cost, per_device, cache)
    elif name == "held_cast_gradients":  # ("held_cast_gradients", stage, segment)
        # At 16 bits a step's forwards share one cast of each weight (Precision.shared_casts),
        # made by the step's first forward on the stage. The autograd engine runs the ready
        # node with the highest sequence number first, and a cast's backward is older than
        # every node of a later microbatch's graph: it waits for the end of that
        # microbatch's backward, holding the 16-bit gradient of its weight until then. So
        # near the end of such a backward, its activations freed, the stage holds every
        # cast's 16-bit gradient, the last block's working set and the input gradients
        # (fp32) it hands back.
        fn = getattr(cost, "held_cast_bytes", None)  # a recomputed region's rerun casts anew
        casts = float(fn(key[1])) if fn is not None else term_value(("state", key[1], "casts"), cost, per_device, cache)
        v = 0.0
        if casts:
            ws = "held_cast_workspace_bytes" if hasattr(cost, "held_cast_workspace_bytes") else "workspace_bytes"
            v = casts + term_value((ws, *key[1:]), cost, per_device, cache) \
                + term_value(("input_gradient_bytes", *key[1:]), cost, per_device, cache)
    elif name == "during_input":  # ("during_input", stage, segment): the zero-bubble I's
        # working set, where the cost model prices it apart from B's
        fn = getattr(cost, "input_workspace_bytes", None)
        if fn is None:
            v = term_value(("during_backward", *key[1:]), cost, per_device, cache)
        else:
            v = float(fn(*key[1:])) - term_value(("input_kept_bytes", *key[1:]), cost, per_device, cache) \
                + term_value(("input_freed_bytes", *key[1:]), cost, per_device, cache)
    elif name in ("waiting_message_bytes", "restored_gradient_bytes"):  # (name, stage, successor, segment)
        # a gradient waiting for a first stage's W: at full precision the message itself,
        # at 16 bits the fp32 copy the executor restored from it (the message let go)
        msg = term_value(("message_bytes", *key[1:]), cost, per_device, cache)
        c = getattr(cost, "dtype_bytes", 4)
        if name == "restored_gradient_bytes":
            v = msg * 4 / c if c < 4 else 0.0  # fp32
        else:
            v = 0.0 if c < 4 else msg
    elif name == "sharded_optimizer_state":  # (name, stage, replicas): ZeRO-1's slice of a stage's
        # optimizer state (pipeflow.runtime.sharded): its moments of one replica's share of
        # the parameters laid end to end; a tied copy's own stay whole on every replica
        whole = term_value(("state", key[1], "optimizer_state"), cost, per_device, cache)
        tied = 2.0 * term_value(("tied_gradient_bytes", key[1]), cost, per_device, cache)
        v = tied + max(0.0, whole - tied) / key[2]
    elif name == "flat_gradients":  # (name, stage): a replicated stage's gradients laid end to
        # end for its all-reduce or (ZeRO-2) reduce-scatter, the tied copy's apart (summed on
        # their own); ZeRO-2's padding to n shares (under n elements a group) left out
        v = max(0.0, term_value(("state", key[1], "gradients"), cost, per_device, cache)
                - term_value(("tied_gradient_bytes", key[1]), cost, per_device, cache))
    elif name == "sharded_step_workspace":  # (name, stage, replicas, level): what a ZeRO-1/2 step
        # holds beside the state (pipeflow.runtime.sharded): its share's denominator and,
        # under ZeRO-1, the share's gradient gathered from the whole ones (fp32; the two
        # weight-decay groups priced as one, over by the vectors' share); then the tied
        # copy's own AdamW, as the unsharded step prices it per parameter
        tied = term_value(("tied_gradient_bytes", key[1]), cost, per_device, cache)
        flat = term_value(("flat_parameters", key[1]), cost, per_device, cache)
        v = max((2.0 if key[3] == "optimizer" else 1.0) * flat / key[2],  # (ZeRO-3: as ZeRO-2)
                tied * (2.0 if getattr(cost, "step_per_tensor", False) else 1.0))
    elif name == "scattered_gradients":  # (name, stage): ZeRO-2/3's gradients that go at the
        # reduce-scatter, the tied copy's apart (the flat's bytes; a term of its own, so that
        # the search can price a walk of ZeRO-2 as ZeRO-1's: pipeflow.planning.search)
        v = term_value(("flat_gradients", key[1]), cost, per_device, cache)
    elif name == "gradient_slice":  # (name, stage, replicas): ZeRO-2's slice of the summed gradient
        v = term_value(("flat_gradients", key[1]), cost, per_device, cache) / key[2]
    elif name == "flat_parameters":  # (name, stage): a fully sharded stage's fp32 parameters as a
        # GATHER lays them end to end, the tied copy's apart (never sharded)
        v = max(0.0, term_value(("state", key[1], "parameters"), cost, per_device, cache)
                - term_value(("tied_gradient_bytes", key[1]), cost, per_device, cache))
    elif name == "own_share":  # (name, stage, replicas): a fully sharded stage's share of its
        # parameters laid end to end, the tied copy's apart
        v = term_value(("flat_parameters", key[1]), cost, per_device, cache) / key[2]
    elif name == "parameter_shard":  # (name, stage, replicas): a fully sharded stage's own share of
        # its fp32 parameters between gathers, the tied copy whole
        tied = term_value(("tied_gradient_bytes", key[1]), cost, per_device, cache)
        v = tied + max(0.0, term_value(("state", key[1], "parameters"), cost, per_device, cache) - tied) / key[2]
    elif name == "extra_versions":  # ("extra_versions", device, stage): its versions beyond the first
        stats = per_device[key[1]] if per_device is not None and key[1] < len(per_device) else None
        versions = getattr(stats, "peak_weight_versions", 1) or 1
        v = (versions - 1) * term_value(("state", key[2], "parameters"), cost, per_device, cache) if versions > 1 else 0.0
    elif key[-1] == "own_casts":  # (..., "own_casts"): an asynchronous schedule's, whose
        # microbatches cast the weights for themselves, where the cost model prices it apart
        view = getattr(cost, "own_casts", None)
        v = term_value(key[:-1], view() if view is not None else cost, per_device)
    elif key[-1] == "fresh":  # (name, stage, segment, "fresh"): a backward into a stage with no
        # gradients yet, where the cost model prices it apart (fresh_<name>), else as any
        fn = getattr(cost, f"fresh_{name}", None)
        v = float(fn(*key[1:-1])) if fn is not None else term_value((name, *key[1:-1]), cost, per_device, cache)
    else:
        fn = getattr(cost, name, None)
        v = float(fn(*key[1:])) if fn is not None else 0.0
    if cache is not None:
        cache[key] = v
    return v


# the terms valued by the cost model's method of that name (the last branch of term_value,
# taken first for these: most of a walk's terms); a name term_value composes itself must
# not be here
_METHODS = frozenset({
    "activation_bytes", "backward_freed_bytes", "backward_grads_made_bytes", "cast_phase_bytes",
    "cast_phase_freed_bytes", "forward_late_saved_bytes", "forward_workspace_bytes", "input_freed_bytes", "input_gradient_bytes",
    "input_kept_bytes", "kv_gradient_bytes", "local_output_bytes", "message_bytes", "output_bytes",
    "sent_copy_bytes", "shared_output_bytes", "step_workspace_bytes", "tied_gradient_bytes",
    "transient_bytes", "weight_residual_bytes", "weight_workspace_bytes", "workspace_bytes"})

# the terms of one stage (the stage at key[1]) and of a stage boundary (key[1] and key[2])
ONE_STAGE = frozenset({
    "state", "activation_bytes", "during_backward", "backward_freed_bytes", "backward_grads_made_bytes",
    "during_input", "input_kept_bytes", "input_freed_bytes", "weight_residual_bytes", "weight_workspace_bytes",
    "forward_late_saved_bytes", "forward_workspace_bytes", "output_bytes", "sent_copy_bytes", "local_output_bytes", "shared_output_bytes",
    "kv_gradient_bytes", "cast_phase_bytes", "cast_phase_freed_bytes", "held_cast_gradients",
    "step_workspace_bytes", "tied_gradient_bytes", "sharded_optimizer_state", "flat_gradients",
    "scattered_gradients", "gradient_slice", "flat_parameters", "own_share", "parameter_shard",
    "sharded_step_workspace", "workspace_bytes", "transient_bytes", "input_gradient_bytes"})
TWO_STAGES = frozenset({"message_bytes", "waiting_message_bytes", "restored_gradient_bytes"})


def like_stage(key: tuple, kind_of: list[int]) -> tuple:
    """The term of the first stage of each stage's kind (``kind_of[stage]``, a cost
    model's :meth:`stage_kinds`): the same bytes, valued once for every stage alike."""
    name = key[0]
    if name in ONE_STAGE:
        return (name, kind_of[key[1]], *key[2:])
    if name in TWO_STAGES:
        return (name, kind_of[key[1]], kind_of[key[2]], *key[3:])
    return key
