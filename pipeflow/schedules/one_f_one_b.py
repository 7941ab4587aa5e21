"""1F1B (PipeDream-Flush / DAPPLE / Megatron): stage r runs min(p-r-1, m) warm-up forwards,
alternates one forward with one backward, then drains. At most p microbatches in flight,
GPipe's bubble (p-1)/(m+p-1)."""

from __future__ import annotations

from .common import check_basic, finish_sync, warmup_alternate_drain
from .ir import Action, Kind, Placement, Schedule, StageGraph, compute_actions
from .spec import ScheduleSpec


def one_f_one_b_order(rank: int, stages: int, microbatches: int, stage: int | None = None) -> list[Action]:
    """The 1F1B order of one device holding one stage (``stage`` defaults to ``rank``)."""
    s = rank if stage is None else stage
    forwards, backwards = (compute_actions(kind, s, range(microbatches)) for kind in (Kind.F, Kind.B))
    return warmup_alternate_drain(microbatches, stages - rank - 1, forwards.__getitem__, backwards.__getitem__)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    check_basic("1f1b", stages, microbatches)
    p, m = stages, microbatches
    orders = [one_f_one_b_order(r, p, m) for r in range(p)]
    return finish_sync("1f1b", StageGraph.chain(p), Placement.single(range(p)), orders, m)


SPEC = ScheduleSpec("1f1b", one_f_one_b, "warm up, one forward one backward, drain (PipeDream-Flush)", groupable=True)
