"""Config schemas derived from signatures: presets, cost models and schedule specs keep
their parameters in their own signatures, so the schemas cannot drift from them.
"""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from dataclasses import field, make_dataclass
from typing import Any, List, Optional, Sequence


from pipeflow.planning.cost_models import COST_MODELS, cost_params
from pipeflow.schedules.spec import ScheduleSpec
from pipeflow.topology.presets import PRESETS


def _config_type(hint: Any) -> Any:
    """A parameter's type as OmegaConf understands it, always Optional: null keeps the
    default (build_topology and build_cost_model drop null keys)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) in (list, tuple, collections.abc.Sequence):
        hint = List[typing.get_args(hint)[0]]
    return Optional[hint]


def _schema_from_signature(class_name: str, option: str, fn: Any, skip: Sequence[str] = ()) -> type:
    """A schema with ``name`` plus the keyword parameters of ``fn``, their types and
    defaults. Presets and cost models keep their parameters in their own signatures,
    so deriving the schema from them means the two cannot drift apart."""
    hints = typing.get_type_hints(fn)
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=option))]
    for param in inspect.signature(fn).parameters.values():
        if param.name == "self" or param.name in skip:
            continue
        fields.append((param.name, _config_type(hints[param.name]), param.default))
    return make_dataclass(class_name, fields)


def topology_schema(preset: str) -> type:
    """``conf/topology/<preset>.yaml``: the preset's parameters, plus ``num_devices``
    (cut the preset to its first N devices; local_cpu: how many ranks)."""
    schema = _schema_from_signature(f"{_camel(preset)}TopologyConfig", preset, PRESETS[preset], skip=("num_devices",))
    return make_dataclass(schema.__name__, [("num_devices", Optional[int], None)], bases=(schema,))


def cost_schema(name: str) -> type:
    """``conf/cost/<name>.yaml``: the cost model's parameters; the stage count, model and
    microbatch size come from the run, not from this group."""
    init = COST_MODELS[name].__init__
    from_run = [p for p in inspect.signature(init).parameters if p not in cost_params(name)]
    schema = _schema_from_signature(f"{_camel(name)}CostConfig", name, init, skip=from_run)
    # every cost model prices an overlapped F&B pair (pipeflow.planning.cost.CostModel.overlap)
    return make_dataclass(schema.__name__, [("overlap", float, 0.0)], bases=(schema,))


def _camel(name: str) -> str:
    return name.title().replace("_", "")


def schedule_schema(spec: ScheduleSpec) -> type:
    """``conf/schedule/<name>.yaml``: ``name``, ``generator`` (a user's schedule: the
    import path of its generator or spec), the generator's options and the keys the
    configuration layer reads for it, typed and defaulted from the spec."""
    fields: list[tuple[str, Any, Any]] = [("name", str, field(default=spec.name)),
                                          ("generator", Optional[str], None)]
    fields += [(o.name, Optional[o.type], o.default) for o in spec.options.values()]
    fields += [(key, Optional[kind], None) for key, kind in spec.config_keys.items()]
    return make_dataclass(f"Schedule{_camel(spec.name)}Config", fields)
