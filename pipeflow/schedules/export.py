"""Export a schedule to PyTorch pipelining's "compute_only" CSV format.

One row per rank, one cell per compute action, written the way
``torch.distributed.pipelining.schedules._Action`` prints and parses them:
``<stage><F|B|I|W><microbatch>``, e.g. ``0F3``, ``1B2``, ``2I1``, ``2W1``. torch loads
such a file with ``_PipelineScheduleRuntime._load_csv``, validates it, and lowers it to
send/recv actions itself; torchtitan reads the same file through its
``pipeline_parallel_schedule_csv`` option.

Only what torch's runtime can express is exported: one pipeline (torch maps every stage
to exactly one rank), no sequence segments, synchronous weights (torch flushes every
step), and a chain of stages (torch only talks to stage +-1). REDUCE and STEP are
dropped: torch adds its own gradient reduction and the optimizer step is the caller's.
"""

from __future__ import annotations

import csv
import io
from os import PathLike

from .ir import Kind, Schedule, WeightPolicy


def check_exportable(schedule: Schedule) -> None:
    """Raise ValueError saying why torch's runtime could not run this schedule."""
    name = schedule.name
    if schedule.placement.num_pipes != 1:
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


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule as torch's compute_only CSV text; ValueError says why if it cannot be."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows(torch_csv_rows(schedule))
    return buf.getvalue()


def write_torch_csv(schedule: Schedule, path: str | PathLike) -> None:
    """Write :func:`to_torch_csv` to ``path`` (checked before the file is opened)."""
    text = to_torch_csv(schedule)
    with open(path, "w", newline="") as f:
        f.write(text)
