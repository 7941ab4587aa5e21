"""Lowering: derive communication from the stage graph and the placement. For every
dependency carrying a tensor between two devices, a SEND right after the producing action
and a RECV right before the consuming one, each with a tag unique within the schedule (so
two devices may exchange messages in different orders, as Chimera's directions do)."""

from __future__ import annotations

from typing import NamedTuple, Union

from .deps import DepResolver
from .ir import Action, Kind, Schedule


class Comm(NamedTuple):
    """One point-to-point message endpoint. ``grad`` False: an activation, F(src_stage) to
    F(dst_stage); True: the gradient flowing back. src/dst always name the forward edge."""

    op: str  # "send" | "recv"
    grad: bool
    src_stage: int
    dst_stage: int
    microbatch: int
    pipe: int
    segment: int
    peer: int  # the device on the other end
    tag: int

    def __str__(self) -> str:
        what = "G" if self.grad else "A"
        seg = f"s{self.segment}" if self.segment else ""
        head = f"{self.pipe}:" if self.pipe else ""
        arrow = "->" if self.op == "send" else "<-"
        return f"{self.op.upper()}[{head}{what}{self.src_stage}.{self.dst_stage}:{self.microbatch}{seg} {arrow}d{self.peer}]"

    __repr__ = __str__


Item = Union[Action, Comm]


def lower(schedule: Schedule, resolver: DepResolver | None = None) -> list[list[Item]]:
    """Per-device lists of compute actions with their sends and receives inserted."""
    res = resolver or DepResolver(schedule)
    placement = schedule.placement
    sends_after: dict[Action, list[Comm]] = {}
    recvs_before: dict[Action, list[Comm]] = {}
    tag = 0
    for dev, _pos, a in schedule.actions():
        if a.kind not in Kind.COMPUTE:
            continue
        for dep in res.deps(a):
            if not dep.carries_tensor:
                continue
            p = dep.action
            src_dev = placement.device(p.pipe, p.stage)
            if src_dev == dev:
                continue
            grad = a.kind != Kind.F
            # name the message by its forward edge (src_stage -> dst_stage)
            edge = (p.stage, a.stage) if not grad else (a.stage, p.stage)
            common = (grad, edge[0], edge[1], a.microbatch, a.pipe, a.segment)
            sends_after.setdefault(p, []).append(Comm("send", *common, dev, tag))
            recvs_before.setdefault(a, []).append(Comm("recv", *common, src_dev, tag))
            tag += 1
    out: list[list[Item]] = []
    for order in schedule.orders:
        items: list[Item] = []
        for a in order:
            items.extend(recvs_before.get(a, ()))
            items.append(a)
            items.extend(sends_after.get(a, ()))
        out.append(items)
    return out


def message_count(lowered: list[list[Item]]) -> int:
    return sum(1 for items in lowered for x in items if isinstance(x, Comm) and x.op == "send")


def order_pairs(lowered: list[list[Item]]) -> list[list[Item]]:
    """The same lists with every device's receives reordered to come, from each sender, in the
    order it sends (what NCCL, matching a pair's messages in order, needs). A receive only
    ever moves earlier, which never blocks; the sends keep their order."""
    sequence: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> tags in send order
    for dev, items in enumerate(lowered):
        for x in items:
            if isinstance(x, Comm) and x.op == "send":
                sequence.setdefault((dev, x.peer), []).append(x.tag)
    out: list[list[Item]] = []
    for dev, items in enumerate(lowered):
        recv_of = {x.tag: x for x in items if isinstance(x, Comm) and x.op == "recv"}
        done: set[int] = set()
        cursor: dict[int, int] = {}  # sender -> position in its sequence to this device
        new: list[Item] = []
        for x in items:
            if not (isinstance(x, Comm) and x.op == "recv"):
                new.append(x)
                continue
            if x.tag in done:
                continue  # posted earlier, in its sender's order
            seq = sequence[(x.peer, dev)]
            at = cursor.get(x.peer, 0)
            while True:
                tag = seq[at]
                at += 1
                if tag not in done:
                    new.append(recv_of[tag])
                    done.add(tag)
                if tag == x.tag:
                    break
            cursor[x.peer] = at
        out.append(new)
    return out


def check_pair_order(lowered: list[list[Item]]) -> None:
    """Raise ValueError naming the first pair of devices whose receiver posts its
    receives from the sender in another order than the sender sends them."""
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for dev, items in enumerate(lowered):
        for x in items:
            if isinstance(x, Comm):
                pair = (dev, x.peer) if x.op == "send" else (x.peer, dev)
                (sends if x.op == "send" else recvs).setdefault(pair, []).append(x.tag)
    for pair in sorted(set(sends) | set(recvs)):
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if s != r:
            first = next(i for i, (a, b) in enumerate(zip(s + [None], r + [None])) if a != b)
            raise ValueError(
                f"devices {pair[0]} -> {pair[1]}: message {first} is sent as tag {s[first] if first < len(s) else None}"
                f" but received as tag {r[first] if first < len(r) else None}; a transport that matches a pair's "
                f"messages in order (NCCL) would pair them wrongly (order the receives with order_pairs)"
            )


def action_positions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Each action's (device, index in that device's order)."""
    return {a: (d, i) for d, order in enumerate(schedule.orders) for i, a in enumerate(order)}


def message_position(positions: dict, key: tuple, consumer: bool) -> tuple[int, int] | None:
    """(device, index) of the action that consumes (``consumer``) or makes the message ``key`` =
    (grad, src, dst, microbatch, pipe, segment): a forward message goes from F of its edge's
    source to F of its destination, a gradient from the destination's B or I to the source's."""
    grad, src, dst, mb, pipe, seg = key
    stage = (src if consumer else dst) if grad else (dst if consumer else src)
    for kind in (Kind.B, Kind.I) if grad else (Kind.F,):
        found = positions.get((kind, stage, mb, pipe, seg, -1))  # (an Action is this tuple: no need to build one)
        if found is not None:
            return found
    return None
