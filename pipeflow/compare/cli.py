"""pipeflow-compare: one report comparing training and simulation runs side by side.

    pipeflow-compare outputs/multirun/train/2026-11-21/17-05-12
    pipeflow-compare RUN_DIR OTHER_RUN_DIR outputs/multirun/simulate/... out=reports/sched
    pipeflow-compare outputs/multirun/train/... report=wandb     # also a W&B report when online

Arguments are run or multirun directories (any mix) and key=value settings (below).
Writes into out (default outputs/compare/<date>/<time>): report.html, the figures as PNGs,
runs.csv (one row per run) and configurations.csv (means over seeds). Runs that stopped
early are reported as such. A measured run with a simulation of its configuration gets
the simulator's deviation (sim_error), flagged beyond 10% on up to 2 ranks, 15% on more
(sim_tolerance=FRACTION for another), with a caution saying why they can differ."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .caution import console_caution
from .fmt import cell, header
from .report import Report, write_report
from .runs import UNFINISHED, UNTRAINED, CompareInputError, Run, find_runs
from .table import group_table, run_table, target_loss

__all__ = ["CompareConfig", "WandbReportConfig", "compare", "parse_args", "main", "REPORTS"]

REPORTS = ("local", "wandb")


@dataclass
class WandbReportConfig:
    project: Optional[str] = None  # null: the project the runs logged to (logger.project), else "pipeflow"
    entity: Optional[str] = None  # null: the runs' logger.entity, else your default W&B entity


@dataclass
class CompareConfig:
    out: Optional[str] = None  # null: outputs/compare/<date>/<time>
    report: str = "local"  # local: files only; wandb: also a W&B report when W&B is online
    target_loss: Optional[float] = None  # null: the highest final loss among finished configurations
    smooth: int = 5  # trailing mean over this many logged steps, for curves and time-to-target
    title: Optional[str] = None  # null: "pipeflow comparison: <the schedules>"
    # largest |simulated - measured| / measured step time within target; null: the
    # fidelity targets (table.SIM_TOLERANCE_*: 10% on up to 2 ranks, 15% on more)
    sim_tolerance: Optional[float] = None
    overwrite: bool = False  # write into an out folder that holds another report or runs
    wandb: WandbReportConfig = field(default_factory=WandbReportConfig)


class CompareConfigError(ValueError):
    """A pipeflow-compare setting that cannot be used; the message names the key."""


_USAGE = ("usage: pipeflow-compare RUN_OR_MULTIRUN_DIR [...] [key=value ...]\n"
          "settings: out=DIR, overwrite=true, report=local|wandb, target_loss=FLOAT, smooth=N, title=TEXT, sim_tolerance=FRACTION, "
          "wandb.project=NAME, wandb.entity=NAME")


REPORT_FILES = ("report.html", "runs.csv", "configurations.csv")
RUN_FILES = ("summary.json", "metrics.jsonl", "config.json", ".hydra")


def check_report_dir(out: Path, inputs: list[Path], overwrite: bool) -> None:
    """CompareConfigError where ``out`` is (or lies inside) a run being compared or, unless
    ``overwrite``, holds another report or runs."""
    target = out.expanduser().resolve()
    for p in inputs:
        src = p.expanduser().resolve()
        if target == src and any((src / f).exists() for f in RUN_FILES) or src in target.parents:
            raise CompareConfigError(f"out={out}: it is (or lies inside) {p}, a run being compared; "
                                     f"write the report elsewhere")
    if overwrite or not target.is_dir():
        return
    held = [f for f in REPORT_FILES if (target / f).exists()]
    runs = [d.name for d in [target, *sorted(target.iterdir())] if d.is_dir() and (d / "summary.json").exists()
            or (d / "metrics.jsonl").exists()]
    if held or runs:
        what = f"another report ({', '.join(held)})" if held else f"runs ({', '.join(runs[:3])})"
        raise CompareConfigError(f"out={out}: the folder holds {what}; give a new folder, or overwrite=true "
                                 f"to write over it")


def parse_args(argv: list[str]) -> tuple[list[str], CompareConfig]:
    """Split argv into directories and settings; check the settings."""
    paths, dotlist = [], []
    for arg in argv:
        if "=" in arg and not Path(arg).exists():
            dotlist.append(arg)
        else:
            paths.append(arg)
    schema = OmegaConf.structured(CompareConfig)
    allowed = sorted([f.name for f in fields(CompareConfig) if f.name != "wandb"]
                     + [f"wandb.{f.name}" for f in fields(WandbReportConfig)])
    for item in dotlist:
        key = item.split("=", 1)[0]
        if key not in allowed:
            raise CompareConfigError(f"unknown setting {key!r}; allowed: {', '.join(allowed)}")
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "a setting"
        raise CompareConfigError(f"{key}: {str(err).splitlines()[0]}") from None
    conf: CompareConfig = OmegaConf.to_object(cfg)
    if conf.report not in REPORTS:
        raise CompareConfigError(f"report={conf.report}: allowed values are {', '.join(REPORTS)}")
    if conf.smooth < 1:
        raise CompareConfigError(f"smooth={conf.smooth}: must be 1 or more (1: no smoothing)")
    if conf.sim_tolerance is not None and not conf.sim_tolerance > 0:
        raise CompareConfigError(f"sim_tolerance={conf.sim_tolerance}: must be a fraction above 0 (0.1: within 10%)")
    if not paths:
        raise CompareConfigError("no run directory given\n" + _USAGE)
    if conf.out:
        from pipeflow.config.command_line import check_output_dir
        from pipeflow.config import ConfigError

        check_report_dir(Path(conf.out), [Path(p) for p in paths], conf.overwrite)

        try:  # before any run is read: a folder that cannot be written is refused in one line
            check_output_dir("out", conf.out)
        except ConfigError as err:
            raise CompareConfigError(str(err)) from None
    return paths, conf


def compare(paths: list[str], cfg: CompareConfig) -> tuple[list[Run], list[dict], Report]:
    """Read the runs under ``paths`` and write the local report; return the runs, the
    per-run table and the report's files."""
    runs = find_runs(paths)
    target = cfg.target_loss if cfg.target_loss is not None else target_loss(runs, cfg.smooth)
    table = run_table(runs, target, cfg.smooth, cfg.sim_tolerance)
    groups = group_table(runs, table)
    out = Path(cfg.out) if cfg.out else Path("outputs/compare") / f"{datetime.now():%Y-%m-%d/%H-%M-%S}"
    schedules = ", ".join(dict.fromkeys(r.schedule for r in runs))
    title = cfg.title or f"pipeflow comparison: {schedules}"
    report = write_report(runs, table, groups, out, title=title, inputs=[str(p) for p in paths], target=target,
                          window=cfg.smooth)
    return runs, table, report


_CONSOLE = ["label", "seed", "status", "final_loss", "tokens_per_s", "step_time_s", "bubble", "time_to_target_s",
            "sim_step_time", "sim_error", "sim_flag"]


def format_table(table: list[dict]) -> str:
    """The console summary: a line per run, the columns named and rounded as on the page."""
    cols = [c for c in _CONSOLE if c in ("label", "status") or any(r.get(c) is not None for r in table)]
    heads = ["sim step (s)" if c == "sim_step_time" else "sim error" if c == "sim_error" else
             "sim flag" if c == "sim_flag" else header(c) for c in cols]
    rows = [[cell(r.get(k), k) for k in cols] for r in table]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(heads, widths)))]
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
              for row in rows]
    return "\n".join(lines)


def wandb_report(runs: list[Run], table: list[dict], cfg: CompareConfig, title: str) -> str:
    """Create the W&B report when W&B is online and return a line saying what happened."""
    from pipeflow.tracking.sink import resolve_wandb_mode, wandb_credentials

    mode = resolve_wandb_mode("auto")
    if mode != "online":
        found, why = wandb_credentials()
        reason = f"WANDB_MODE={os.environ['WANDB_MODE']}" if os.environ.get("WANDB_MODE") else why
        return (f"W&B is offline ({reason}): no W&B report was made; the local report above is complete. "
                f"Log in (`wandb login`) and run again with report=wandb to publish it.")
    from . import wandb_report as wr

    measured = [r for r in runs if r.kind == "measured"]
    loggers = [r.config.get("logger") or {} for r in measured]
    groups = sorted({lg["group"] for lg in loggers if lg.get("group")})
    if not groups:
        return ("no W&B report: none of these runs was logged in a W&B group (a multirun puts its jobs in one; "
                "a single run needs logger.group=NAME); the local report above is complete.")
    project = cfg.wandb.project or next((lg["project"] for lg in loggers if lg.get("project")), "pipeflow")
    entity = cfg.wandb.entity or next((lg["entity"] for lg in loggers if lg.get("entity")), None)
    # runs logged offline are uploaded first: the report can only show runs the server has
    wr.sync_offline_runs([r.path for r in measured], entity=entity, project=project)
    report = wr.build_report(entity=entity, project=project, groups=groups, title=title,
                             description=f"{len(runs)} runs compared by pipeflow-compare",
                             table_markdown=markdown_table(table))
    return f"W&B report: {wr.publish(report)}"


def markdown_table(table: list[dict]) -> str:
    cols = ["run", "label", "status", "final_loss", "best_loss", "time_to_target_s", "tokens_per_s", "bubble",
            "sim_step_time", "sim_error", "sim_flag"]
    cols = [c for c in cols if any(r.get(c) is not None for r in table)]

    lines = ["| " + " | ".join(header(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c), c).replace("|", "/") for c in cols) + " |" for r in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + _USAGE)  # plain text, no markup: it is the help
        return 0 if argv else 2
    try:
        paths, cfg = parse_args(argv)
        runs, table, report = compare(paths, cfg)
    except (CompareConfigError, CompareInputError) as err:
        print(f"pipeflow-compare: {err}", file=sys.stderr)
        return 2
    print(format_table(table))
    unpaired = [r for r in table if r.get("sim_unpaired")]
    if unpaired:
        print("\nnot paired with a simulation: " + "; ".join(f"{r['run']}: {r['sim_unpaired']}" for r in unpaired))
    if report.cautions:
        print("\ncaution: simulated step time deviates from measured beyond the target for: "
              + "; ".join(report.cautions))
        print(console_caution(report.disagreements))
    errors = {r.name: r.error for r in runs}
    for what, statuses in (("did not finish", UNFINISHED), ("ran to the end and trained nothing usable", UNTRAINED)):
        rows = [r for r in table if r["status"] in statuses]
        if rows:
            print(f"\n{len(rows)} of {len(table)} runs {what}: "
                  + "; ".join(f"{r['run']} ({r['status']}" + (f": {errors[r['run']]}" if errors.get(r['run']) else "")
                              + ")" for r in rows))
    print(f"\nwrote {', '.join(p.name for p in report.files)} to {report.out_dir}")
    if cfg.report == "wandb":
        print(wandb_report(runs, table, cfg, report.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
