"""Seq1F1B (Sun et al., NAACL 2025): 1F1B over sequence segments (``seq1f1b``), and its
interleaved variant (``seq1f1b_interleaved``).

The segment, not the microbatch, is the unit scheduled: forwards segment 0 -> s-1,
backwards s-1 -> 0 (a later segment's attention reads every earlier one's keys and values;
:mod:`pipeflow.schedules.deps`). ``split`` does not change the order: it is checked and
kept in ``meta["split"]`` (:mod:`pipeflow.planning.seqsplit`). Warm-ups and bubbles:
docs/schedules.md."""

from __future__ import annotations

from .common import check_basic, finish_sync, require, warmup_alternate_drain
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec

# The strategies of pipeflow.planning.seqsplit (schedules do not import planning; a
# test keeps the two equal).
SPLITS = ("uniform", "compute")


def _check_segments(name: str, segments: int, split: str) -> None:
    require(
        isinstance(segments, int) and not isinstance(segments, bool) and segments >= 1,
        "pipeline.segments",
        segments,
        name,
        "a whole number of sequence segments per microbatch >= 1",
    )
    require(split in SPLITS, "schedule.split", split, name, f"one of: {', '.join(SPLITS)}")


def _forward_unit(u: int, s: int) -> tuple[int, int]:
    """(microbatch, segment) of the u-th forward unit: microbatch by microbatch, segments in order."""
    return u // s, u % s


def _backward_unit(u: int, s: int) -> tuple[int, int]:
    """(microbatch, segment) of the u-th backward unit: oldest microbatch first, segments reversed."""
    return u // s, s - 1 - u % s


def seq1f1b_order(rank: int, stages: int, microbatches: int, segments: int) -> list[Action]:
    """The Seq1F1B order of device ``rank`` (holding stage ``rank``)."""
    p, m, s = stages, microbatches, segments

    def fwd(u: int) -> Action:
        mb, seg = _forward_unit(u, s)
        return Action(Kind.F, rank, mb, 0, seg)

    def bwd(u: int) -> Action:
        mb, seg = _backward_unit(u, s)
        return Action(Kind.B, rank, mb, 0, seg)

    return warmup_alternate_drain(m * s, p - rank - 1 + s - 1, fwd, bwd)


def seq1f1b(stages: int, microbatches: int, segments: int, split: str = "uniform") -> Schedule:
    name = "seq1f1b"
    check_basic(name, stages, microbatches)
    _check_segments(name, segments, split)
    p, m, s = stages, microbatches, segments
    orders = [seq1f1b_order(r, p, m, s) for r in range(p)]
    return finish_sync(
        name, StageGraph.chain(p), Placement.single(range(p)), orders, m, num_segments=s, meta={"split": split}
    )


def unit_group_size(stages: int, segments: int) -> int:
    """How many units (microbatch segments) move through the chunks together in Seq1F1B-I: the
    smallest multiple of s that is at least p, so that a group holds whole microbatches."""
    return segments * -(-stages // segments)


def interleaved_groups(p: int, m: int, s: int) -> list[int]:
    """The microbatches each group holds: ``max(1, m*s // n)`` groups (n:
    :func:`unit_group_size`) sharing the m as evenly as possible, larger first (Megatron's
    groups of p when s = 1 and p divides m; torch's flexible interleaving otherwise)."""
    rounds = max(1, (m * s) // unit_group_size(p, s))
    rounds = min(rounds, m)
    return [m // rounds + (1 if g < m % rounds else 0) for g in range(rounds)]


def interleaved_units(p: int, m: int, v: int, s: int) -> tuple[list[int], list[tuple[int, int]],
                                                               list[tuple[int, int]]]:
    """The groups and the (chunk, unit) pairs a device runs forward (chunks 0..v-1) and backward
    (v-1..0), in order."""
    groups = interleaved_groups(p, m, s)
    fwd: list[tuple[int, int]] = []
    start = 0
    for size in groups:
        fwd += [(c, u) for c in range(v) for u in range(start * s, (start + size) * s)]
        start += size
    return groups, fwd, [(v - 1 - c, u) for c, u in fwd]


def interleaved_orders(p: int, m: int, v: int, s: int) -> list[list[Action]]:
    """Per-device orders of the interleaved schedule over m microbatches of s segments, moving
    through a device's v chunks in the groups of :func:`interleaved_groups`; chunk c of device
    r is stage c*p + r (s = 1, p dividing m: Megatron's interleaved 1F1B)."""
    groups, fwd_units, bwd_units = interleaved_units(p, m, v, s)
    total = len(fwd_units)  # chunk-unit pairs per device

    orders: list[list[Action]] = []
    for r in range(p):
        def fwd(k: int, r: int = r) -> Action:
            c, u = fwd_units[k]
            mb, seg = _forward_unit(u, s)
            return Action(Kind.F, c * p + r, mb, 0, seg)

        def bwd(k: int, r: int = r) -> Action:
            c, u = bwd_units[k]
            mb, seg = _backward_unit(u, s)
            return Action(Kind.B, c * p + r, mb, 0, seg)

        warmup = (v - 1) * groups[0] * s + 2 * (p - r - 1) + (s - 1)
        orders.append(warmup_alternate_drain(total, min(warmup, total), fwd, bwd))
    return orders


def seq1f1b_interleaved(
    stages: int, microbatches: int, virtual_stages: int = 2, segments: int = 1, split: str = "uniform"
) -> Schedule:
    name = "seq1f1b_interleaved"
    check_basic(name, stages, microbatches)
    _check_segments(name, segments, split)
    p, m, v, s = stages, microbatches, virtual_stages, segments
    require(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "pipeline.virtual_stages",
        v,
        name,
        "a whole number of chunks per device >= 1",
    )
    orders = interleaved_orders(p, m, v, s)
    device_of_stage = [st % p for st in range(p * v)]
    return finish_sync(
        name,
        StageGraph.chain(p * v),
        Placement.single(device_of_stage, p),
        orders,
        m,
        num_segments=s,
        meta={"virtual_stages": v, "split": split},
    )


SEQ1F1B = ScheduleSpec("seq1f1b", seq1f1b, "1F1B over sequence segments (Seq1F1B)")
SEQ1F1B_INTERLEAVED = ScheduleSpec("seq1f1b_interleaved", seq1f1b_interleaved,
                                   "Seq1F1B over v model chunks per device")
