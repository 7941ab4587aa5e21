"""Name -> schedule spec: the one place the config's ``schedule.name`` is resolved. Built-in
specs are registered here, a user's by :func:`load_spec` from its import path
(``schedule.generator``); :func:`build_schedule` checks sizes, generates and validates."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Sequence

from . import asynchronous, bapp, chimera, from_file, gpipe, interleaved, looped, one_f_one_b, seq1f1b, v_shape, zero_bubble
from .common import ScheduleConfigError
from .grouping import place_graph
from .ir import Schedule, StageGraph
from .spec import ScheduleSpec, spec_from_function
from .validate import validate

_SPECS: dict[str, ScheduleSpec] = {}
_USER: set[str] = set()  # names load_spec registered (a user's schedules): only these may be loaded again


def register(spec: ScheduleSpec, replace: bool = False) -> ScheduleSpec:
    """Make ``spec`` known by its name (again with ``replace``: a user's spec reloaded)."""
    if spec.name in _SPECS and _SPECS[spec.name] is not spec and not replace:
        raise ScheduleConfigError(f"schedule.name={spec.name}: a schedule of that name is registered already")
    _SPECS[spec.name] = spec
    return spec


for _spec in (gpipe.SPEC, one_f_one_b.SPEC, interleaved.SPEC, zero_bubble.SPEC, chimera.SPEC,
              asynchronous.PIPEDREAM, asynchronous.PIPEDREAM_2BW, asynchronous.AMDP, bapp.SPEC,
              seq1f1b.SEQ1F1B, seq1f1b.SEQ1F1B_INTERLEAVED, zero_bubble.ZB_H2, zero_bubble.INTERLEAVED_ZB, v_shape.ZB_V, v_shape.DUALPIPE_V, looped.SPEC,
              from_file.SPEC):
    register(_spec)
BUILTIN = tuple(_SPECS)


def schedule_names() -> list[str]:
    return list(_SPECS)


def specs() -> list[ScheduleSpec]:
    return list(_SPECS.values())


def get_spec(name: str) -> ScheduleSpec:
    spec = _SPECS.get(name)
    if spec is None:
        raise ScheduleConfigError(
            f"schedule.name={name}: unknown schedule; allowed values: {', '.join(_SPECS)} "
            f"(or your own: schedule.generator=<module>:<function> in its YAML)"
        )
    return spec


def _import_target(path: str):
    """The object at ``module.path:attr`` or ``some/file.py:attr``."""
    where, sep, attr = path.rpartition(":")
    if not sep or not where or not attr:
        raise ScheduleConfigError(f"schedule.generator={path}: give <module>:<function> or <file.py>:<function>")
    if where.endswith(".py"):
        file = os.path.abspath(os.path.expanduser(where))
        if not os.path.isfile(file):
            raise ScheduleConfigError(f"schedule.generator={path}: no such file {file} "
                                      f"(relative paths start at {os.getcwd()})")
        # one module per file, under a name of its own, so every load of it is the same module
        modname = f"pipeflow_user_schedule_{hashlib.sha1(file.encode()).hexdigest()[:12]}"
        module = sys.modules.get(modname)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(modname, file)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[modname] = module
            try:
                loader_spec.loader.exec_module(module)
            except Exception as err:
                del sys.modules[modname]
                raise ScheduleConfigError(f"schedule.generator={path}: importing {file} failed: "
                                          f"{type(err).__name__}: {err}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ScheduleConfigError(f"schedule.generator={path}: cannot import {where} ({err}); put its package "
                                      f"on the Python path, or give <file.py>:<function>") from None
    target = getattr(module, attr, None)
    if target is None:
        raise ScheduleConfigError(f"schedule.generator={path}: {where} has no {attr!r}")
    return target


def load_spec(generator: str, name: str) -> ScheduleSpec:
    """Register and return the schedule at import path ``generator`` under ``name``:
    a :class:`ScheduleSpec` or a bare generator function (its spec read from its
    signature). A built-in name cannot be taken over."""
    if name in _SPECS and name not in _USER:
        raise ScheduleConfigError(f"schedule.name={name}: a built-in schedule; give your own schedule another name")
    target = _import_target(generator)
    if isinstance(target, ScheduleSpec):
        if target.name != name:
            raise ScheduleConfigError(f"schedule.name={name}: {generator} declares schedule {target.name!r}; "
                                      f"use schedule.name={target.name}")
        spec = target
    elif callable(target):
        try:
            spec = spec_from_function(name, target)
        except TypeError as err:
            raise ScheduleConfigError(f"schedule.generator={generator}: {err}") from None
    else:
        raise ScheduleConfigError(f"schedule.generator={generator}: not a function or a ScheduleSpec")
    _USER.add(name)
    return register(spec, replace=True)


def build_schedule(
    name: str,
    stages: int,
    microbatches: int,
    virtual_stages: int = 1,
    segments: int = 1,
    check: bool = True,
    graph: StageGraph | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    data_parallel: int = 1,
    **params,
) -> Schedule:
    """Generate (and by default validate) the named schedule; with ``graph`` (a branched
    model's stage DAG) over contiguous groups of its stages; with ``data_parallel`` n > 1, n
    replicas side by side."""
    spec = get_spec(name)
    if data_parallel != 1 and (spec.asynchronous or spec.branch_aware or graph is not None):
        raise ScheduleConfigError(
            f"pipeline.data_parallel={data_parallel}: schedule '{name}' "
            + ("is asynchronous" if spec.asynchronous else "places a branched model's stages itself"
               if spec.branch_aware or graph is not None else "")
            + "; data parallelism wraps synchronous chain schedules (use pipeline.data_parallel=1)")
    if virtual_stages != 1 and not spec.virtual_stages:
        chunked = ", ".join(s.name for s in specs() if s.virtual_stages)
        raise ScheduleConfigError(
            f"pipeline.virtual_stages={virtual_stages}: only {chunked} interleave model chunks; "
            f"schedule '{name}' needs pipeline.virtual_stages=1"
        )
    if segments != 1 and not spec.segments:
        segmented = ", ".join(s.name for s in specs() if s.segments)
        raise ScheduleConfigError(
            f"pipeline.segments={segments}: schedule '{name}' does not split sequences into segments; "
            f"use pipeline.segments=1" + (f" (segmented schedules: {segmented})" if segmented else "")
        )
    allowed = spec.options
    for key in params:
        if key not in allowed:
            raise ScheduleConfigError(
                f"schedule.{key}={params[key]}: schedule '{name}' has no option '{key}'"
                + (f"; its options: {', '.join(allowed)}" if allowed else "; it takes none")
            )
    if spec.branch_aware:  # schedules a branched stage graph itself
        sched = spec.build(stages, microbatches, virtual_stages, segments, graph=graph, **params)
        if check:
            validate(sched)
        return sched
    sched = spec.build(stages, microbatches, virtual_stages, segments, **params)
    if graph is not None and not (graph.is_chain and graph.num_stages == sched.num_stages):
        # a branched model: run the chain schedule over contiguous groups of its stages
        if not spec.groupable:
            groupable = ", ".join(s.name for s in specs() if s.groupable)
            raise ScheduleConfigError(
                f"schedule.name={name}: a branched model runs with {groupable} "
                f"(its stages grouped onto a chain of pipeline.stages={stages} devices)"
            )
        sched = place_graph(sched, graph, groups)
    if data_parallel != 1:
        from .data_parallel import replicate

        sched = replicate(sched, data_parallel)
    if check:
        validate(sched)
    return sched
