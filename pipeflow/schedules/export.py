"""Export a schedule to PyTorch pipelining's CSV: "compute_only" (one row per rank, cells
``<stage><F|B|I|W><microbatch>``, which torch's ``_PipelineScheduleRuntime._load_csv``
lowers itself) for one synchronous pipeline of a chain of stages without segments;
"compute_comms" (every action in our order with our sends, receives, REDUCE_GRAD,
UNSHARD and RESHARD) for a data-parallel schedule's first replica. REDUCE and STEP are
dropped from compute_only (torch reduces; the step is the caller's)."""

from __future__ import annotations

import csv
import io
from os import PathLike

from ..formats.files import write_aside
from .ir import Kind, Schedule, WeightPolicy
from .lowering import Comm, lower

# our REDUCE, GATHER and FREE as torch names them
_TORCH_KIND = {Kind.REDUCE: "REDUCE_GRAD", Kind.GATHER: "UNSHARD", Kind.FREE: "RESHARD"}


def replicated(schedule: Schedule) -> bool:
    """Data-parallel replicas of one pipeline each (what the compute_comms export takes)."""
    return schedule.placement.num_pipes > 1 and schedule.data_parallel == schedule.placement.num_pipes


def check_exportable(schedule: Schedule) -> None:
    """Raise ValueError saying why torch's runtime could not run this schedule."""
    name = schedule.name
    if schedule.placement.num_pipes != 1 and not replicated(schedule):
        raise ValueError(
            f"schedule '{name}' runs {schedule.placement.num_pipes} pipeline replicas; torch's CSV format "
            f"maps each stage to one rank, so only single-pipeline schedules can be exported"
        )
    if schedule.num_segments != 1:
        raise ValueError(
            f"schedule '{name}' splits microbatches into {schedule.num_segments} sequence segments; "
            f"torch's CSV format has no segments, so only pipeline.segments=1 can be exported"
        )
    if schedule.policy != WeightPolicy.SYNC:
        raise ValueError(
            f"schedule '{name}' uses weight policy '{schedule.policy.value}'; torch's pipelining runtime "
            f"flushes every step, so only synchronous ('sync') schedules can be exported"
        )
    if not schedule.graph.is_chain:
        raise ValueError(
            f"schedule '{name}' has a stage graph that is not a chain 0->1->...; torch's pipelining runtime "
            f"only sends between neighbouring stages, so only chain-shaped models can be exported"
        )


def torch_csv_rows(schedule: Schedule) -> list[list[str]]:
    """The per-rank cells of the CSV, compute actions only, in device order; an
    overlapped F&B pair is one ``(F;B)OVERLAP_F_B`` cell, as torch writes DualPipeV's."""
    check_exportable(schedule)
    partner = schedule.overlap_partner()
    paired = set(partner.values())

    def cell(a) -> str:
        return f"{a.stage}{a.kind}{a.microbatch}"

    return [
        [f"({cell(a)};{cell(partner[a])})OVERLAP_F_B" if a in partner else cell(a)
         for a in order if a.kind in Kind.COMPUTE and a not in paired]
        for order in schedule.orders
    ]


def torch_comms_rows(schedule: Schedule) -> list[list[str]]:
    """The first replica's ranks in torch's compute_comms cells, in our order (an overlapped pair
    one cell); STEP is the caller's."""
    check_exportable(schedule)
    partner = schedule.overlap_partner()
    paired = set(partner.values())
    lowered = lower(schedule)

    def cell(x) -> str | None:
        if isinstance(x, Comm):
            if x.op == "send":
                return f"{x.dst_stage}SEND_B{x.microbatch}" if x.grad else f"{x.src_stage}SEND_F{x.microbatch}"
            return f"{x.src_stage}RECV_B{x.microbatch}" if x.grad else f"{x.dst_stage}RECV_F{x.microbatch}"
        if x.kind in Kind.COMPUTE:
            if x in paired:
                return None
            own = f"{x.stage}{x.kind}{x.microbatch}"
            if x in partner:
                b = partner[x]
                return f"({own};{b.stage}{b.kind}{b.microbatch})OVERLAP_F_B"
            return own
        return f"{x.stage}{_TORCH_KIND[x.kind]}" if x.kind in _TORCH_KIND else None

    rows = []
    for d in sorted(set(schedule.placement.table[0])):
        row: list[str] = []
        at: dict = {}  # an overlapped pair's forward -> where its cell is
        held: list[str] = []  # the receives met since the last action
        for x in lowered[d]:
            if isinstance(x, Comm) and x.op == "recv":
                held.append(cell(x))
                continue
            if isinstance(x, Comm) or x.kind not in Kind.COMPUTE or x not in paired:
                if x in partner:
                    at[partner[x]] = len(row) + len(held)
                row.extend(held)
                held = []
            else:  # the pair's backward: its receives go before the pair's one cell
                row[at[x]:at[x]] = held
                held = []
            c = cell(x)
            if c is not None:
                row.append(c)
        rows.append(row + held)
    return rows


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule as torch's CSV text (compute_only; a data-parallel schedule's first
    replica in compute_comms, see the module docstring); ValueError says why if it cannot be."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows(torch_comms_rows(schedule) if replicated(schedule) else torch_csv_rows(schedule))
    return buf.getvalue()


def write_torch_csv(schedule: Schedule, path: str | PathLike) -> None:
    """Write :func:`to_torch_csv` to ``path`` (checked before the file is opened)."""
    write_aside(path, to_torch_csv(schedule))
