"""Discrete-event simulator, metrics, timeline export and drawing (torch-free).

``simulate(schedule, cost, topology)`` predicts the per-action timing, makespan,
bubble ratio, peak activation memory and communication volume of any schedule;
``result.timeline`` exports to Chrome trace JSON and draws as a PNG Gantt chart
(``draw_timeline``; matplotlib is imported only when drawing).
"""

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
