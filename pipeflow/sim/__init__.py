"""Discrete-event simulator, metrics, timeline export and drawing (torch-free):
``simulate(schedule, cost, topology)`` predicts a schedule's per-action timing, makespan,
bubble, peak memory and traffic; ``result.timeline`` exports to a Chrome trace and draws
as a PNG Gantt chart (matplotlib imported only then)."""

from .engine import CompiledSchedule, DeviceStats, SimResult, SimulationError, compile_schedule, simulate
from .gantt import draw_timeline
from ..formats.timeline import Event, Timeline

__all__ = [
    "CompiledSchedule",
    "DeviceStats",
    "Event",
    "SimResult",
    "SimulationError",
    "Timeline",
    "compile_schedule",
    "draw_timeline",
    "simulate",
]
