"""pipeflow-compare's W&B report and the upload of offline runs, offline and without an account.

The report is checked on the objects build_report returns and on the spec each panel
turns into (what W&B would store), with the network shut off: building must not need
it. Runsets are checked through the functions wandb-workspaces itself uses to turn
their filter string and grouping into the stored spec, since converting a whole
Runset looks its project up on the server. Offline runs are real ones, made with
``wandb.init(mode="offline")`` against a throw-away W&B home; ``wandb sync`` itself is
replaced by a recording stand-in, except in the test that lets it fail for want of
credentials, which it does before any network access.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr
from wandb_workspaces import expr
from wandb_workspaces.reports.v2 import interface

from pipeflow.compare import wandb_report
from pipeflow.compare.wandb_report import (
    LOSS_X_AXES,
    WandbSyncError,
    build_report,
    group_by_config_key,
    sync_offline_runs,
)

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

TABLE = "| schedule | mean_tokens_per_s |\n|---|---|\n| 1f1b | 1234.5 |\n| gpipe | 987.6 |"
GROUPS = ["train-2026-11-21_10-00-00", "train-2026-11-21_11-30-00"]


@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection or W&B API client fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access while building a report")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(interface, "_get_api", refuse)


@pytest.fixture
def report(no_network):
    return build_report(entity="team", project="pipeflow", groups=GROUPS, title="1F1B vs GPipe",
                        description="two sweeps, three seeds each", table_markdown=TABLE)


def panel_grid(report):
    (grid,) = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    return grid


def panel_spec(panel) -> dict:
    return panel._to_model().model_dump(by_alias=True, exclude_none=True)


def test_report_has_its_blocks_title_and_table(report):
    assert (report.entity, report.project) == ("team", "pipeflow")
    assert report.title == "1F1B vs GPipe"
    assert report.description == "two sweeps, three seeds each"
    kinds = [type(b) for b in report.blocks]
    assert kinds.count(wr.PanelGrid) == 1 and wr.H2 in kinds
    (markdown,) = [b for b in report.blocks if isinstance(b, wr.MarkdownBlock)]
    assert markdown.text == TABLE
    # the table comes after the W&B panels, under its own heading
    assert kinds.index(wr.MarkdownBlock) > kinds.index(wr.PanelGrid)
    assert kinds[kinds.index(wr.MarkdownBlock) - 2] is wr.H2


def test_runset_is_the_groups_grouped_by_schedule_name(report):
    (runset,) = panel_grid(report).runsets
    assert (runset.entity, runset.project) == ("team", "pipeflow")
    stored = expr.expr_to_filters(runset.filters)
    assert stored.op == "IN"
    assert (stored.key.section, stored.key.name) == ("run", "group")
    assert stored.value == GROUPS
    (grouping,) = [expr.groupby_str_to_key(g) for g in runset.groupby]
    # W&B stores a nested config {"schedule": {"name": ...}} as schedule.value.name
    assert (grouping.section, grouping.name) == ("config", "schedule.value.name")


def test_loss_is_plotted_against_step_samples_and_updates(report):
    lines = [p for p in panel_grid(report).panels if isinstance(p, wr.LinePlot)]
    configs = [panel_spec(p)["config"] for p in lines]
    assert [c["xAxis"] for c in configs] == ["_step", "samples", "updates", "train_time"] == list(LOSS_X_AXES)
    for c in configs:
        assert c["metrics"] == ["loss"]
        assert c["groupBy"] == "schedule.value.name"
        assert c["aggregate"] is True and c["groupAgg"] == "mean" and c["groupArea"] == "minmax"
        assert 0 < c["smoothingWeight"] <= 0.5


def test_bars_show_the_summary_keys(report):
    bars = [panel_spec(p)["config"] for p in panel_grid(report).panels if isinstance(p, wr.BarPlot)]
    assert [b["metrics"] for b in bars] == [["summary_metrics.mean_tokens_per_s"],
                                            ["summary_metrics.measured_bubble_ratio"]]
    assert {b["groupBy"] for b in bars} == {"schedule.value.name"}


def test_run_comparer_and_a_layout_without_overlaps(report):
    panels = panel_grid(report).panels
    assert sum(isinstance(p, wr.RunComparer) for p in panels) == 1
    cells = [(x, y) for p in panels for x in range(p.layout.x, p.layout.x + p.layout.w)
             for y in range(p.layout.y, p.layout.y + p.layout.h)]
    assert len(cells) == len(set(cells))
    assert max(p.layout.x + p.layout.w for p in panels) <= 24


def test_custom_keys_and_a_dotted_group_by(no_network):
    report = build_report(entity="team", project="p", groups=["g"], title="t", description="",
                          table_markdown=TABLE, group_by="pipeline.microbatches", loss_key="val_loss",
                          throughput_key="samples", bubble_key="mean_step_time")
    grid = panel_grid(report)
    (grouping,) = [expr.groupby_str_to_key(g) for g in grid.runsets[0].groupby]
    assert grouping.name == "pipeline.value.microbatches"
    specs = [panel_spec(p)["config"] for p in grid.panels if isinstance(p, (wr.LinePlot, wr.BarPlot))]
    assert [s["metrics"] for s in specs] == [["val_loss"]] * len(LOSS_X_AXES) + [["summary_metrics.samples"],
                                                                   ["summary_metrics.mean_step_time"]]
    assert {s["groupBy"] for s in specs} == {"pipeline.value.microbatches"}


def test_group_by_config_key():
    assert group_by_config_key("schedule") == "schedule.name"
    assert group_by_config_key("model") == "model.name"
    assert group_by_config_key("pipeline.stages") == "pipeline.stages"
    with pytest.raises(ValueError):
        group_by_config_key("schedule.")


def test_publish_saves_and_returns_the_report_url(report, monkeypatch):
    saved = []

    def fake_save(self, draft=False, clone=False):  # the server's answer: the new view's id
        saved.append(draft)
        self.id = "Vmlldzo0Mg"
        return self

    monkeypatch.setattr(wr.Report, "save", fake_save)
    monkeypatch.setattr(interface, "_get_api", lambda: None)
    monkeypatch.setattr(interface, "get_app_url", lambda api: "https://wandb.example")
    url = wandb_report.publish(report)
    assert saved == [False]  # published, not a draft
    assert url == "https://wandb.example/team/pipeflow/reports/1F1B-vs-GPipe--Vmlldzo0Mg"


@pytest.mark.parametrize("groups", [[], ["lr=0.1"], ["a<b"]])
def test_refuses_groups_it_cannot_filter_on(no_network, groups):
    with pytest.raises(ValueError, match="group"):
        build_report(entity="team", project="p", groups=groups, title="t", description="", table_markdown="")


def test_a_long_title_is_cut_to_what_wandb_accepts(no_network):
    report = build_report(entity="team", project="p", groups=["g"], title="x" * 300, description="",
                          table_markdown="")
    assert len(report.title) == 128 and report.title.endswith("…")


# ---------------------------------------------------------------------------- wandb sync


def offline_run(run_dir: Path) -> Path:
    """A real offline W&B run logged into run_dir, as MetricsSink makes one; its folder."""
    import wandb

    run = wandb.init(mode="offline", dir=str(run_dir), project="pipeflow-tests", group="g",
                     config={"schedule": {"name": "1f1b"}},
                     settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
    for step in range(1, 4):
        run.log({"loss": 1.0 / step, "samples": 8 * step}, step=step)
    run.finish()
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    return folder


def mark_synced(folder: Path) -> None:
    for f in folder.glob("*.wandb"):
        f.with_suffix(".wandb.synced").touch()


@pytest.fixture
def two_runs(wandb_home, tmp_path):
    """Two run dirs with one offline run each, the first already synced."""
    done, todo = tmp_path / "run_a", tmp_path / "run_b"
    folders = offline_run(done), offline_run(todo)
    mark_synced(folders[0])
    return (done, todo), folders


def test_sync_skips_synced_runs_and_syncs_the_others(two_runs, monkeypatch):
    (done, todo), (synced_folder, pending_folder) = two_runs
    calls = []

    def fake_sync(cmd, **kwargs):
        calls.append((cmd, kwargs))
        for arg in cmd:
            if Path(arg).name.startswith("offline-run-"):
                mark_synced(Path(arg))  # what wandb-core does after an upload
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wandb_report.subprocess, "run", fake_sync)
    assert sync_offline_runs([done, todo], project="pipeflow-compare") == [pending_folder]
    (cmd, kwargs), = calls
    assert cmd[1:4] == ["-m", "wandb", "sync"]
    assert cmd[cmd.index("--project") + 1] == "pipeflow-compare"
    assert str(pending_folder.resolve()) in cmd
    assert not any(synced_folder.name in arg for arg in cmd)
    assert kwargs["stdin"] is subprocess.DEVNULL
    # a second pass finds nothing left to do
    assert sync_offline_runs([done, todo]) == [] and len(calls) == 1


def test_a_sync_that_leaves_the_run_unsynced_is_an_error(two_runs, monkeypatch):
    (_, todo), _ = two_runs
    # wandb sync exits 0 having only printed this, when it finds no credentials to use
    monkeypatch.setattr(wandb_report.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", "wandb: Not authenticated.\n"))
    with pytest.raises(WandbSyncError, match="Not authenticated") as err:
        sync_offline_runs([todo])
    assert str(todo) in str(err.value)


def test_real_wandb_sync_without_credentials_fails_naming_the_run_dir(two_runs):
    (_, todo), (_, pending_folder) = two_runs
    with pytest.raises(WandbSyncError) as err:
        sync_offline_runs([todo])
    message = str(err.value)
    assert str(todo) in message and "API key" in message
    assert not list(pending_folder.glob("*.wandb.synced"))
