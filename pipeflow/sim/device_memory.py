"""Each device's memory over a simulated step, by what holds it, and its peak.

The peak is the most bytes live at one instant: the sum over the categories at that
instant, not the sum of each category's own peak (under GPipe the last stage peaks at
the end of its forwards, before any gradient exists). The categories are the ones the
runtime's memory profile measures (``runtime.memory=profile``,
:mod:`pipeflow.runtime.memory_profile`), so the two compare term by term:

- ``parameters`` and ``optimizer_state``: every stage the device holds, for the whole run
  (AMDP's ZeRO: the optimizer state of the stages it owns; ``pipeline.shard``: a slice of
  the state, ZeRO-3's parameters a slice but from a GATHER to its FREE); ``weight_versions``:
  the extra weight copies an asynchronous policy keeps at its most;
- ``gradients``: a stage's, from its first backward (B or W) to its optimizer step (ZeRO-2/3:
  to its REDUCE, then a slice); ``casts``: at 16 bits, the 16-bit copy of the weights a
  stage's matrix products use, from its first forward to its step;
- ``activations``: what forwards keep for their backwards (a segment's keys and values
  included), as the engine walks them; ``residuals``: what a zero-bubble I keeps for its
  W, from I (what it has kept by its peak, at that instant) until W;
- ``outputs``: a stage's output, from its forward until its backward is done (at 16
  bits the copy it was sent as goes earlier), and a gradient it sent back: a send is
  held until a message from the peer, made by an action after the one that consumed the
  send, proves it arrived (the runtime's rule, :mod:`pipeflow.runtime.messages`);
- ``inputs``: a message's receive buffer, from the action before the one that needs it
  (the runtime posts receives one action ahead) until its forward starts or its
  backward is done;
- ``temporaries``: a forward's on top of what it keeps (``forward_workspace_bytes``: a
  concurrent-branch head's loss operands); a backward's gradients made and freed as it
  goes and the layer it rebuilds (``workspace_bytes``; a zero-bubble I's
  ``input_workspace_bytes`` also moves as I trades activations for what W keeps); an
  optimizer step's buffers (``step_workspace_bytes``); a replicated stage's gradients
  laid end to end for their REDUCE, to the step.

Terms come from the cost model (:meth:`~pipeflow.planning.cost.CostModel.state_bytes`,
``activation_bytes``, ``output_bytes``, ``workspace_bytes``...): a cost model without
them contributes zeros, never a guess.
"""

from __future__ import annotations

import heapq
import itertools

from ..schedules.ir import Kind, WeightPolicy
from ..schedules.lowering import action_positions, message_position
from ..schedules.versions import tied_update_plan
from ..schedules.zero import zero_owners
from .memory_terms import term_value  # noqa: F401 - the walk values its terms with it (and is imported from here)
from .memory_peaks import Peaks  # noqa: F401 - the walks as arrays (imported from here too)
from .memory_tape import _CAT, _TEMP, CATEGORIES, Tape, library_workspace  # noqa: F401 - the tape (here too)
from .memory_tape import reduces_after as reduces_of

# the measured categories (pipeflow.runtime.memory_profile) and the simulated ones they
# compare with: what the benchmark and the tests set side by side. One by one, but for
# a Seq1F1B segment's keys and values, which the profile names apart (the runtime holds
# them by hand) and the cost model counts within the activations of the segment
COMPARED = {c: ((c,), (c,)) for c in ("parameters", "weight_versions", "optimizer_state", "gradients", "casts")}
COMPARED["activations"] = (("activations", "kv"), ("activations",))
COMPARED.update({c: ((c,), (c,)) for c in ("residuals", "outputs", "inputs", "temporaries")})


def tapes(schedule, devices=None, replicas: int = 1, bare: str | None = None):
    """Each device's :class:`Tape` (of ``devices`` only, where given), walking its actions
    in its order (a device runs them one at a time, so the order is the time order; no
    timeline is needed). ``replicas``: the schedule is one replica among that many, each
    stage's copies that many times its own (data_parallel.as_replica's lists).

    ``bare`` (gradients): the schedule is fully sharded (its GATHERs and FREEs lowered),
    and its twin without them under ``pipeline.shard=bare`` is walked in the same pass:
    they differ in the parameters' terms, where receives are posted and REDUCEs walked
    (a GATHER or FREE is an action too), and the step's buffers. Returns (its tapes, the
    twin's); a device's two share one list of terms."""
    if bare is not None and (getattr(schedule, "shard", "none") != "full" or bare != "gradients"):
        raise ValueError(f"tapes(bare={bare!r}): a fully sharded schedule's twin under gradients only")
    placement, graph = schedule.placement, schedule.graph
    nseg = max(1, schedule.num_segments)
    owners = zero_owners(placement) if getattr(schedule, "zero", False) else None
    # the stages held by more than one device: their REDUCE flattens the gradients
    count = {s: replicas * len({row[s] for row in placement.table}) for s in range(len(placement.table[0]))}
    replicated = {s for s, c in count.items() if c > 1}
    shard = getattr(schedule, "shard", "none")  # pipeline.shard: what the replicas of a stage shard
    sliced = replicated if shard != "none" else set()  # ZeRO-1/2/3: each replica a slice
    PARAMS, OPT, VERS, GRADS, CASTS, ACTS, RESID, OUTS, INS = (_CAT[c] for c in (
        "parameters", "optimizer_state", "weight_versions", "gradients", "casts", "activations", "residuals", "outputs",
        "inputs"))
    F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741
    # An asynchronous executor's forwards each cast the weights anew (their versions
    # change between microbatches): each microbatch's backward holds its own casts
    asynchronous = getattr(schedule, "policy", WeightPolicy.SYNC) != WeightPolicy.SYNC
    # and a weight its first and last stages share (a tied embedding) is updated once the
    # last backward feeding it is done anywhere: until that STEP a copy holds the
    # update's gradient of it (the cost model prices it: 0 for an untied model)
    nstages = len(graph.preds)
    chain = nstages > 1 and all(len(p) <= 1 for p in graph.preds) and all(len(x) <= 1 for x in graph.succs)
    tied_plan = tied_update_plan(schedule, (0, nstages - 1)) if asynchronous and chain else {}
    # where each action runs: a message from a peer made by an action after the one that
    # consumed a send proves that send arrived (pipeflow.runtime.messages._drop_arrived)
    position = action_positions(schedule)

    out, twins = [], []
    for d in range(len(schedule.orders)) if devices is None else devices:
        order = schedule.orders[d]
        index: dict[tuple, int] = {}
        steps: list[tuple] = []
        twin: list[tuple] = []  # the bare walk (bare=...)
        apf, apb = steps.append, twin.append  # to this walk alone, to the twin alone
        if bare is None:
            ap = apf
        else:
            def ap(step):  # to both
                steps.append(step)
                twin.append(step)

        def key(*k) -> int:
            got = index.get(k)
            if got is None:
                got = index[k] = len(index)
            return got

        # per (pipe, stage) on this device: its neighbours on other devices
        away: dict[tuple, tuple] = {}

        def neighbours(pipe: int, stage: int) -> tuple:
            got = away.get((pipe, stage))
            if got is None:
                got = away[(pipe, stage)] = (
                    [t for t in graph.preds[stage] if placement.device(pipe, t) != d],
                    [t for t in graph.succs[stage] if placement.device(pipe, t) != d])
            return got

        reps = placement.stages_on(d)
        for _, s in reps:  # (full: the parameters' shard; GATHER adds the whole ones, FREE takes them)
            apf((PARAMS, key("parameter_shard", s, count[s]) if shard == "full" and s in sliced
                 else key("state", s, "parameters"), 1))
            if bare:
                apb((PARAMS, key("state", s, "parameters"), 1))
            if s in sliced:
                ap((OPT, key("sharded_optimizer_state", s, count[s]), 1))
            elif owners is None or owners[s] == d:
                ap((OPT, key("state", s, "optimizer_state"), 1))
            if asynchronous:  # (a synchronous schedule's stages hold one version each)
                ap((VERS, key("extra_versions", d, s), 1 / len(reps)))
        ap((-1, -1, 0))
        mine = [a for a in order if a.kind in (F, B, I, W, Kind.STEP, Kind.GATHER, Kind.FREE)]
        reduces_after = reduces_of(order, (F, B, I, W, Kind.STEP, Kind.GATHER, Kind.FREE))
        # the bare twin's: its list without the GATHERs and FREEs
        mine_b = [a for a in mine if a.kind != Kind.GATHER and a.kind != Kind.FREE] if bare else []
        reduces_b = reduces_of(order, (F, B, I, W, Kind.STEP)) if bare else {}
        reduced: dict[int, list] = {}  # a REDUCE's number -> its steps (walked once, placed in each walk)
        flats: list[int] = []  # a replicated stage's gradients, flattened for their all-reduce
        # a message from another device lands in a buffer posted before the action ahead
        # of the one that needs it; a gradient's buffer lives until its backward is done,
        # an activation's becomes the stage's input (an activation) when its forward starts
        def receives(actions: list) -> tuple[list, list]:  # (posted, landed) per index into actions
            posted: list[list[int]] = [[] for _ in range(len(actions) + 1)]
            landed: list[list[int]] = [[] for _ in range(len(actions) + 1)]
            for i, e in enumerate(actions):
                if e.kind == F:
                    for t in neighbours(e.pipe, e.stage)[0]:
                        k = key("message_bytes", t, e.stage, e.segment)
                        posted[max(0, i - 1)].append(k)
                        landed[i].append(k)
                elif e.kind == B or e.kind == I:
                    for t in neighbours(e.pipe, e.stage)[1]:
                        k = key("message_bytes", e.stage, t, e.segment)
                        posted[max(0, i - 1)].append(k)
                        landed[i].append(k)
            return posted, landed

        posted, landed = receives(mine)
        posted_b = receives(mine_b)[0]
        ib = -1  # the bare twin's index into mine_b
        grads_on: set = set()
        casts_on: set = set()
        tied_held: set = set()  # (rep, update) whose tied gradient waits for its STEP
        # what a rank sent, until a message proves it arrived: a forward's 16-bit copy
        # ((pipe, stage, microbatch, segment)) and a gradient sent back (("sent", pipe,
        # to, from, microbatch, segment)) -> [its term, its consumers' positions, dropped]
        copies: dict = {}
        # consumer's device -> heap of (consumer's position, order made, name, copy)
        unproven: dict[int, list] = {}
        sent_order = itertools.count()

        def hold_sent(name: tuple, term: int, consumer) -> None:
            c = copies[name] = [term, [consumer], False]
            if consumer is not None:  # (a send no one consumes is never proven)
                heapq.heappush(unproven.setdefault(consumer[0], []), (consumer[1], next(sent_order), name, c))
        plan_here = tied_plan.get(d, {})
        cast_by: dict = {}  # rep -> (microbatch, segment) of the forward that made its casts
        held_out: dict = {}
        # a stage whose successor runs on this device too keeps its output until its own
        # backward: (pipe, stage, microbatch, segment) -> the terms held for it
        held_local: dict = {}
        local_grads: dict = {}  # (pipe, stage, microbatch, segment): the gradients handed to it here
        # (pipe, stage, microbatch, segment) -> the outputs of predecessors here that it read as
        # its input at full precision, which they hold (with the copies they sent elsewhere)
        shared_in: dict = {}
        waiting: dict = {}  # (rep, microbatch, segment) -> the messages an empty I left to its W
        restored_wait: dict = {}  # and meanwhile: (its fp32 restore, [(category, the message at fp32, the message)])
        starts: list[tuple[int, str]] = []
        starts_b: list[tuple[int, str]] = []
        scattered: dict = {}  # ZeRO-2: rep -> its gradient slice's term, from its REDUCE to its STEP
        def reduce_steps(s: int, n: int) -> list:  # REDUCE n's steps (and what it leaves to the STEP)
            got = reduced.get(n)
            if got is not None:
                return got
            got = reduced[n] = []
            if s in sliced and shard != "optimizer":  # laid end to end (the tied copy's apart)
                flats.append(key("flat_gradients", s))  # for the reduce-scatter; then they
                got += [(_TEMP, flats[-1], 1), (-1, -1, 0),  # go, and this replica's slice arrives
                        (GRADS, key("scattered_gradients", s), -1)]
                for r in (r for r in reps if r[1] == s):
                    scattered[r] = key("gradient_slice", s, count[s])
                    got.append((GRADS, scattered[r], 1))
            elif s in replicated:  # a copy of the stage's gradients, flattened for the all-reduce
                flats.append(key("flat_gradients", s))
                got += [(_TEMP, flats[-1], 1), (-1, -1, 0)]  # each held to the step: the last all-reduce holds them all
            return got

        def walk_in(put, reduces, posts) -> None:  # an action's REDUCEs and posted receives, into a walk
            for s, n in reduces:
                for step in reduce_steps(s, n):
                    put(step)
            if posts:
                for k in posts:
                    put((INS, k, 1))
                put((-1, -1, 0))

        for i, e in enumerate(mine):
            starts.append((len(steps), e))  # (named as the runtime names it where a walk reports it)
            kind, rep, stage, seg = e.kind, (e.pipe, e.stage), e.stage, e.segment
            away_in, away_out = neighbours(e.pipe, stage)
            walk_in(apf, reduces_after.get(i - 1, ()), posted[i])
            if kind == Kind.GATHER or kind == Kind.FREE:  # full: the whole parameters, gathered or let go
                whole, own = key("flat_parameters", stage), key("own_share", stage, count[stage])
                apf((PARAMS, whole if kind == Kind.GATHER else own, 1))  # (while gathered the
                apf((-1, -1, 0))  # share is the flat's part)
                apf((PARAMS, own if kind == Kind.GATHER else whole, -1))
                continue
            if bare:
                ib += 1
                starts_b.append((len(twin), e))
                walk_in(apb, reduces_b.get(ib - 1, ()), posted_b[ib])
            if kind == Kind.STEP:
                for k in flats:  # the step's synchronisation copies them back and lets them go
                    ap((_TEMP, k, -1))
                flats.clear()
                # the optimizer's buffers, beside the gradients (ZeRO-1/2: of a slice)
                apf((-1, key("sharded_step_workspace", stage, count[stage], shard) if stage in sliced
                     else key("step_workspace_bytes", stage), 0))
                if bare:
                    apb((-1, key("sharded_step_workspace", stage, count[stage], bare) if stage in sliced
                         else key("step_workspace_bytes", stage), 0))
                if rep in scattered:  # ZeRO-2: what is left of its gradients, the tied copy's and the slice
                    ap((GRADS, key("state", stage, "gradients"), -1))
                    ap((GRADS, key("scattered_gradients", stage), 1))
                    ap((GRADS, scattered.pop(rep), -1))
                    grads_on.discard(rep)
                elif rep in grads_on:
                    ap((GRADS, key("state", stage, "gradients"), -1))
                    grads_on.discard(rep)
                if rep in casts_on:
                    ap((CASTS, key("state", stage, "casts"), -1))
                    casts_on.discard(rep)
                if stage in (0, nstages - 1) and plan_here:
                    applied = plan_here.get((e.pipe, stage, e.version), [])
                    tied = key("tied_gradient_bytes", stage)
                    if e.version not in applied:
                        tied_held.add((rep, e.version))
                        ap((GRADS, tied, 1))
                    for u in applied:
                        if (rep, u) in tied_held:
                            tied_held.discard((rep, u))
                            ap((GRADS, tied, -1))
                continue
            if copies and kind in (F, B, I):
                # the messages this action waits for prove the sends their makers had consumed
                if kind == F:
                    keys = [(False, t, stage, e.microbatch, e.pipe, seg) for t in away_in]
                else:
                    keys = [(True, stage, t, e.microbatch, e.pipe, seg) for t in away_out]
                makers = [message_position(position, k, consumer=False) for k in keys]
                for m in makers:
                    if m is None:
                        continue
                    # the copies whose consumer ran on the maker's device before it, in the
                    # order they were made (a heap per consumer's device, by position)
                    due, heap = [], unproven.get(m[0], ())
                    while heap and heap[0][0] < m[1]:
                        _, n, name, c = heapq.heappop(heap)
                        if copies.get(name) is c and not c[2]:
                            due.append((n, name, c))
                    for _, name, c in sorted(due):
                        c[2] = True
                        ap((OUTS, c[0], -1))
                        if name[0] == "sent":  # a gradient sent back: nothing more to hold
                            del copies[name]
            act = key("activation_bytes", stage, seg)
            if kind == F:
                for k in landed[i]:
                    ap((INS, k, -1))
                ap((ACTS, act, 1))
                for t in graph.preds[stage]:
                    # a predecessor on this device: at full precision its output is this
                    # stage's input, counted with this stage's activations; the runtime
                    # names it the predecessor's output (its forward made it), held to the
                    # predecessor's backward
                    if placement.device(e.pipe, t) != d:
                        continue
                    held = held_local.get((e.pipe, t, e.microbatch, seg))
                    k = key("shared_output_bytes", t, seg)
                    if held is not None:
                        held.append(k)
                        ap((ACTS, k, -1))
                        ap((OUTS, k, 1))
                    elif ((e.pipe, t), e.microbatch, seg) in held_out:  # held with its sent copy already
                        shared_in.setdefault((e.pipe, stage, e.microbatch, seg), []).append(k)
                        ap((ACTS, k, -1))
                if asynchronous:  # this microbatch's own casts, until its backward
                    ap((CASTS, key("state", stage, "casts"), 1))
                elif rep not in casts_on:
                    casts_on.add(rep)
                    cast_by[rep] = (e.microbatch, seg)
                    ap((CASTS, key("state", stage, "casts"), 1))
                # its most: what it keeps and holds a moment on top (a head's loss; a tensor group's MLP)
                late = key("forward_late_saved_bytes", stage, seg)
                ap((ACTS, late, -1))
                ap((-1, key("forward_workspace_bytes", stage, seg), 0))
                ap((ACTS, late, 1))
                if away_out:
                    # the output and the copy it is sent as (output_bytes), at 16 bits one
                    # copy for each successor elsewhere (the executor casts it per send),
                    # each let go once its own peer proves it arrived
                    held_out[(rep, e.microbatch, seg)] = k = key("output_bytes", stage, seg)
                    ap((OUTS, k, 1))
                    sent = key("sent_copy_bytes", stage, seg)
                    for t in away_out[1:]:
                        ap((OUTS, sent, 1))
                    ap((-1, -1, 0))
                    for t in away_out:
                        hold_sent((e.pipe, stage, e.microbatch, seg, t), sent, message_position(
                            position, (False, stage, t, e.microbatch, e.pipe, seg), consumer=True))
                elif graph.succs[stage]:  # every successor here (one elsewhere holds the output already)
                    k = key("local_output_bytes", stage, seg)
                    held_local[(e.pipe, stage, e.microbatch, seg)] = [k]
                    ap((OUTS, k, 1))
                continue
            whole = not graph.preds[stage]  # a first stage's I is empty, its W the whole backward
            if kind == I and whole:
                # (its input needs no gradient: pipeflow.runtime.backward): the gradient
                # that arrived for it waits for the W, at 16 bits as the one fp32 copy the
                # executor restored at I (of their sum, where several successors sent
                # one), a temporary, the messages let go
                waiting[(rep, e.microbatch, seg)] = landed[i]
                moved = []
                for t in graph.succs[stage]:
                    cat = INS if placement.device(e.pipe, t) != d else OUTS  # a local one: its maker's
                    k = key("message_bytes", stage, t, seg)
                    m = key("waiting_message_bytes", stage, t, seg)
                    moved.append((cat, m, k))
                    ap((cat, k, -1))
                    ap((cat, m, 1))
                if moved:
                    r = key("restored_gradient_bytes", stage, graph.succs[stage][0], seg)
                    ap((_TEMP, r, 1))
                    restored_wait[(rep, e.microbatch, seg)] = (r, moved)
                continue
            if kind == B or kind == I or whole:
                arrived = waiting.pop((rep, e.microbatch, seg), []) if kind == W else landed[i]
                r, moved = restored_wait.pop((rep, e.microbatch, seg), (None, ())) if kind == W else (None, ())
                if r is not None:
                    # back to the messages a backward's working set counts it beside (its
                    # fp32 restore is in the working set: BackwardWorkingSet)
                    ap((_TEMP, r, -1))
                for cat, m, k in moved:
                    ap((cat, m, -1))
                    ap((cat, k, 1))
                if kind == I and not whole:
                    # what I has kept by its peak (less what it has freed) is held with
                    # the activations for that instant; the rest of its working set is temporary
                    kept, freed = key("input_kept_bytes", stage, seg), key("input_freed_bytes", stage, seg)
                    ap((ACTS, freed, -1))
                    ap((RESID, kept, 1))
                    ap((-1, key("during_input", stage, seg), 0))
                    ap((RESID, kept, -1))
                    ap((ACTS, freed, 1))
                else:
                    # what B has freed by its peak leaves the activations for that instant
                    # a backward into a stage with no gradients yet has made some by its peak
                    fresh = ("fresh",) if rep not in grads_on else ()
                    # through casts an earlier forward made: their gradients wait for the
                    # casts' backward at its end (see held_cast_gradients)
                    through = rep in casts_on and cast_by.get(rep) != (e.microbatch, seg)
                    own = ("own_casts",) if asynchronous else ()  # casts of its own, each gone with its weight's backward
                    freed = key("backward_freed_bytes", stage, seg, *fresh, *own)
                    ap((ACTS, freed, -1))
                    if fresh:
                        made = key("backward_grads_made_bytes", stage, seg, *own)
                        ap((GRADS, made, 1))
                    ap((-1, key("during_backward", stage, seg, *fresh, *own), 0))
                    ap((ACTS, freed, 1))
                    if through:  # at its blocks' attention, beside the gradients it has made so far
                        cf = key("cast_phase_freed_bytes", stage, seg)
                        ap((ACTS, cf, -1))
                        ap((-1, key("cast_phase_bytes", stage, seg), 0))
                        ap((ACTS, cf, 1))
                    if fresh:
                        ap((GRADS, made, -1))
                    if through:  # and near its end, its activations gone
                        ap((ACTS, act, -1))
                        ap((-1, key("held_cast_gradients", stage, seg), 0))
                        ap((ACTS, act, 1))
                out_k = held_out.pop((rep, e.microbatch, seg), None)  # kept through its backward
                if out_k is not None:
                    ap((OUTS, out_k, -1))
                    for n, t in enumerate(away_out):
                        c = copies.pop((e.pipe, stage, e.microbatch, seg, t), None)
                        if n:  # the copies beyond output_bytes' one
                            ap((OUTS, key("sent_copy_bytes", stage, seg), -1))
                        if c is not None and c[2]:  # that copy went earlier
                            ap((OUTS, c[0], 1))
                for k in arrived:
                    ap((INS, k, -1))
                for k in local_grads.pop((e.pipe, stage, e.microbatch, seg), ()):
                    ap((OUTS, k, -1))
                for t in graph.preds[stage]:
                    # a gradient handed to a stage on this device (in the wire's dtype, as
                    # sent): held until that stage's backward is done with it
                    if placement.device(e.pipe, t) == d:
                        local_grads.setdefault((e.pipe, t, e.microbatch, seg), []).append(
                            k := key("message_bytes", t, stage, seg))
                        ap((OUTS, k, 1))
                for p in away_in:  # the gradients it sends back, until proven arrived
                    k = key("message_bytes", p, stage, seg)
                    ap((OUTS, k, 1))
                    hold_sent(("sent", e.pipe, p, stage, e.microbatch, seg), k,
                         message_position(position, (True, p, stage, e.microbatch, e.pipe, seg), consumer=True))
                # Seq1F1B (the engine's rule, sim.engine._kv_gradient): a microbatch's first
                # backward on a stage (its last segment's) allocates the key/value gradients
                # of every earlier segment; each earlier segment's backward frees its own
                if nseg > 1 and seg == nseg - 1:
                    for j in range(seg):
                        ap((ACTS, key("kv_gradient_bytes", stage, j), 1))
                elif nseg > 1:
                    ap((ACTS, key("kv_gradient_bytes", stage, seg), -1))
                ap((ACTS, act, -1))
                if asynchronous:
                    ap((CASTS, key("state", stage, "casts"), -1))
                for k in held_local.pop((e.pipe, stage, e.microbatch, seg), ()):
                    ap((OUTS, k, -1))
                for t in graph.preds[stage]:
                    # (the shared output: out of this stage's activations since its forward)
                    if (e.pipe, t, e.microbatch, seg) in held_local and placement.device(e.pipe, t) == d:
                        ap((ACTS, key("shared_output_bytes", t, seg), 1))
                for k in shared_in.pop((e.pipe, stage, e.microbatch, seg), ()):
                    ap((ACTS, k, 1))
                if kind == I:
                    ap((RESID, key("weight_residual_bytes", stage, seg), 1))
            else:  # W: at its products, what I kept for it still held
                fresh = ("fresh",) if rep not in grads_on else ()
                if fresh:
                    grads_on.add(rep)
                    ap((GRADS, key("state", stage, "gradients"), 1))
                ap((-1, key("weight_workspace_bytes", stage, seg, *fresh), 0))
                ap((RESID, key("weight_residual_bytes", stage, seg), -1))
            if (kind == B or kind == W) and rep not in grads_on:
                grads_on.add(rep)
                ap((GRADS, key("state", stage, "gradients"), 1))
            ap((-1, -1, 0))
        out.append(Tape(list(index), steps, starts))
        if bare:
            twins.append(Tape(out[-1].terms, twin, starts_b))
    return out if bare is None else (out, twins)


def device_memory(schedule, cost, per_device: list, workspace=None, actions: list | None = None) -> list[dict]:
    """Per device: ``peak_bytes``, ``at_peak`` (category -> bytes at that instant),
    ``peak_action`` (the action running then, as the runtime names it: "1I3") and
    ``category_peaks`` (each category's own most). ``per_device`` is the engine's
    :class:`DeviceStats` list (the weight versions an asynchronous policy keeps);
    ``workspace``: per device, what its math libraries keep for the whole run
    (:attr:`~pipeflow.topology.topology.Device.workspace_bytes`), a temporary at every
    instant. ``actions`` (per device, an action's name or None) adds ``at_action``: that
    action's own most and what holds it then (the benchmark reads what the simulator
    says of the action where a rank measured its peak)."""
    cache: dict = {}
    out = [t.walk(t.values(cost, per_device, cache), actions[d] if actions and d < len(actions) else None)
           for d, t in enumerate(tapes(schedule))]
    for d, mem in enumerate(out):
        held = float(workspace[d]) if workspace is not None and d < len(workspace) else 0.0
        if held:
            mem["peak_bytes"] += held
            mem["at_peak"]["temporaries"] += held
            mem["category_peaks"]["temporaries"] += held
            if "at_action" in mem:  # (its most is one of its instants: the same dict)
                at = mem["at_action"]
                at["instants"] = [(b + held, {**split, "temporaries": split["temporaries"] + held})
                                  for b, split in at["instants"]]
                at["bytes"] += held
                at["at"] = {**at["at"], "temporaries": at["at"]["temporaries"] + held}
    return out
