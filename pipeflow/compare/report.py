"""The local report: PNG figures, CSV tables and one self-contained HTML page.

Figures (each written only when the runs have what it draws):

- ``convergence.png``: loss against step, samples, optimizer updates and training time,
  one line per configuration (the mean over its seeds, with a band from the lowest to
  the highest seed), smoothed by a trailing mean; a run that crashed or stopped early
  is drawn dashed and ends in a cross at its last logged step;
- ``throughput.png``: tokens per second and the measured bubble ratio per configuration
  (bars: mean over seeds, whiskers: lowest to highest);
- ``memory.png``: peak memory and peak saved activations per rank, and the simulator's
  peak activation bytes per device for simulated runs;
- ``step_time.png``: measured step time beside the simulated iteration time where the
  inputs hold both (each simulated bar marked with its deviation from the measured one,
  and "beyond ±N%" when that is beyond the fidelity target), and the simulated bubble
  ratio.

When a measured and a simulated run of one configuration are among the inputs, the
page opens with a caution naming every configuration whose simulated step time deviates
from the measured one beyond the target (``sim_flag``), and the tables mark those cells.
"""

from __future__ import annotations

import base64
import csv
import html
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .runs import Run  # noqa: E402
from .table import (FEW_RANKS, GROUP_COLUMNS, RUN_COLUMNS, SIM_TOLERANCE_FEW_RANKS,  # noqa: E402
                    SIM_TOLERANCE_MANY_RANKS, X_AXES, by_label, percent, series, sim_cautions, sim_in_seconds,
                    smoothed)

__all__ = ["write_report", "Report"]

_MIB = 2**20
_UNFINISHED = ("crashed", "incomplete")


class Report:
    """What :func:`write_report` wrote: its title, the paths of the files, the figures by
    name, and the configurations whose simulated step time is beyond the fidelity target
    (:func:`pipeflow.compare.table.sim_cautions`)."""

    def __init__(self, out_dir: Path, title: str):
        self.out_dir = out_dir
        self.title = title
        self.figures: dict[str, Path] = {}
        self.files: list[Path] = []
        self.cautions: list[str] = []

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
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, labels: list[str], values: list[list[float]], colours: dict, title: str, xlabel: str) -> None:
    """One horizontal bar per label (labels read along the y axis, however long): the
    mean of its values, whiskers from the lowest to the highest."""
    means = [statistics.fmean(v) if v else 0.0 for v in values]
    err = [[m - min(v) if v else 0 for m, v in zip(means, values)],
           [max(v) - m if v else 0 for m, v in zip(means, values)]]
    pos = list(range(len(labels)))
    ax.barh(pos, means, color=[colours[label] for label in labels], xerr=err, capsize=3)
    for p, v, m, up in zip(pos, values, means, err[1]):
        ax.text(m + up, p, f"  {_short(m)}" if v else " n/a", ha="left", va="center", fontsize=8)
    ax.set_yticks(pos, labels, fontsize=8)
    ax.invert_yaxis()  # first configuration on top, as in the tables
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.margins(x=0.15)
    ax.grid(axis="x", alpha=0.3)


def _short(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _height(n: int) -> float:
    return max(3.0, 1.2 + 0.45 * n)


def _values(table: list[dict], labels: list[str], key: str) -> list[list[float]]:
    return [[r[key] for r in table if r["label"] == label and r.get(key) is not None] for label in labels]


def _throughput(table: list[dict], colours: dict, path: Path) -> Path | None:
    labels = list(dict.fromkeys(r["label"] for r in table if r["kind"] == "measured"))
    tps = _values(table, labels, "tokens_per_s")
    if not any(tps):
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, _height(len(labels))))
    _bars(a, labels, tps, colours, "Throughput", "tokens / s (steady half of the run)")
    _bars(b, labels, _values(table, labels, "bubble"), colours, "Measured bubble ratio",
          "1 - busy / (ranks x step time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_rank(ax, series_of: dict[str, list[float]], colours: dict, title: str, xlabel: str) -> None:
    labels = list(series_of)
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        vals = series_of[label]
        ax.bar([r + (i - (len(labels) - 1) / 2) * width for r in range(len(vals))], vals, width,
               color=colours[label], label=label)
    ax.set_xticks(range(max(len(v) for v in series_of.values())))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)


def _memory(runs: list[Run], colours: dict, path: Path) -> Path | None:
    def per_rank(key: str, kind: str = "measured", source=None) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for label, members in by_label(r for r in runs if r.kind == kind and r.status == "finished").items():
            lists = [source(m) if source else (m.summary or {}).get(key) for m in members]
            lists = [v for v in lists if v]
            if lists:  # the mean over seeds, rank by rank
                out[label] = [statistics.fmean(col) / _MIB for col in zip(*lists)]
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
    n = max(len(p[0]) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2 + 0.22 * n), squeeze=False)
    for ax, (data, title, xlabel) in zip(axes[0], panels):
        _per_rank(ax, data, colours, title, xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _step_time(runs: list[Run], table: list[dict], groups: list[dict], colours: dict, path: Path) -> Path | None:
    """Measured against simulated step time for the configurations that have both, then
    the simulated runs' iteration time and bubble ratio."""
    paired = [r for r in table if r["kind"] == "measured" and r.get("sim_step_time") is not None
              and r.get("step_time_s") is not None]
    sims = [r for r in table if r["kind"] == "simulated" and r.get("sim_step_time") is not None]
    panels = int(bool(paired)) + 2 * int(bool(sims))
    if not panels:
        return None
    n = max(len({r["label"] for r in paired}), len({r["label"] for r in sims}))
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, _height(n)), squeeze=False)
    axes = list(axes[0])
    if paired:
        ax = axes.pop(0)
        labels = list(dict.fromkeys(r["label"] for r in paired))
        measured = [statistics.fmean(v) for v in _values(paired, labels, "step_time_s")]
        simulated = [statistics.fmean(v) for v in _values(paired, labels, "sim_step_time")]
        pos = list(range(len(labels)))
        ax.barh([p - 0.2 for p in pos], measured, 0.4, color=[colours[label] for label in labels], label="measured")
        ax.barh([p + 0.2 for p in pos], simulated, 0.4, color=[colours[label] for label in labels], alpha=0.45,
                hatch="//", label="simulated")
        for p, label, sim in zip(pos, labels, simulated):
            errors = _values(paired, [label], "sim_error")[0]
            if not errors:  # simulated in unit times: no deviation to mark
                continue
            flagged = any(r.get("sim_flag") for r in groups if r["kind"] == "measured" and r["label"] == label)
            limit = next((r["sim_tolerance"] for r in groups if r["kind"] == "measured" and r["label"] == label
                          and r.get("sim_tolerance") is not None), None)
            text = f"  {percent(statistics.fmean(errors))}"
            if flagged and limit is not None:
                text += f" (beyond ±{percent(limit, sign=False)})"
            ax.text(sim, p + 0.2, text, ha="left", va="center", fontsize=8,
                    color="#b00000" if flagged else "#333333", fontweight="bold" if flagged else "normal")
        ax.margins(x=0.25)
        ax.set_yticks(pos, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title("Step time: measured vs simulated")
        ax.set_xlabel("seconds per step")
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    if sims:
        labels = list(dict.fromkeys(r["label"] for r in sims))
        unit = _sim_unit(runs)
        _bars(axes[0], labels, _values(sims, labels, "sim_step_time"), colours, "Simulated iteration time per step",
              unit)
        _bars(axes[1], labels, _values(sims, labels, "sim_bubble"), colours, "Simulated bubble ratio",
              "idle / (devices x makespan)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sim_unit(runs: list[Run]) -> str:
    """The simulated runs' time unit: seconds unless a unit cost model was used."""
    sims = [r for r in runs if r.kind == "simulated"]
    if sims and not any(sim_in_seconds(r) for r in sims):
        return "unit times (cost=unit)"
    return "seconds (the cost model's prediction)"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(rows: list[dict], columns: list[str], path: Path) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _cell(row.get(c)) for c in columns})
    return path


# shown as percentages on the page (the CSV files keep the fractions)
_PERCENT = {"sim_error": True, "sim_tolerance": False}  # column: with a sign
# the cells marked when the simulated step time is beyond the fidelity target
_FLAGGED = ("sim_step_time", "sim_error", "sim_flag")


def _html_cell(row: dict, column: str) -> str:
    value = row.get(column)
    text = percent(value, sign=_PERCENT[column]) if column in _PERCENT and value is not None else _cell(value)
    cls = ' class="flag"' if row.get("sim_flag") and column in _FLAGGED else ""
    return f"<td{cls}>{html.escape(text)}</td>"


def _html_table(rows: list[dict], columns: list[str]) -> str:
    present = [c for c in columns if any(r.get(c) not in (None, "") for r in rows)]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in present)
    body = []
    for r in rows:
        cls = f' class="{r["status"]}"' if r.get("status") in _UNFINISHED + ("empty",) else ""
        cells = "".join(_html_cell(r, c) for c in present)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 12px; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f0f0f0; }
td:first-child, td:nth-child(2) { text-align: left; }
tr.crashed td { background: #fde2e2; } tr.incomplete td { background: #fff4d6; } tr.empty td { background: #eee; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
.note { color: #555; font-size: 13px; }
td.flag { background: #fde2e2; color: #a00000; font-weight: bold; }
.caution { background: #fde2e2; border-left: 4px solid #a00000; padding: 0.5em 0.8em; }
"""


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

    problems = [r for r in table if r["status"] != "finished"]
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{len(runs)} runs from {", ".join(html.escape(i) for i in inputs)}; written '
        f"{datetime.now():%Y-%m-%d %H:%M}.</p>",
    ]
    report.cautions = sim_cautions(groups, table)
    if report.cautions:
        parts.append('<p class="caution"><b>Caution:</b> Simulated step time deviates from measured beyond the '
                     f"target for: {html.escape('; '.join(report.cautions))}</p>")
    if problems:
        parts.append("<p><b>Not finished:</b></p><ul>" + "".join(
            f"<li>{html.escape(r['run'])}: {html.escape(r['status'])}"
            f"{' after step ' + str(r['steps']) if r.get('steps') else ''}: {html.escape(r['note'] or '')}</li>"
            for r in problems) + "</ul>")
    if target is not None:
        parts.append(f'<p class="note">Target loss for time-to-target: {target:.4g} (the training loss, '
                     f"mean of the last {window} logged steps). Curves use the same trailing mean.</p>")
    captions = {
        "convergence": "Loss against step, samples, optimizer updates and training time. Asynchronous "
                       "schedules apply several updates per step; samples and updates are what each run logged.",
        "throughput": "Throughput and measured bubble ratio over the steady (second) half of each run.",
        "memory": "Peak memory per rank.",
        "step_time": "Measured step time beside the simulated one for the same configuration, each simulated "
                     "bar marked with its deviation (simulated - measured) / measured.",
    }
    for name, path in report.figures.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<h2>{name.replace('_', ' ').capitalize()}</h2><p class='note'>{captions[name]}</p>"
                     f'<img alt="{name}" src="data:image/png;base64,{data}">')
    parts.append("<h2>Runs</h2>")
    if any(r.get("sim_error") is not None for r in table):
        parts.append("<p class='note'>sim_error: (simulated - measured step time) / measured, where a simulated "
                     "run of the same configuration is in seconds; the fidelity target (sim_tolerance) is ±"
                     f"{percent(SIM_TOLERANCE_FEW_RANKS, sign=False)} on up to {FEW_RANKS} ranks, ±"
                     f"{percent(SIM_TOLERANCE_MANY_RANKS, sign=False)} on more, unless set with "
                     "sim_tolerance=FRACTION; sim_flag marks a deviation beyond it.</p>")
    parts.append(_html_table(table, RUN_COLUMNS))
    parts.append("<h2>Configurations</h2><p class='note'>Means over the runs of each configuration "
                 "(its seeds).</p>" + _html_table(groups, GROUP_COLUMNS))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n")
    report.html.write_text(page, encoding="utf-8")
    report.files.append(report.html)
    return report
