"""report.html: one self-contained page that fits a 1400 px wide window. Its tables show the
columns a reader compares, in words, with units, rounded (:mod:`.fmt`), each table one
kind of row of at most :data:`MAX_COLUMNS` columns (a column equal in every row becomes a
line above it); a table that still cannot fit scrolls in its own box, never the page.
Where simulated and measured step times differ beyond the fidelity target, a caution
(:mod:`.caution`) says why, in full at the top and briefly beside the step times."""

from __future__ import annotations

import base64
import html
from datetime import datetime
from pathlib import Path

from .caution import direction, pairs, reasons
from .fmt import cell, header, percent
from .runs import UNFINISHED, UNTRAINED
from .table import FEW_RANKS, SIM_TOLERANCE_FEW_RANKS, SIM_TOLERANCE_MANY_RANKS, sim_disagreements

__all__ = ["render_page", "MAX_COLUMNS", "TRAINING_COLUMNS", "SIMULATED_COLUMNS", "FIDELITY_COLUMNS",
           "CONFIGURATION_COLUMNS"]

MAX_COLUMNS = 16  # the most columns any table on the page may have

TRAINING_COLUMNS = ["label", "seed", "status", "stages", "microbatches", "steps", "final_loss", "best_loss",
                    "final_val_loss", "time_to_target_s", "tokens_per_s", "step_time_s", "bubble", "peak_memory_mib",
                    "peak_saved_mib", "max_staleness"]
SIMULATED_COLUMNS = ["label", "status", "stages", "microbatches", "sim_step_time", "sim_bubble",
                     "sim_peak_activation_mib", "sim_cost", "sim_topology"]
FIDELITY_COLUMNS = ["label", "runs", "step_time_s_mean", "sim_step_time", "sim_error", "sim_tolerance", "sim_flag",
                    "bubble_mean", "sim_bubble", "sim_cost", "sim_topology"]
CONFIGURATION_COLUMNS = ["label", "runs", "finished", "final_loss_mean", "final_loss_std", "best_loss_mean",
                         "time_to_target_s_mean", "samples_to_target_mean", "tokens_per_s_mean", "step_time_s_mean",
                         "bubble_mean", "peak_memory_mib_max"]
# columns that leave a table for the line above it when every row has the same value
_CONTEXT = ("seed", "status", "stages", "microbatches", "runs", "finished", "sim_cost", "sim_topology", "sim_tolerance")
# columns shown only when some row has a value other than 0 (synchronous runs are never stale)
_NONZERO = ("max_staleness",)
# the cells marked when the simulated step time is beyond the fidelity target
_FLAGGED = ("sim_step_time", "sim_error", "sim_flag")
_UNFINISHED = (*UNFINISHED, *UNTRAINED)  # rows coloured by their status
_LABEL_CLASS = ' class="text label"'

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; max-width: 1400px;
       overflow-wrap: anywhere; }
h2 { margin-top: 1.6em; }
.table { max-width: 100%; overflow-x: auto; margin: 0.6em 0 1.2em; }
table { border-collapse: collapse; font-size: 12px; overflow-wrap: normal; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; vertical-align: top; }
th { background: #f0f0f0; font-weight: 600; }
td { white-space: nowrap; }
td.text, th.text { text-align: left; }
td.label, th.label { width: 16em; white-space: normal; overflow-wrap: anywhere; }
td .folder { display: block; color: #777; font-size: 10px; }
tr.crashed td, tr.diverged td { background: #fde2e2; }
tr.incomplete td, tr.interrupted td, tr.no_updates td { background: #fff4d6; }
tr.empty td { background: #eee; }
img { display: block; max-width: 100%; height: auto; border: 1px solid #ddd; margin: 0.5em 0; }
.note { color: #555; font-size: 13px; }
td.flag { background: #fde2e2; color: #a00000; font-weight: bold; }
.caution { background: #fde2e2; border-left: 4px solid #a00000; padding: 0.4em 0.8em; margin: 0.8em 0; }
.caution p { margin: 0.4em 0; } .caution ul { margin: 0.3em 0; }
"""


def _breakable(text: str) -> str:
    """Escaped, with a line-break opportunity after every ``,`` and ``/`` (run folders
    are long words: ``3_logger=none,schedule=chimera,trainer.steps=5``)."""
    return html.escape(text).replace(",", ",<wbr>").replace("/", "/<wbr>")


def _value_text(row: dict, column: str) -> str:
    if column == "steps" and row.get("steps") is not None and row.get("steps_planned") not in (None, row["steps"]):
        return f"{row['steps']:,} of {row['steps_planned']:,}"
    if column == "sim_flag" and row.get("sim_flag") is None and row.get("sim_error") is not None:
        return "within target"
    if column == "sim_step_time" and row.get("_units") and row.get(column) is not None:
        return cell(row[column], column) + " units"
    return cell(row.get(column), column)


def _td(row: dict, column: str, folder: bool) -> str:
    classes = []
    if column in ("label", "status", "sim_cost", "sim_topology", "sim_flag"):
        classes.append("text")
    if column == "label":  # the one column that wraps: configurations and run folders are long
        classes.append("label")
    if row.get("sim_flag") and column in _FLAGGED:
        classes.append("flag")
    attrs = f' class="{" ".join(classes)}"' if classes else ""
    if column == "status" and row.get("note"):
        attrs += f' title="{html.escape(row["note"])}"'
    text = _breakable(_value_text(row, column))
    if column == "label" and folder and row.get("run"):
        text += f'<span class="folder">{_breakable(row["run"])}</span>'
    return f"<td{attrs}>{text}</td>"


def html_table(rows: list[dict], columns: list[str], *, headers: dict[str, str] | None = None,
               folder: bool = False) -> str:
    """A table of ``rows`` over those of ``columns`` someone has a value in; a column
    with one value in every row becomes a line above the table instead."""
    headers = headers or {}
    present = [c for c in columns if any(_value_text(r, c) != "" for r in rows)]
    present = [c for c in present if c not in _NONZERO or any(r.get(c) for r in rows)]
    same = [c for c in present if c in _CONTEXT and len(rows) > 1 and len({_value_text(r, c) for r in rows}) == 1]
    shown = [c for c in present if c not in same]
    parts = []
    if same:
        parts.append('<p class="note">In every row: ' + ", ".join(
            f"{html.escape(headers.get(c, header(c)))} {html.escape(_value_text(rows[0], c))}" for c in same)
            + ".</p>")
    head = "".join(f'<th{_LABEL_CLASS if c == "label" else ""}>{html.escape(headers.get(c, header(c)))}</th>'
                   for c in shown)
    body = []
    for r in rows:
        cls = f' class="{r["status"]}"' if r.get("status") in _UNFINISHED else ""
        body.append(f"<tr{cls}>" + "".join(_td(r, c, folder) for c in shown) + "</tr>")
    parts.append(f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
                 f"</table></div>")
    return "".join(parts)


def _target_words() -> str:
    return (f"±{percent(SIM_TOLERANCE_FEW_RANKS, sign=False)} on up to {FEW_RANKS} ranks, "
            f"±{percent(SIM_TOLERANCE_MANY_RANKS, sign=False)} on more, unless set with sim_tolerance=FRACTION")


def _caution_full(bad: list[dict], paired: int) -> str:
    """The caution at the top of the page: every configuration beyond the target, with
    both step times, then why they can differ."""
    items = "".join(f"<li>{html.escape(p)}</li>" for p in pairs(bad))
    way = direction(bad)
    return (f'<div class="caution" id="caution"><p><b>Caution: simulated and measured step times disagree.</b> '
            f"For {len(bad)} of the {paired} configurations measured and simulated, the simulated step time "
            f"is beyond the fidelity target ({html.escape(_target_words())}){'; ' + html.escape(way) if way else ''}."
            f"</p><ul>{items}</ul><p><b>Why they can differ.</b> {html.escape(' '.join(reasons(bad)))}</p></div>")


def _caution_short(bad: list[dict], paired: int) -> str:
    """The caution beside the step-time figure and table."""
    way = direction(bad)
    costs = " ".join(reasons(bad)[:-2])  # the cost models' sentences, without the common ones
    return (f'<p class="caution"><b>Caution:</b> for {len(bad)} of {paired} configurations the simulated step '
            f"time is beyond the fidelity target{': ' + html.escape(way) if way else ''}. {html.escape(costs)} "
            f'Read the <a href="#caution">caution at the top</a> before comparing these bars.</p>')


def render_page(*, title: str, runs: list, table: list[dict], groups: list[dict], figures: dict[str, Path],
                captions: dict[str, str], inputs: list[str], target: float | None, window: int) -> str:
    """The whole page, figures embedded."""
    measured = [r for r in table if r["kind"] == "measured"]
    simulated = [r for r in table if r["kind"] == "simulated"]
    fidelity = [g for g in groups if g["kind"] == "measured" and g.get("sim_error") is not None]
    bad = sim_disagreements(groups, table)
    problems = [r for r in table if r["status"] != "finished"]
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{len(runs)} runs from {", ".join(_breakable(i) for i in inputs)}; written '
        f"{datetime.now():%Y-%m-%d %H:%M}. Every column of every run is in runs.csv and configurations.csv "
        f"beside this page.</p>",
    ]
    if bad:
        parts.append(_caution_full(bad, len(fidelity)))
    for title, rows in (("Not finished", [r for r in problems if r["status"] not in UNTRAINED]),
                        ("Ran to the end and trained nothing usable", [r for r in problems
                                                                      if r["status"] in UNTRAINED])):
        if rows:
            parts.append(f"<p><b>{title}:</b></p><ul>" + "".join(
                f"<li>{_breakable(r['run'])}: {html.escape(r['status'])}"
                f"{' after step ' + str(r['steps']) if r.get('steps') else ''}: {html.escape(r['note'] or '')}</li>"
                for r in rows) + "</ul>")
    if target is not None:
        parts.append(f'<p class="note">Target loss for time-to-target: {target:.4g} (the training loss, '
                     f"mean of the last {window} logged steps). Curves use the same trailing mean.</p>")
    for name, path in figures.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<h2>{name.replace('_', ' ').capitalize()}</h2><p class='note'>{captions[name]}</p>")
        if name == "step_time" and bad:
            parts.append(_caution_short(bad, len(fidelity)))
        parts.append(f'<img alt="{name}" src="data:image/png;base64,{data}">')
        if name == "step_time" and fidelity:
            parts.append("<p class='note'>Simulated against measured, per configuration (the mean over its "
                         "seeds): simulated vs measured is (simulated - measured) / measured; the fidelity "
                         f"target is {html.escape(_target_words())}.</p>")
            parts.append(html_table(fidelity, FIDELITY_COLUMNS, headers={
                "step_time_s_mean": "measured step time (s)", "bubble_mean": "measured bubble"}))
    if measured:
        parts.append("<h2>Training runs</h2>" + html_table(measured, TRAINING_COLUMNS, folder=True))
    if simulated:
        unit = [r.get("sim_cost") == "unit" for r in simulated]
        head = ("simulated step time (unit times)" if all(unit) else
                "simulated step time (s; units with cost=unit)" if any(unit) else "simulated step time (s)")
        if any(unit) and not all(unit):  # the header cannot say the unit: each unit time says so itself
            simulated = [{**r, "_units": u} for r, u in zip(simulated, unit)]
        parts.append("<h2>Simulated runs</h2><p class='note'>The simulated iteration time per step (an asynchronous "
                     "simulation's over its windows), bubble and the largest per-device peak of activations."
                     "</p>" + html_table(simulated, SIMULATED_COLUMNS, headers={"sim_step_time": head}, folder=True))
    measured_groups = [g for g in groups if g["kind"] == "measured"]
    if any(g["runs"] > 1 for g in measured_groups):
        parts.append("<h2>Configurations</h2><p class='note'>Means over the runs of each configuration "
                     "(its seeds).</p>" + html_table(measured_groups, CONFIGURATION_COLUMNS))
    elif measured_groups:
        parts.append("<p class='note'>Every configuration has one run: configurations.csv holds the numbers "
                     "above by configuration.</p>")
    return (f"<!doctype html><html><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n")
