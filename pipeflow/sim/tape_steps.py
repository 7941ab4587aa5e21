"""The steps a memory walk writes onto its tape (see :class:`~pipeflow.sim.memory_tape.Tape`): the
categories' numbers, the instants and the action kinds a walk visits."""

from __future__ import annotations

from ..schedules.ir import Kind
from .memory_tape import _CAT

F, B, I, W, STEP, GATHER, FREE = Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP, Kind.GATHER, Kind.FREE  # noqa: E741
WALKED = (F, B, I, W, STEP, GATHER, FREE)  # the actions a walk visits (a REDUCE is walked after the one before it)
PARAMS, OPT, VERS, GRADS, CASTS, ACTS, RESID, OUTS, INS = (_CAT[c] for c in (
    "parameters", "optimizer_state", "weight_versions", "gradients", "casts", "activations", "residuals", "outputs",
    "inputs"))
INSTANT = (-1, -1, 0)  # an instant with nothing on top
NOTHING = (-1, None, 0)  # (a piece's instant with nothing on top)
