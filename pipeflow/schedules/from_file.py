"""``schedule=file``: a schedule read from a file, one device per line, in torch's
compute-only CSV (:func:`pipeflow.schedules.export.to_torch_csv`), torch's CSV with
communication (its communication cells skipped, ``(F;B)OVERLAP_F_B`` an overlapped pair)
or pipeflow's notation (:meth:`pipeflow.schedules.ir.Schedule.format`; REDUCE and STEP
dropped and the step closed again).

The stages form a chain ``0 .. S-1``, each on exactly one device; the placement is read
from where they run. The result is validated like a generated schedule."""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re

from .common import ScheduleConfigError, finish_sync
from .ir import Action, Kind, Placement, Schedule, StageGraph
from .spec import ScheduleSpec

_TORCH_COMPUTE = re.compile(r"(\d+)([FIWB])(\d+)")
_TORCH_SKIPPED = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")
_OVERLAP = re.compile(r"\((.*)\)(?:OVERLAP_F_B)?")
_DEVICE_PREFIX = re.compile(r"^\s*d\d+\s*\|")


def _cell(text: str, where: str, pairs: list | None = None) -> list[Action]:
    """The compute actions one cell holds (none for a communication cell); an overlapped
    ``(F;B)`` cell adds its pair to ``pairs``."""
    text = text.strip()
    if not text or _TORCH_SKIPPED.fullmatch(text):
        return []
    m = _OVERLAP.fullmatch(text)
    if m:
        parts = [a for part in m.group(1).split(";") for a in _cell(part, where)]
        if len(parts) != 2 or parts[0].kind != Kind.F or parts[1].kind != Kind.B:
            raise ScheduleConfigError(f"{where}: an overlapped cell holds a forward and a full backward, "
                                      f"e.g. (0F3;3B1)OVERLAP_F_B; got {text!r}")
        if pairs is not None:
            pairs.append((parts[0], parts[1]))
        return parts
    m = _TORCH_COMPUTE.fullmatch(text)
    if m:
        return [Action(m.group(2), int(m.group(1)), int(m.group(3)))]
    try:
        a = Action.parse(text)
    except ValueError as err:
        raise ScheduleConfigError(f"{where}: {err}") from None
    return [a] if a.kind in Kind.COMPUTE else []  # REDUCE and STEP: the closing is redone


def read_orders(text: str, source: str = "the file") -> list[list[Action]]:
    """Per-device compute orders of a schedule file's text (any of the three formats)."""
    return read_schedule_text(text, source)[0]


def read_schedule_text(text: str, source: str = "the file") -> tuple[list[list[Action]], list[tuple[Action, Action]]]:
    """Per-device compute orders and the overlapped (F, B) pairs of a schedule file's text."""
    pairs: list[tuple[Action, Action]] = []
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if "," in line:
            rows.append(next(csv.reader(io.StringIO(line))))
        else:
            rows.append(_DEVICE_PREFIX.sub("", line).split())
    orders = [[a for k, cell in enumerate(row) for a in _cell(cell, f"{source}, device {d}, cell {k + 1}", pairs)]
              for d, row in enumerate(rows)]
    return orders, pairs


def schedule_from_orders(orders: list[list[Action]], name: str = "file", source: str = "the file",
                         overlapped: tuple = ()) -> Schedule:
    """A synchronous schedule from per-device compute orders: the chain of the stages they
    name, each on the device that runs it."""
    if not orders or not any(orders):
        raise ScheduleConfigError(f"schedule.path: {source} holds no compute actions (one device per line)")
    where: dict[int, set[int]] = {}
    for d, order in enumerate(orders):
        for a in order:
            if a.pipe != 0:
                raise ScheduleConfigError(f"schedule.path: {source} names pipeline replica {a.pipe} ({a}); "
                                          f"a schedule file holds one pipeline")
            where.setdefault(a.stage, set()).add(d)
    stages = sorted(where)
    if stages != list(range(len(stages))):
        missing = sorted(set(range(max(stages) + 1)) - set(stages))
        raise ScheduleConfigError(f"schedule.path: {source} never runs stage(s) {missing}; the stages form a "
                                  f"chain 0..{max(stages)}")
    shared = {s: sorted(ds) for s, ds in where.items() if len(ds) > 1}
    if shared:
        s, ds = next(iter(shared.items()))
        shown = ", ".join(map(str, ds[:8])) + (f", ... ({len(ds):,} devices)" if len(ds) > 8 else "")
        raise ScheduleConfigError(f"schedule.path: {source} runs stage {s} on devices [{shown}]; a stage lives on "
                                  f"one device")
    mbs = sorted({a.microbatch for order in orders for a in order})
    if mbs != list(range(len(mbs))):
        raise ScheduleConfigError(f"schedule.path: {source} numbers microbatches {mbs[:8]}...; they must be "
                                  f"0..{len(mbs) - 1}")
    segments = 1 + max(a.segment for order in orders for a in order)
    device_of_stage = [next(iter(where[s])) for s in stages]
    v = len(stages) / len(orders)
    meta = {"virtual_stages": int(v)} if v == int(v) and v > 1 else {}
    return finish_sync(name, StageGraph.chain(len(stages)), Placement.single(device_of_stage, len(orders)),
                       [list(o) for o in orders], len(mbs), num_segments=segments, meta=meta,
                       overlapped=tuple(overlapped))


FAR = 4  # a file with this many times the lines or cells a run can need is refused before it is read


def check_size(text: str, path: str, stages: int, microbatches: int, virtual_stages: int = 1,
               segments: int = 1) -> None:
    """Refuse, before any cell is read, a file far larger than the run can need: more than
    :data:`FAR` times ``stages`` lines, or a line of more than :data:`FAR` times the whole
    schedule's compute actions."""
    def whole(n) -> int:  # a size the config's own checks refuse counts as 1 here
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1

    p, m, v, s = whole(stages), whole(microbatches), whole(virtual_stages), whole(segments)
    need = p * v * m * s * 3
    lines = 0
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lines += 1
        if lines > FAR * p:
            devices = sum(1 for x in text.splitlines() if x.strip() and not x.lstrip().startswith("#"))
            raise ScheduleConfigError(
                f"schedule.path={path}: {devices:,} device lines, far more than the {p} of this run "
                f"(pipeline.stages={stages}); a schedule file holds one line per device: give the file written "
                f"for these settings, or set pipeline.stages to its device count")
        cells = line.count(",") + 1 if "," in line else len(line.split())
        if cells > FAR * need:
            raise ScheduleConfigError(
                f"schedule.path={path}: line {k} holds {cells:,} cells, far more than this run can need "
                f"({need:,} actions in all: pipeline.stages={stages} x virtual_stages {v} x pipeline.microbatches="
                f"{microbatches} x segments {s} x F, I and W); give the file written for these settings, or set "
                f"pipeline.microbatches to the file's")


def from_file(stages: int, microbatches: int, virtual_stages: int = 1, segments: int = 1,
              path: str | None = None) -> Schedule:
    """A schedule read from a file (torch's CSV, with or without communication, or pipeflow's notation)."""
    if not path:
        raise ScheduleConfigError("schedule.path=null: schedule 'file' needs a file (torch's CSV or pipeflow's "
                                  "notation, one device per line)")
    file = os.path.expanduser(path)
    try:
        with open(file, newline="") as f:
            text = f.read()
    except OSError as err:
        raise ScheduleConfigError(f"schedule.path={path}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ScheduleConfigError(f"schedule.path={path}: not UTF-8 text (byte {err.start} is "
                                  f"0x{err.object[err.start]:02x}); save it as UTF-8") from None
    check_size(text, path, stages, microbatches, virtual_stages, segments)
    orders, pairs = read_schedule_text(text, path)
    sched = schedule_from_orders(orders, source=path, overlapped=tuple(pairs))
    sched = dataclasses.replace(sched, meta={**sched.meta, "path": path})
    found = {"pipeline.stages": (stages, sched.num_devices, "devices (lines)"),
             "pipeline.microbatches": (microbatches, sched.num_microbatches, "microbatches"),
             "pipeline.virtual_stages": (virtual_stages, sched.num_stages // max(1, sched.num_devices),
                                         "stages per device"),
             "pipeline.segments": (segments, sched.num_segments, "sequence segments")}
    for key, (given, there, what) in found.items():
        if given != there:
            raise ScheduleConfigError(f"{key}={given}: schedule.path={path} has {there} {what}; set {key}={there}")
    if sched.num_stages % sched.num_devices:
        raise ScheduleConfigError(f"schedule.path={path}: {sched.num_stages} stages on {sched.num_devices} devices; "
                                  f"every device needs the same number of stages")
    return sched


SPEC = ScheduleSpec("file", from_file, "a schedule read from a file: torch's CSV or pipeflow's notation (schedule.path)",
                    sized=False)
