"""The cost models by name (``cost=<name>``) and the one place a ``cost`` config group
becomes a cost model (:func:`build_cost_model`)."""

from __future__ import annotations

import inspect
from typing import Mapping

from .cost import AnalyticCost, CostModel
from .unit_cost import UnitCost
from .machine_cost import CalibratedCost, ProfiledCost
from .transformer import TransformerSpec

COST_MODELS = {"unit": UnitCost, "analytic": AnalyticCost, "profiled": ProfiledCost,
               "calibrated": CalibratedCost}
# filled from the run, not from the cost config
_FROM_RUN = {"num_stages", "spec", "microbatch_size", "tensor_parallel", "sequence_parallel"}


def cost_params(name: str) -> list[str]:
    """Keys the ``cost`` config group may set for this model (``overlap`` for every one)."""
    sig = inspect.signature(COST_MODELS[name].__init__)
    return [p for p in sig.parameters if p != "self" and p not in _FROM_RUN] + ["overlap"]


def build_cost_model(
    cfg: Mapping, num_stages: int, spec: TransformerSpec | None, microbatch_size: int,
    tensor_parallel: int = 1, sequence_parallel: bool = False,
) -> CostModel:
    """The cost model the ``cost`` config group names, its other keys that model's parameters.
    ``tensor_parallel`` and ``sequence_parallel`` price one rank of each device's tensor group
    (analytic: the rank's shape; calibrated: a file of the same T). A key set to null keeps
    the default, except where the default is None (``cost.comm`` of unit costs)."""
    raw = dict(cfg)
    name = raw.get("name")
    nullable = set()
    if name in COST_MODELS:
        sig = inspect.signature(COST_MODELS[name].__init__)
        nullable = {k for k, prm in sig.parameters.items() if prm.default is not inspect.Parameter.empty and "None" in str(prm.annotation)}
    params = {k: v for k, v in raw.items() if v is not None or k in nullable}
    params.pop("name", None)
    if name not in COST_MODELS:
        raise ValueError(f"cost.name={name}: unknown cost model; allowed values: {', '.join(COST_MODELS)}")
    allowed = cost_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(
            f"cost.{unknown[0]}: unknown key for cost model '{name}' "
            f"(unknown: {', '.join(unknown)}); allowed keys: {', '.join(allowed)}"
        )
    overlap = params.pop("overlap", 0.0)
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap <= 1:
        raise ValueError(f"cost.overlap={overlap!r}: the hidden share of an overlapped F&B pair's shorter half; "
                         f"a number in [0, 1] (0: one after the other)")
    if name == "calibrated":
        # measured with the run's tensor groups (their collectives inside every time):
        # the file must be of the same T and sequence parallelism
        params = {**params, "tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}
    elif tensor_parallel > 1:
        if name != "analytic":
            raise ValueError(f"pipeline.tensor_parallel={tensor_parallel}: cost model '{name}' has no shape to split "
                             f"across a tensor group's ranks; use cost=analytic or cost=calibrated "
                             f"(or pipeline.tensor_parallel=1)")
        params = {**params, "tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}
    model = _build(name, params, num_stages, spec, microbatch_size)
    model.overlap = float(overlap)
    return model


def _build(name: str, params: dict, num_stages: int, spec: TransformerSpec | None, microbatch_size: int) -> CostModel:
    if name == "unit":
        return UnitCost(num_stages, **params)
    if name == "calibrated":
        return CalibratedCost(num_stages, **params)
    if name == "profiled":
        if params.get("layers_per_stage") is not None:
            params["layers_per_stage"] = list(params["layers_per_stage"])  # a ListConfig becomes a list
        return ProfiledCost(num_stages, spec, microbatch_size, **params)
    if spec is None:
        raise ValueError(
            "cost.name=analytic needs the model's shape (model.n_layer, n_head, n_embd, vocab_size, seq_len); "
            "pick a model config, or use cost.name=unit"
        )
    for key in ("layers_per_stage", "segment_lengths"):
        if key in params and hasattr(params[key], "__iter__") and not isinstance(params[key], str):
            params[key] = list(params[key])  # an OmegaConf ListConfig becomes a plain list of ints
    return AnalyticCost(spec, num_stages, microbatch_size=microbatch_size, **params)
