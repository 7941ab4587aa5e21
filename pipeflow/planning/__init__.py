"""Planning (torch-free): cost models, partitioners, the topology-aware planner, BAPP's coordinator."""

from .cost import AnalyticCost, CostModel
from .unit_cost import UnitCost
from .cost_models import build_cost_model
from .transformer import (
    TransformerSpec,
    embedding_params,
    head_forward_flops,
    head_params,
    layer_forward_flops,
    layer_linear_flops,
    layer_params,
    total_params,
)

__all__ = [
    "AnalyticCost",
    "CostModel",
    "TransformerSpec",
    "UnitCost",
    "build_cost_model",
    "embedding_params",
    "head_forward_flops",
    "head_params",
    "layer_forward_flops",
    "layer_linear_flops",
    "layer_params",
    "total_params",
]
