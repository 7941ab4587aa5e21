"""The local report: PNG figures (``convergence.png``, ``throughput.png``, ``memory.png``,
``step_time.png``; each only when the runs have what it draws), CSV tables at full
precision and one self-contained HTML page (:mod:`.page`). Every figure is at most
:data:`WIDTH_IN` inches wide at :data:`DPI`; what each shows: docs/comparing.md."""

from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import Any

from pipeflow.formats.files import write_aside

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from matplotlib.ticker import FuncFormatter, PercentFormatter  # noqa: E402

from .fmt import MIB, human_bytes, percent, significant  # noqa: E402
from .page import render_page  # noqa: E402
from .runs import UNFINISHED, UNTRAINED, Run  # noqa: E402
from .table import (GROUP_COLUMNS, RUN_COLUMNS, X_AXES, by_label, series, sim_cautions, sim_disagreements,  # noqa: E402
                    sim_in_seconds, smoothed)

__all__ = ["write_report", "Report", "WIDTH_IN", "DPI"]

WIDTH_IN = 12.5  # every figure's width in inches: 1375 px at DPI, within a 1400 px page
DPI = 110
# drawn dashed, ending in a cross (an empty run has no line to draw)
_UNFINISHED = tuple(s for s in (*UNFINISHED, *UNTRAINED) if s != "empty")


class Report:
    """What :func:`write_report` wrote: its title, the files' paths, the figures by name and the
    configurations whose simulated step time is beyond the fidelity target."""

    def __init__(self, out_dir: Path, title: str):
        self.out_dir = out_dir
        self.title = title
        self.figures: dict[str, Path] = {}
        self.files: list[Path] = []
        self.cautions: list[str] = []
        self.disagreements: list[dict] = []  # their group rows (:func:`pipeflow.compare.table.sim_disagreements`)

    @property
    def html(self) -> Path:
        return self.out_dir / "report.html"


def _colours(labels: list[str]) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


# a marker shape per configuration as well as a colour: synchronous schedules compute
# the same losses, and their curves lie exactly on top of each other
_MARKERS = "osD^vP*Xph<>"


def _marker(colours: dict, label: str) -> str:
    return _MARKERS[list(colours).index(label) % len(_MARKERS)]


def _aggregate(members: list[Run], x: str, window: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean curve of a configuration over its runs, step by step: at each logged step,
    x and y averaged over the runs that logged it, and the lowest and highest y."""
    per_step: dict[int, list[tuple[float, float]]] = {}
    for run in members:
        steps, _ = series(run, "step")
        xs, ys = series(run, x)
        for s, xv, yv in zip(steps, xs, smoothed(ys, window)):
            per_step.setdefault(int(s), []).append((xv, yv))
    xs, mean, lo, hi = [], [], [], []
    for s in sorted(per_step):
        pts = per_step[s]
        xs.append(statistics.fmean(p[0] for p in pts))
        ys = [p[1] for p in pts]
        mean.append(statistics.fmean(ys))
        lo.append(min(ys))
        hi.append(max(ys))
    return xs, mean, lo, hi


def _convergence(runs: list[Run], colours: dict, window: int, path: Path) -> Path | None:
    measured = [r for r in runs if r.kind == "measured" and any("loss" in row for row in r.rows)]
    if not measured:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH_IN, 8.5))
    for ax, x in zip(axes.flat, X_AXES):
        for label, members in by_label(measured).items():
            colour = colours[label]
            finished = [m for m in members if m.status == "finished"]
            if finished:
                xs, mean, lo, hi = _aggregate(finished, x, window)
                name = label if len(finished) == 1 else f"{label} (mean of {len(finished)})"
                ax.plot(xs, mean, color=colour, lw=1.6, label=name, marker=_marker(colours, label),
                        markevery=max(1, len(xs) // 8), ms=5, mfc="none")
                if len(finished) > 1:
                    ax.fill_between(xs, lo, hi, color=colour, alpha=0.2, lw=0)
            for run in members:
                if run.status not in _UNFINISHED:
                    continue
                xs, ys = series(run, x)
                if not xs:
                    continue
                ys = smoothed(ys, window)
                ax.plot(xs, ys, color=colour, lw=1.3, ls="--",
                        label=f"{label} ({run.status} at step {run.steps_done})")
                ax.plot(xs[-1:], ys[-1:], marker="x", color=colour, ms=9, mew=2)
        ax.set_xlabel(X_AXES[x])
        ax.set_ylabel("training loss" + (f" (mean of last {window} steps)" if window > 1 else ""))
        ax.grid(alpha=0.3)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(3, max(1, len(names))), fontsize=8, frameon=False)
    fig.suptitle("Convergence")
    rows = -(-len(names) // 3)
    fig.tight_layout(rect=(0, min(0.3, 0.02 + 0.03 * rows), 1, 1))
    write_aside(path, lambda f: fig.savefig(f, dpi=DPI, format="png"))
    plt.close(fig)
    return path


def _bars(ax, labels: list[str], values: list[list[float]], colours: dict, title: str, xlabel: str, *,
          share: bool = False) -> None:
    """One horizontal bar per label: the mean of its values, whiskers lowest to highest
    (``share``: fractions, read as percentages)."""
    means = [statistics.fmean(v) if v else 0.0 for v in values]
    err = [[m - min(v) if v else 0 for m, v in zip(means, values)],
           [max(v) - m if v else 0 for m, v in zip(means, values)]]
    pos = list(range(len(labels)))
    ax.barh(pos, means, color=[colours[label] for label in labels], xerr=err, capsize=3)
    for p, v, m, up in zip(pos, values, means, err[1]):
        text = (percent(m, sign=False) if share else significant(m, 3)) if v else "n/a"
        ax.text(m + up, p, f"  {text}", ha="left", va="center", fontsize=8)
    ax.set_yticks(pos, labels, fontsize=8)
    ax.invert_yaxis()  # first configuration on top, as in the tables
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if share:
        ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.margins(x=0.15)
    ax.grid(axis="x", alpha=0.3)


def _height(n: int) -> float:
    """Inches of a panel of ``n`` horizontal bars."""
    return max(3.0, 1.2 + 0.45 * n)


def _values(table: list[dict], labels: list[str], key: str) -> list[list[float]]:
    return [[r[key] for r in table if r["label"] == label and r.get(key) is not None] for label in labels]


def _throughput(table: list[dict], colours: dict, path: Path) -> Path | None:
    labels = list(dict.fromkeys(r["label"] for r in table if r["kind"] == "measured"))
    tps = _values(table, labels, "tokens_per_s")
    if not any(tps):
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(WIDTH_IN, _height(len(labels))))
    _bars(a, labels, tps, colours, "Throughput", "tokens / s (steady half of the run)")
    _bars(b, labels, _values(table, labels, "bubble"), colours, "Measured bubble ratio",
          "1 - busy / (ranks x step time)", share=True)
    fig.tight_layout()
    write_aside(path, lambda f: fig.savefig(f, dpi=DPI, format="png"))
    plt.close(fig)
    return path


_BYTES = FuncFormatter(lambda mib, _: human_bytes(mib * MIB, trim=True))  # an axis in MiB, read as bytes


def _per_rank(ax, series_of: dict[str, list[float]], colours: dict, title: str, xlabel: str) -> None:
    labels = list(series_of)
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        vals = series_of[label]
        ax.bar([r + (i - (len(labels) - 1) / 2) * width for r in range(len(vals))], vals, width,
               color=colours[label], label=label)
    ax.set_xticks(range(max(len(v) for v in series_of.values())))
    ax.set_xlabel(xlabel)
    ax.yaxis.set_major_formatter(_BYTES)
    ax.set_title(title, fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False,
              ncol=min(3, len(labels)))


def _memory(runs: list[Run], colours: dict, path: Path) -> Path | None:
    def per_rank(key: str, kind: str = "measured", source=None) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for label, members in by_label(r for r in runs if r.kind == kind and r.status == "finished").items():
            lists = [source(m) if source else (m.summary or {}).get(key) for m in members]
            lists = [v for v in lists if v]
            if lists:  # the mean over seeds, rank by rank
                out[label] = [statistics.fmean(col) / MIB for col in zip(*lists)]
        return out

    panels = [
        (per_rank("peak_memory_bytes"), "Peak memory per rank (CUDA allocated or process RSS)", "rank"),
        (per_rank("peak_saved_bytes"), "Peak saved activations per rank", "rank"),
        (per_rank("", "simulated", lambda m: [d.get("peak_activation_bytes", 0.0)
                                               for d in (m.summary or {}).get("per_device", [])]),
         "Simulated peak activations per device", "device"),
    ]
    panels = [p for p in panels if p[0]]
    if not panels:
        return None
    # two panels a row, so the figure keeps its width however many there are
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    legend_rows = max(-(-len(p[0]) // 3) for p in panels)
    fig, axes = plt.subplots(rows, cols, figsize=(WIDTH_IN, rows * (3.6 + 0.2 * legend_rows)), squeeze=False)
    for ax, (data, title, xlabel) in zip(axes.flat, panels):
        _per_rank(ax, data, colours, title, xlabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    write_aside(path, lambda f: fig.savefig(f, dpi=DPI, format="png"))
    plt.close(fig)
    return path


def _sim_source(runs: list[Run]) -> str:
    """The cost models and topologies of the simulated runs, e.g. "cost=analytic, local_cpu"."""
    pairs = dict.fromkeys(f"cost={((r.summary or {}).get('cost') or {}).get('name')}, "
                          f"{((r.summary or {}).get('topology') or {}).get('name')}"
                          for r in runs if r.kind == "simulated" and r.status == "finished")
    return "; ".join(pairs)


def _step_time(runs: list[Run], table: list[dict], groups: list[dict], colours: dict, path: Path) -> Path | None:
    """Measured against simulated step time for the configurations that have both (in
    seconds) across the top, then the simulated runs' iteration time and bubble ratio."""
    paired = [r for r in table if r["kind"] == "measured" and r.get("sim_error") is not None]
    sims = [r for r in table if r["kind"] == "simulated" and r.get("sim_step_time") is not None]
    if not paired and not sims:
        return None
    n_paired = len({r["label"] for r in paired})
    n_sims = len({r["label"] for r in sims})
    heights = ([_height(n_paired)] if paired else []) + ([_height(n_sims)] if sims else [])
    fig = plt.figure(figsize=(WIDTH_IN, sum(heights)))
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    if paired:
        ax = fig.add_subplot(grid[0, :])
        labels = list(dict.fromkeys(r["label"] for r in paired))
        measured = [statistics.fmean(v) for v in _values(paired, labels, "step_time_s")]
        simulated = [statistics.fmean(v) for v in _values(paired, labels, "sim_step_time")]
        pos = list(range(len(labels)))
        ax.barh([p - 0.2 for p in pos], measured, 0.4, color=[colours[label] for label in labels], label="measured")
        ax.barh([p + 0.2 for p in pos], simulated, 0.4, color=[colours[label] for label in labels], alpha=0.45,
                hatch="//", label="simulated")
        for p, label, sim, meas in zip(pos, labels, simulated, measured):
            group = next((g for g in groups if g["kind"] == "measured" and g["label"] == label), {})
            flagged = bool(group.get("sim_flag"))
            ax.text(meas, p - 0.2, f"  {significant(meas)} s", ha="left", va="center", fontsize=8)
            text = f"  {significant(sim)} s  {percent(statistics.fmean(_values(paired, [label], 'sim_error')[0]))}"
            if flagged and group.get("sim_tolerance") is not None:
                text += f" (beyond ±{percent(group['sim_tolerance'], sign=False)})"
            ax.text(sim, p + 0.2, text, ha="left", va="center", fontsize=8,
                    color="#b00000" if flagged else "#333333", fontweight="bold" if flagged else "normal")
        ax.margins(x=0.3)
        ax.set_yticks(pos, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"Step time: measured vs simulated ({_sim_source(runs)})")
        ax.set_xlabel("seconds per step")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(axis="x", alpha=0.3)
    if sims:
        row = len(heights) - 1
        labels = list(dict.fromkeys(r["label"] for r in sims))
        _bars(fig.add_subplot(grid[row, 0]), labels, _values(sims, labels, "sim_step_time"), colours,
              "Simulated iteration time per step", _sim_unit(runs))
        _bars(fig.add_subplot(grid[row, 1]), labels, _values(sims, labels, "sim_bubble"), colours,
              "Simulated bubble ratio", "idle / (devices x makespan)", share=True)
    fig.tight_layout()
    write_aside(path, lambda f: fig.savefig(f, dpi=DPI, format="png"))
    plt.close(fig)
    return path


def _sim_unit(runs: list[Run]) -> str:
    """The simulated runs' time unit: seconds unless a unit cost model was used."""
    sims = [r for r in runs if r.kind == "simulated"]
    if sims and not any(sim_in_seconds(r) for r in sims):
        return "unit times (cost=unit)"
    return "seconds (the cost model's prediction)"


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(rows: list[dict], columns: list[str], path: Path) -> Path:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({c: _csv_cell(row.get(c)) for c in columns})
    return write_aside(path, text.getvalue())


_CAPTIONS = {
    "convergence": "Loss against step, samples, optimizer updates and training time. Asynchronous "
                   "schedules apply several updates per step; samples and updates are what each run logged.",
    "throughput": "Throughput and measured bubble ratio over the steady (second) half of each run.",
    "memory": "Peak memory per rank.",
    "step_time": "Measured step time beside the simulated one for the same configuration, each simulated "
                 "bar marked with its deviation (simulated - measured) / measured; below, the simulated runs.",
}


def write_report(runs: list[Run], table: list[dict], groups: list[dict], out_dir: Path, *, title: str,
                 inputs: list[str], target: float | None, window: int) -> Report:
    """Write the figures, runs.csv, configurations.csv and report.html into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir, title)
    colours = _colours(list(dict.fromkeys(r.label for r in runs)))
    for name, draw in (
        ("convergence", lambda p: _convergence(runs, colours, window, p)),
        ("throughput", lambda p: _throughput(table, colours, p)),
        ("memory", lambda p: _memory(runs, colours, p)),
        ("step_time", lambda p: _step_time(runs, table, groups, colours, p)),
    ):
        path = draw(out_dir / f"{name}.png")
        if path is not None:
            report.figures[name] = path
    report.files += list(report.figures.values())
    report.files.append(write_csv(table, RUN_COLUMNS, out_dir / "runs.csv"))
    report.files.append(write_csv(groups, GROUP_COLUMNS, out_dir / "configurations.csv"))
    report.cautions = sim_cautions(groups, table)
    report.disagreements = sim_disagreements(groups, table)
    page = render_page(title=title, runs=runs, table=table, groups=groups, figures=report.figures,
                       captions=_CAPTIONS, inputs=inputs, target=target, window=window)
    write_aside(report.html, page)
    report.files.append(report.html)
    return report
