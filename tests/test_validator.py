"""The validator on hand-broken schedules: the error must name the actions at fault."""

import pytest

from pipeflow.schedules import Action, Schedule, ScheduleError, StageGraph, validate
from pipeflow.schedules.ir import Placement, parse_orders
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import dry_run


def chain_schedule(rows, m, name="hand"):
    p = len(rows)
    return Schedule(name, StageGraph.chain(p), Placement.single(range(p)), parse_orders(rows), m)


def test_good_hand_schedule_passes_and_dry_run_respects_dependencies():
    s = chain_schedule([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], 2)
    done = dry_run(validate(s))
    pos = {a: i for i, a in enumerate(done)}
    assert pos[Action.parse("0F0")] < pos[Action.parse("1F0")] < pos[Action.parse("1B0")] < pos[Action.parse("0B0")]


def test_missing_backward_is_named():
    s = chain_schedule([["0F0", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]], 2)
    with pytest.raises(ScheduleError, match="missing actions: 0B1") as e:
        validate(s)
    assert e.value.actions == [Action.parse("0B1")]


def test_missing_weight_grad_after_split_backward_is_named():
    s = chain_schedule([["0F0", "0I0"], ["1F0", "1I0", "1W0"]], 1)
    with pytest.raises(ScheduleError, match="missing actions: 0W0"):
        validate(s)


def test_backward_before_its_forward_is_named():
    s = chain_schedule([["0F0", "0B0"], ["1B0", "1F0"]], 1)
    with pytest.raises(ScheduleError) as e:
        validate(s)
    msg = str(e.value)
    assert "device 1 at 1B0" in msg and "1F0, which comes later on the same device" in msg
    assert Action.parse("1B0") in e.value.actions


def test_two_devices_waiting_on_each_other_is_named():
    # device 0 wants the gradient for microbatch 0 before sending microbatch 1's activation;
    # device 1 wants microbatch 1's activation before returning microbatch 0's gradient.
    s = chain_schedule([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]], 2)
    with pytest.raises(ScheduleError, match="deadlocks") as e:
        validate(s)
    msg = str(e.value)
    assert "device 0 at 0B0 (position 1) waits for 1B0 on device 1" in msg
    assert "device 1 at 1F1 (position 1) waits for 0F1 on device 0" in msg
    assert set(e.value.actions) == {Action.parse("0B0"), Action.parse("1F1")}


def test_duplicate_and_misplaced_actions():
    s = chain_schedule([["0F0", "0F0", "0B0"], ["1F0", "1B0"]], 1)
    with pytest.raises(ScheduleError, match="more than once: 0F0"):
        validate(s)
    s = chain_schedule([["0F0", "1F0", "0B0"], ["1B0"]], 1)
    with pytest.raises(ScheduleError, match="wrong device: 1F0 on device 0"):
        validate(s)


def test_out_of_range_actions():
    s = chain_schedule([["0F0", "0B0", "0F5"], ["1F0", "1B0"]], 1)
    with pytest.raises(ScheduleError, match="out of range"):
        validate(s)


def test_full_and_split_backward_together_rejected():
    s = chain_schedule([["0F0", "0B0", "0I0", "0W0"], ["1F0", "1B0"]], 1)
    with pytest.raises(ScheduleError, match="both a full backward and an I/W split"):
        validate(s)


def test_weight_grad_before_input_grad_is_a_deadlock():
    s = chain_schedule([["0F0", "0W0", "0I0"], ["1F0", "1I0", "1W0"]], 1)
    with pytest.raises(ScheduleError, match="0W0 .*waits for 0I0, which comes later"):
        validate(s)


def test_replicated_stage_needs_reduce_before_step():
    good = build_schedule("chimera", 2, 2)
    orders = [[a for a in o if a.kind != "R"] for o in good.orders]
    broken = Schedule(
        "chimera", good.graph, good.placement, orders, 2, pipe_of_microbatch=good.pipe_of_microbatch
    )
    with pytest.raises(ScheduleError, match="without reducing"):
        validate(broken)


def test_reduce_collective_in_inconsistent_order_deadlocks():
    # Two replicas of two stages; device 0 reduces stage 0 then waits for stage 1's
    # step, device 1 does not issue its stage-0 reduction until after stage 1's step.
    good = build_schedule("chimera", 2, 2)
    d0, d1 = (list(o) for o in good.orders)
    # move device 1's stage-0 REDUCE after a STEP that needs the other collective
    r = next(a for a in d1 if a.kind == "R" and a.stage == 0)
    d1.remove(r)
    step1 = next(a for a in d1 if a.kind == "S" and a.stage == 1)
    d1.insert(d1.index(step1) + 1, r)
    d0_r1 = next(a for a in d0 if a.kind == "R" and a.stage == 1)
    d0.remove(d0_r1)
    step0 = next(a for a in d0 if a.kind == "S" and a.stage == 0)
    d0.insert(d0.index(step0) + 1, d0_r1)
    broken = Schedule("chimera", good.graph, good.placement, [d0, d1], 2, pipe_of_microbatch=good.pipe_of_microbatch)
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(broken)
