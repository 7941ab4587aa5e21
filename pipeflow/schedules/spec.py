"""Schedule specs: what a schedule is, declared once, next to its generator
``(stages, microbatches, [virtual_stages], [segments], [graph], **options) -> Schedule``.

Read from the signature: the structural parameters it supports, and every other
parameter as a typed ``schedule.<name>`` option. Declared: a summary, ``asynchronous``,
``groupable``, ``runtime``, ``config_keys`` and ``assemble``. Built-in modules declare
``SPEC``; a user's generator is named by import path
(:func:`pipeflow.schedules.registry.load_spec`)."""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .ir import Schedule, StageGraph

# parameters a generator takes from the pipeline, not from schedule.* options
STRUCTURAL = ("stages", "microbatches", "virtual_stages", "segments", "graph")
# option types a YAML can carry
SCALARS = (int, float, bool, str)


@dataclass(frozen=True)
class Option:
    """One ``schedule.<name>`` key: its type (a scalar, maybe None), default and doc line."""

    name: str
    type: Any
    default: Any
    optional: bool


def _option_type(hint: Any, where: str) -> tuple[Any, bool]:
    """(scalar type, whether None is allowed) of an option's annotation."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            raise TypeError(f"{where}: an option's type is one of int, float, bool, str (or None), not {hint}")
        hint = args[0]
    if hint not in SCALARS:
        raise TypeError(f"{where}: an option's type is one of int, float, bool, str (or None), not {hint}")
    return hint, optional


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule: its name, its generator, and what it supports (see the module docstring)."""

    name: str
    generator: Callable[..., Schedule] | None
    summary: str = ""
    asynchronous: bool = False  # weights update without a flush; a run covers schedule.windows steps
    groupable: bool = False  # a chain schedule that also runs a branched model, stages grouped onto a chain
    runtime: bool = True  # pipeflow-train executes it (otherwise pipeflow-simulate only)
    single_pipeline: bool = True  # one pipeline replica (Chimera places two; a plan may replicate stages)
    # generates a schedule for the pipeline's sizes alone (schedule=file reads its own from a
    # file: the grids of sizes the tests walk leave it out)
    sized: bool = True
    # schedule.* keys the configuration layer reads itself (bapp's coordinator, the planner's
    # plan file): name -> scalar type; null by default
    config_keys: Mapping[str, type] = field(default_factory=dict)
    # the run's whole configuration -> the schedule, for schedules that need the model and
    # topology (schedule=planned); the configuration layer calls it instead of the generator
    assemble: Callable[[Any], Schedule] | None = None

    def __post_init__(self) -> None:
        if self.generator is None and self.assemble is None:
            raise TypeError(f"schedule spec {self.name!r}: give a generator or an assemble function")
        self.options  # noqa: B018 - fail at declaration on an option the config cannot carry

    # ---- read from the generator's signature -----------------------------------------
    @property
    def _parameters(self) -> Mapping[str, inspect.Parameter]:
        return inspect.signature(self.generator).parameters if self.generator is not None else {}

    def _takes(self, name: str) -> bool:
        return name in self._parameters

    @property
    def virtual_stages(self) -> bool:
        """Interleaves ``pipeline.virtual_stages`` model chunks per device."""
        return self._takes("virtual_stages")

    @property
    def segments(self) -> bool:
        """Splits each microbatch into ``pipeline.segments`` sequence segments."""
        return self._takes("segments")

    @property
    def branch_aware(self) -> bool:
        """Schedules a branched model's stage graph itself (takes ``graph``)."""
        return self._takes("graph")

    @property
    def exportable(self) -> bool:
        """torch's CSV format can carry it: one pipeline, synchronous, whole sequences, a chain."""
        return self.single_pipeline and not (self.asynchronous or self.segments or self.branch_aware)

    @property
    def options(self) -> dict[str, Option]:
        """The generator's options (every non-structural parameter), in signature order."""
        if self.generator is None:
            return {}
        try:
            hints = typing.get_type_hints(self.generator)
        except Exception as err:  # noqa: BLE001 - a hint that does not resolve is the author's to fix
            raise TypeError(f"schedule {self.name!r}: cannot read the generator's type hints ({err})") from None
        out = {}
        for p in self._parameters.values():
            if p.name in STRUCTURAL or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            where = f"schedule {self.name!r}, option {p.name!r}"
            if p.default is p.empty:
                raise TypeError(f"{where}: an option needs a default (the value when the YAML leaves it out)")
            if p.name not in hints:
                raise TypeError(f"{where}: annotate its type (int, float, bool or str)")
            kind, optional = _option_type(hints[p.name], where)
            out[p.name] = Option(p.name, kind, p.default, optional or p.default is None)
        return out

    def keys(self) -> list[str]:
        """Every schedule.* key this schedule reads besides name and generator."""
        return [*self.options, *self.config_keys]

    def build(self, stages: int, microbatches: int, virtual_stages: int = 1, segments: int = 1,
              graph: StageGraph | None = None, **options) -> Schedule:
        """Call the generator with the structural arguments it takes and ``options``."""
        if self.generator is None:
            raise TypeError(f"schedule {self.name!r} is assembled from the run's configuration (spec.assemble)")
        given = {"stages": stages, "microbatches": microbatches, "virtual_stages": virtual_stages,
                 "segments": segments, "graph": graph}
        kwargs = {k: v for k, v in given.items() if k in self._parameters}
        sched = self.generator(**kwargs, **options)
        if not isinstance(sched, Schedule):
            raise TypeError(f"schedule {self.name!r}: the generator returned {type(sched).__name__}, not a Schedule")
        return sched

    def describe(self) -> dict[str, Any]:
        """What a table of schedules shows (the docs' table, ``pipeflow-simulate --schedules``)."""
        return {"name": self.name, "summary": self.summary, "asynchronous": self.asynchronous,
                "virtual_stages": self.virtual_stages, "segments": self.segments,
                "branched": "own graph" if self.branch_aware else ("grouped" if self.groupable else "no"),
                "runtime": self.runtime, "export": self.exportable, "options": self.keys()}


def spec_from_function(name: str, fn: Callable[..., Schedule]) -> ScheduleSpec:
    """A spec for a bare generator function: its docstring's first line as the summary,
    everything else from its signature (synchronous, run by the runtime)."""
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return ScheduleSpec(name=name, generator=fn, summary=doc[0] if doc else "")
