"""Schedule IR, specs, registry, validator and generators (torch-free)."""

from .ir import Action, Kind, Placement, Schedule, StageGraph, WeightPolicy
from .validate import ScheduleError, validate

__all__ = ["Action", "Kind", "Placement", "Schedule", "StageGraph", "WeightPolicy", "ScheduleError", "validate"]
