"""The W&B side of pipeflow-compare: :func:`build_report` assembles the comparison as a W&B
report (``wandb_workspaces.reports.v2``, no network), :func:`publish` saves it, and
:func:`sync_offline_runs` first uploads the offline runs it shows (``wandb sync``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import wandb_workspaces.reports.v2 as wr

__all__ = ["LOSS_X_AXES", "WandbSyncError", "build_report", "group_by_config_key", "publish",
           "sync_offline_runs"]

# History keys the loss is plotted against: the training step (W&B's _step, which
# MetricsSink sets to the step), samples consumed, optimizer updates and seconds of
# training. Schedules differ in samples per step and, when asynchronous, in updates
# per step, so only these together say which schedule learns faster per unit of work
# and per second.
LOSS_X_AXES = ("_step", "samples", "updates", "train_time")

# Light exponential smoothing: step-to-step noise damped, the shape of the curve kept.
_SMOOTHING = 0.3
# Runs of one group (schedule) are drawn as their mean with a min-max band: with the
# few seeds a sweep usually has, the band shows every run rather than an estimate.
_AGG, _BAND = "mean", "minmax"
# Characters that wandb-workspaces 0.4 rewrites inside a filter's string literals (it re-parses
# the filter after turning "=" into "==", "<" into "<="): a group named with one is refused.
_FILTER_MANGLED = set("=<>")
# A report title longer than this fails W&B's validation.
_MAX_TITLE = 128


class WandbSyncError(RuntimeError):
    """``wandb sync`` failed for a run directory, or left runs in it unsynced."""


def group_by_config_key(group_by: str) -> str:
    """The run config key ``group_by`` means: a bare name is a config group and stands for its
    option's ``<group>.name``; a dotted key is itself. ValueError for an empty or dangling key."""
    if not group_by or group_by.startswith(".") or group_by.endswith("."):
        raise ValueError(f"not a config key to group by: {group_by!r}")
    return group_by if "." in group_by else f"{group_by}.name"


def build_report(*, entity: str | None, project: str, groups: list[str], title: str, description: str,
                 table_markdown: str, group_by: str = "schedule",
                 loss_key: str = "loss", throughput_key: str = "mean_tokens_per_s",
                 bubble_key: str = "measured_bubble_ratio") -> "wr.Report":
    """The report object, not yet saved (no network unless ``entity`` is None, the logged-in
    user's default): the runs of the W&B ``groups`` grouped by ``group_by``, ``loss_key``
    against each of :data:`LOSS_X_AXES`, bars of ``throughput_key`` and ``bubble_key``, a run
    comparer and ``table_markdown``. ValueError for a group name wandb-workspaces would mangle."""
    import wandb_workspaces.reports.v2 as wr

    if not groups:
        raise ValueError("no W&B groups given: the report would show every run of the project")
    for group in groups:
        if _FILTER_MANGLED & set(group):
            raise ValueError(f"W&B group {group!r} contains one of {''.join(sorted(_FILTER_MANGLED))}, "
                             "which wandb-workspaces rewrites in run filters; rename the group")
    if entity is None:
        import wandb

        entity = wandb.Api().default_entity
    if not entity:
        raise ValueError("no W&B entity given")
    key = group_by_config_key(group_by)

    runset = wr.Runset(
        entity=entity,
        project=project,
        name="Compared runs",
        # repr() quotes each name as a Python literal, which is what the filter parser reads
        filters=f"Metric('Group') in {list(groups)!r}",
        groupby=[f"config.{key}"],  # a Runset inserts W&B's ".value"; a panel takes wr.Config(key)
    )
    rows = -(-len(LOSS_X_AXES) // 2)  # of line plots
    panels = [
        wr.LinePlot(
            title=f"{loss_key} vs {x}", x=x, y=[loss_key],
            groupby=wr.Config(key), groupby_aggfunc=_AGG, groupby_rangefunc=_BAND,
            smoothing_type="exponential", smoothing_factor=_SMOOTHING,
            layout=wr.Layout(x=12 * (i % 2), y=8 * (i // 2), w=12, h=8),  # two per row
        )
        for i, x in enumerate(LOSS_X_AXES)
    ]
    panels += [
        wr.BarPlot(
            title=f"{metric} (run summary)", metrics=[wr.SummaryMetric(metric)], orientation="v",
            groupby=wr.Config(key), groupby_aggfunc=_AGG, groupby_rangefunc=_BAND,
            layout=wr.Layout(x=12 * i, y=8 * rows, w=12, h=8),
        )
        for i, metric in enumerate((throughput_key, bubble_key))
    ]
    # diff_only: the config keys the compared runs share would bury the few that differ
    panels.append(wr.RunComparer(diff_only="split", layout=wr.Layout(x=0, y=8 * (rows + 1), w=24, h=12)))

    groups_text = ", ".join(groups)
    blocks = [
        wr.H2("Runs on W&B"),
        wr.P(f"The runs of W&B group(s) {groups_text}, grouped by config {key}: "
             f"the {_AGG} of each group with its {_BAND} band, loss lightly smoothed."),
        wr.PanelGrid(runsets=[runset], panels=panels),
        wr.H2("Local comparison"),
        wr.P("The table pipeflow-compare computed from the run directories."),
        wr.MarkdownBlock(text=table_markdown),
    ]
    if len(title) > _MAX_TITLE:
        title = title[: _MAX_TITLE - 1] + "…"
    return wr.Report(entity=entity, project=project, title=title, description=description,
                     blocks=blocks, width="fluid")


def publish(report: "wr.Report") -> str:
    """Save the report to W&B and return its URL (network and credentials); a project that
    does not exist fails here."""
    report.save()
    return report.url


def sync_offline_runs(run_dirs: list[Path], *, entity: str | None = None,
                      project: str | None = None) -> list[Path]:
    """Upload, with ``wandb sync``, the offline runs under each run dir
    (``<run_dir>/wandb/offline-run-*``) not yet synced; return those synced. ``entity`` and
    ``project`` override where they go. WandbSyncError naming the run dir, with wandb's
    message, where a run is left without its ``.wandb.synced`` marker."""
    synced: list[Path] = []
    for run_dir in map(Path, run_dirs):
        pending = [d for d in sorted((run_dir / "wandb").glob("offline-run-*")) if _unsynced(d)]
        if not pending:
            continue
        cmd = [sys.executable, "-m", "wandb", "sync"]
        if entity:
            cmd += ["--entity", entity]
        if project:
            cmd += ["--project", project]
        cmd += [str(d.resolve()) for d in pending]
        # cwd: wandb writes its CLI debug log under ./wandb, which belongs with the run;
        # stdin closed: a sync that wants to prompt for a key fails instead of waiting
        # wandb sync exits 0 on some failures ("Not authenticated."): its synced marker says
        proc = subprocess.run(cmd, cwd=run_dir, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        left = [d.name for d in pending if _unsynced(d)]
        if proc.returncode != 0 or left:
            message = "\n".join(s.strip() for s in (proc.stderr, proc.stdout) if s and s.strip())
            status = f"exit status {proc.returncode}" + (f", still unsynced: {', '.join(left)}" if left else "")
            raise WandbSyncError(f"wandb sync of the offline runs in {run_dir} failed ({status}): "
                                 f"{message or 'wandb printed nothing'}")
        synced += pending
    return synced


def _unsynced(offline_run: Path) -> bool:
    """Whether the offline run directory has a ``.wandb`` file without its synced marker."""
    return any(not f.with_suffix(".wandb.synced").exists() for f in offline_run.glob("*.wandb"))
