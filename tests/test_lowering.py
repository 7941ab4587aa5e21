"""The lowering pass: every cross-device tensor dependency becomes one matched send/recv."""

import pytest

from pipeflow.schedules import Kind
from pipeflow.schedules.ir import Action
from pipeflow.schedules.lowering import Comm, lower, message_count
from pipeflow.schedules.registry import build_schedule


@pytest.mark.parametrize(
    "name,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 3, 5, 1), ("zb_h1", 4, 8, 1), ("interleaved_1f1b", 2, 4, 3), ("chimera", 4, 8, 1)]
)
def test_sends_and_receives_match(name, p, m, v):
    s = build_schedule(name, p, m, virtual_stages=v)
    lowered = lower(s)
    sends = {x.tag: (d, x) for d, items in enumerate(lowered) for x in items if isinstance(x, Comm) and x.op == "send"}
    recvs = {x.tag: (d, x) for d, items in enumerate(lowered) for x in items if isinstance(x, Comm) and x.op == "recv"}
    assert sends.keys() == recvs.keys()
    for tag, (sd, snd) in sends.items():
        rd, rcv = recvs[tag]
        assert snd.peer == rd and rcv.peer == sd and sd != rd
        assert snd._replace(op="recv", peer=0) == rcv._replace(peer=0)
    # a chain of S stages sends S-1 activations and S-1 gradients per microbatch when
    # consecutive stages sit on different devices (always true for these placements)
    assert message_count(lowered) == 2 * (s.num_stages - 1) * m


def test_positions_relative_to_compute():
    s = build_schedule("1f1b", 2, 2)
    d0, d1 = lower(s)
    # device 0: its forward is followed by the activation send; its backward preceded by the gradient recv
    i = d0.index(Action.parse("0F0"))
    assert isinstance(d0[i + 1], Comm) and d0[i + 1].op == "send" and not d0[i + 1].grad
    j = d0.index(Action.parse("0B0"))
    assert isinstance(d0[j - 1], Comm) and d0[j - 1].op == "recv" and d0[j - 1].grad
    # device 1 (the last stage) receives activations and sends gradients, nothing else
    comms = [x for x in d1 if isinstance(x, Comm)]
    assert [(c.op, c.grad) for c in comms] == [("recv", False), ("send", True)] * 2


def test_split_backward_sends_gradient_after_input_grad_not_weight_grad():
    s = build_schedule("zb_h1", 2, 2)
    d0, d1 = lower(s)
    for i, x in enumerate(d1):
        if isinstance(x, Comm) and x.op == "send":
            assert d1[i - 1].kind == Kind.I


def test_same_device_edges_send_nothing():
    # interleaved with p=1: every stage on device 0, so nothing to send
    s = build_schedule("interleaved_1f1b", 1, 3, virtual_stages=2)
    assert message_count(lower(s)) == 0
