"""Name -> generator. The one place the config's ``schedule.name`` is resolved.

``build_schedule`` checks sizes (errors name the config key and the allowed values),
generates, and validates, so nothing downstream ever sees a malformed schedule.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .common import ScheduleConfigError
from .grouping import place_graph
from .ir import Schedule, StageGraph
from .validate import validate


def _gpipe(stages, microbatches, virtual_stages, segments, **kw):
    from .gpipe import gpipe

    return gpipe(stages, microbatches, **kw)


def _1f1b(stages, microbatches, virtual_stages, segments, **kw):
    from .one_f_one_b import one_f_one_b

    return one_f_one_b(stages, microbatches, **kw)


def _interleaved(stages, microbatches, virtual_stages, segments, **kw):
    from .interleaved import interleaved_1f1b

    return interleaved_1f1b(stages, microbatches, virtual_stages, **kw)


def _zb_h1(stages, microbatches, virtual_stages, segments, **kw):
    from .zero_bubble import zb_h1

    return zb_h1(stages, microbatches, **kw)


def _chimera(stages, microbatches, virtual_stages, segments, **kw):
    from .chimera import chimera

    return chimera(stages, microbatches, **kw)


def _pipedream(stages, microbatches, virtual_stages, segments, **kw):
    from .asynchronous import pipedream

    return pipedream(stages, microbatches, **kw)


def _pipedream_2bw(stages, microbatches, virtual_stages, segments, **kw):
    from .asynchronous import pipedream_2bw

    return pipedream_2bw(stages, microbatches, **kw)


def _amdp(stages, microbatches, virtual_stages, segments, **kw):
    from .asynchronous import amdp

    return amdp(stages, microbatches, **kw)


def _seq1f1b(stages, microbatches, virtual_stages, segments, **kw):
    from .seq1f1b import seq1f1b

    return seq1f1b(stages, microbatches, segments, **kw)


def _seq1f1b_interleaved(stages, microbatches, virtual_stages, segments, **kw):
    from .seq1f1b import seq1f1b_interleaved

    return seq1f1b_interleaved(stages, microbatches, virtual_stages, segments, **kw)


def _bapp(stages, microbatches, virtual_stages, segments, graph=None, **kw):
    from .bapp import BappPolicy, bapp

    return bapp(stages, microbatches, graph, BappPolicy(**kw))


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": _gpipe,
    "1f1b": _1f1b,
    "interleaved_1f1b": _interleaved,
    "zb_h1": _zb_h1,
    "chimera": _chimera,
    "pipedream": _pipedream,
    "pipedream_2bw": _pipedream_2bw,
    "amdp": _amdp,
    "bapp": _bapp,
    "seq1f1b": _seq1f1b,
    "seq1f1b_interleaved": _seq1f1b_interleaved,
}

# Schedules that update weights without a flush: they cover schedule.windows steps.
ASYNC_SCHEDULES = ("pipedream", "pipedream_2bw", "amdp")
# schedule.* keys (besides name) each schedule reads; the others must stay null
SCHEDULE_PARAMS: dict[str, tuple[str, ...]] = {
    "pipedream": ("windows", "stash"),
    "pipedream_2bw": ("windows",),
    "amdp": ("windows", "accumulation_rounds", "zero"),
    # bapp's policy (pipeflow.schedules.bapp); the config layer lets the coordinator pick it
    "bapp": ("priority", "lead", "warmup", "head"),
    # how the sequence is cut into segments (pipeflow.planning.seqsplit): uniform | compute
    "seq1f1b": ("split",),
    "seq1f1b_interleaved": ("split",),
}

# which pipeline.* keys a schedule actually uses; others must stay at their neutral value
USES_VIRTUAL_STAGES = {"interleaved_1f1b", "seq1f1b_interleaved"}
USES_SEGMENTS: set[str] = {"seq1f1b", "seq1f1b_interleaved"}
# schedules built for a branched model's stage graph as it is (each branch cut into
# pipeline.stages stages), not a chain schedule over grouped stages
BRANCH_AWARE = {"bapp"}
# chain schedules that can run over grouped stages of a branched model
GROUPABLE = {"gpipe", "1f1b", "zb_h1", "chimera"}


def schedule_names() -> list[str]:
    return list(GENERATORS)


def build_schedule(
    name: str,
    stages: int,
    microbatches: int,
    virtual_stages: int = 1,
    segments: int = 1,
    check: bool = True,
    graph: StageGraph | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    **params,
) -> Schedule:
    """Generate (and by default validate) the named schedule. With ``graph`` (a branched
    model's stage DAG) the chain schedule runs over contiguous groups of its stages."""
    if name not in GENERATORS:
        raise ScheduleConfigError(
            f"schedule.name={name}: unknown schedule; allowed values: {', '.join(GENERATORS)}"
        )
    if virtual_stages != 1 and name not in USES_VIRTUAL_STAGES:
        raise ScheduleConfigError(
            f"pipeline.virtual_stages={virtual_stages}: only {', '.join(sorted(USES_VIRTUAL_STAGES))} "
            f"interleaves model chunks; schedule '{name}' needs pipeline.virtual_stages=1"
        )
    if segments != 1 and name not in USES_SEGMENTS:
        raise ScheduleConfigError(
            f"pipeline.segments={segments}: schedule '{name}' does not split sequences into segments; "
            f"use pipeline.segments=1"
            + (f" (segmented schedules: {', '.join(sorted(USES_SEGMENTS))})" if USES_SEGMENTS else "")
        )
    allowed = SCHEDULE_PARAMS.get(name, ())
    for key in params:
        if key not in allowed:
            raise ScheduleConfigError(
                f"schedule.{key}={params[key]}: schedule '{name}' has no option '{key}'"
                + (f"; its options: {', '.join(allowed)}" if allowed else "; it takes none")
            )
    if name in BRANCH_AWARE:  # schedules a branched stage graph itself, one stage per branch and device
        sched = GENERATORS[name](stages, microbatches, virtual_stages, segments, graph=graph, **params)
        if check:
            validate(sched)
        return sched
    sched = GENERATORS[name](stages, microbatches, virtual_stages, segments, **params)
    if graph is not None and not (graph.is_chain and graph.num_stages == sched.num_stages):
        # a branched model: run the chain schedule over contiguous groups of its stages
        if name not in GROUPABLE:
            raise ScheduleConfigError(
                f"schedule.name={name}: a branched model runs with {', '.join(sorted(GROUPABLE))} "
                f"(its stages grouped onto a chain of pipeline.stages={stages} devices)"
            )
        sched = place_graph(sched, graph, groups)
    if check:
        validate(sched)
    return sched
