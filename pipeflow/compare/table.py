"""The numbers of a comparison: one row per run, one row per configuration, and the curves
the plots draw (x axes: :data:`X_AXES`). A row's numbers come from the run's own files
(``metrics.jsonl``, ``summary.json`` once finished); a training run gets the ``sim_*``
columns of the simulated run of its configuration when one is compared, with the
simulator's fidelity on it (``sim_error``, ``sim_tolerance``: :func:`sim_tolerance`,
``sim_flag``). docs/comparing.md says what each column means."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

from pipeflow.tracking.record import KEY_FIELDS, run_key, why_unpaired

from .fmt import percent
from .runs import Run

__all__ = ["X_AXES", "series", "smoothed", "run_table", "group_table", "target_loss", "by_label", "RUN_COLUMNS",
           "GROUP_COLUMNS", "SIM_TOLERANCE_FEW_RANKS", "SIM_TOLERANCE_MANY_RANKS", "FEW_RANKS", "sim_tolerance",
           "sim_in_seconds", "sim_cautions", "sim_disagreements", "percent"]

X_AXES = {
    "step": "step",
    "samples": "samples (sequences)",
    "updates": "optimizer updates",
    "time": "training time (s)",
}

RUN_COLUMNS = [
    "run", "label", "kind", "status", "note", "schedule", "seed", "stages", "data_parallel", "microbatches", "steps",
    "steps_planned",
    "samples", "updates", "final_loss", "best_loss", "final_val_loss", "best_val_loss", "target_loss",
    "steps_to_target", "samples_to_target", "time_to_target_s", "tokens_per_s", "step_time_s", "bubble",
    "peak_memory_mib", "peak_saved_mib", "max_staleness", "max_mismatch",
    "sim_step_time", "sim_bubble", "sim_peak_activation_mib", "sim_over_measured", "sim_error", "sim_tolerance",
    "sim_flag", "sim_run", "sim_cost", "sim_topology", "sim_unpaired",
]
# sim_step_time: the simulated iteration time per step (an asynchronous simulation's
# makespan over its windows), in the simulator's time unit (seconds for cost=analytic
# and cost=profiled); sim_over_measured: that over the measured mean step time;
# sim_error: (sim_step_time - step_time_s) / step_time_s, a signed fraction (-0.23: the
# simulator predicts 23% less time than was measured), only when the simulated time is
# in seconds (not for cost=unit); sim_tolerance: the largest |sim_error| within the
# fidelity target for this run; sim_flag: "beyond ±10%" when |sim_error| exceeds it,
# else empty; sim_cost, sim_topology: the simulated run's cost model and topology;
# sim_unpaired: a measured run with no simulation of its configuration among the runs
# compared, why not (the nearest one's differing fields: "precision bf16, not fp32")

GROUP_COLUMNS = [
    "label", "kind", "runs", "finished", "final_loss_mean", "final_loss_std", "best_loss_mean",
    "time_to_target_s_mean", "samples_to_target_mean", "tokens_per_s_mean", "bubble_mean", "step_time_s_mean",
    "peak_memory_mib_max", "sim_step_time", "sim_bubble", "sim_error", "sim_tolerance", "sim_flag", "sim_cost",
    "sim_topology",
]
# sim_error: the mean of the sim_error of the configuration's measured runs; sim_flag:
# set when that mean is beyond sim_tolerance

# The simulator's fidelity targets: the project's acceptance targets for the predicted
# step time against a measured run of the same configuration, "on 2 ranks within 10%,
# on 4 ranks within 15%". A run on FEW_RANKS ranks or fewer is held to the first, a run
# on more ranks to the second. pipeflow-compare's sim_tolerance=FRACTION replaces both.
FEW_RANKS = 2
SIM_TOLERANCE_FEW_RANKS = 0.10
SIM_TOLERANCE_MANY_RANKS = 0.15

_MIB = 2**20


def batch_size(run: Run) -> int | None:
    pipe = run.config.get("pipeline") or {}
    try:
        return int(pipe["microbatches"]) * int(pipe["microbatch_size"])
    except (KeyError, TypeError, ValueError):
        return None


def series(run: Run, x: str, y: str = "loss") -> tuple[list[float], list[float]]:
    """(xs, ys) of ``y`` against the x axis ``x`` (a key of :data:`X_AXES`) over the
    run's logged rows that have ``y``."""
    if x not in X_AXES:
        raise ValueError(f"x axis {x!r}: allowed values are {', '.join(X_AXES)}")
    xs, ys = [], []
    bs = batch_size(run)
    clock = 0.0
    for row in run.rows:
        if "step_time" in row:
            clock += float(row["step_time"])
        if y not in row or row[y] is None:
            continue
        if x == "step":
            xv = row["step"]
        elif x == "samples":
            xv = row.get("samples", row["step"] * bs if bs else None)
        elif x == "updates":
            xv = row.get("updates", row["step"])
        else:  # time: what the run measured; older runs without it: the sum of logged step times
            xv = row.get("train_time", clock)
        if xv is None:
            continue
        xs.append(float(xv))
        ys.append(float(row[y]))
    return xs, ys


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def by_label(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """Runs grouped by configuration label, in first-seen order."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.label, []).append(run)
    return out


def target_loss(runs: list[Run], window: int) -> float | None:
    """The default target of time-to-target: the highest smoothed final loss among the finished
    runs (among all runs with losses when none finished)."""
    finals, finished = [], []
    for run in runs:
        if run.kind != "measured":
            continue
        _, ys = series(run, "step")
        if not ys:
            continue
        final = smoothed(ys, window)[-1]
        finals.append(final)
        if run.status == "finished":
            finished.append(final)
    pool = finished or finals
    return max(pool) if pool else None


def _reach(run: Run, target: float | None, window: int) -> dict[str, Any]:
    """Step, samples and training time of the first logged step whose smoothed loss is
    at or below ``target``; empty when never reached."""
    if target is None:
        return {}
    steps, ys = series(run, "step")
    hit = next((i for i, v in enumerate(smoothed(ys, window)) if v <= target), None)
    if hit is None:
        return {}
    samples = series(run, "samples")[0]
    return {
        "steps_to_target": int(steps[hit]),
        "samples_to_target": samples[hit] if len(samples) == len(steps) else None,
        "time_to_target_s": series(run, "time")[0][hit],
    }


def _steady(rows: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the second half of the rows (the worker's own convention
    for rates: the first half includes warm-up)."""
    vals = [float(r[key]) for r in rows[len(rows) // 2:] if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def _max(values) -> float | None:
    vals = [float(v) for v in (values or []) if v is not None]
    return max(vals) if vals else None


def sim_key(run: Run) -> dict:
    """What makes a simulated run the prediction of a measured one: its summary's ``run_key``
    (:mod:`pipeflow.tracking.record`); without one, the key read from its config and summary,
    a field neither names None."""
    key = (run.summary or {}).get("run_key")
    if key:
        return dict(key)
    s = run.summary or {}
    if run.kind == "simulated":  # the simulator's summary names its whole configuration
        model = s.get("model") or {}
        return run_key({"pipeline": s, "model": model, "schedule": {"name": s.get("schedule")},
                        "partition": {"name": s.get("partition") or "uniform"}, "topology": s.get("topology"),
                        "precision": s.get("precision") or (s.get("cost") or {}).get("precision")})
    stages, dp = shape(run)
    loose = {"precision": s.get("precision"), "topology": None, **run.config,
             "schedule": {"name": run.schedule}}
    return run_key(loose, stages=stages, data_parallel=dp)


def partner(key: dict, candidates: list[tuple[dict, Run]]) -> Run | None:
    """The first simulated run whose key matches ``key`` on every field both name."""
    for other, sim in candidates:
        if all(key.get(f) is None or other.get(f) is None or key.get(f) == other.get(f) for f in KEY_FIELDS):
            return sim
    return None


def shape(run: Run) -> tuple:
    """(stages, data_parallel) of a run: its summary's (a plan's own stages and replicas),
    else its config's (a run that ended before writing a summary)."""
    pipe = run.config.get("pipeline") or {}
    summary = run.summary or {}
    return (summary.get("stages", pipe.get("stages")),
            summary.get("data_parallel", pipe.get("data_parallel", 1)))


def sim_in_seconds(sim: Run) -> bool:
    """Whether a simulated run's times are seconds: every cost model but cost=unit
    predicts seconds; cost=unit counts abstract unit times."""
    return ((sim.summary or {}).get("cost") or {}).get("name") != "unit"


def sim_tolerance(world_size: int | None, override: float | None = None) -> float:
    """The largest |deviation| of a simulated step time from a measured one, run on
    ``world_size`` ranks, within the fidelity target (``override`` when given)."""
    if override is not None:
        return float(override)
    if world_size is not None and world_size <= FEW_RANKS:
        return SIM_TOLERANCE_FEW_RANKS
    return SIM_TOLERANCE_MANY_RANKS


def _beyond(error: float, tolerance: float) -> bool:
    return abs(error) > tolerance + 1e-12  # exactly at the target is within it (1.1 / 1.0 - 1 is 0.1000...09)


def _flag(error: float | None, tolerance: float | None) -> str | None:
    if error is None or tolerance is None or not _beyond(error, tolerance):
        return None
    return f"beyond ±{percent(tolerance, sign=False)}"


def _world_size(run: Run, sim: Run) -> int | None:
    """The ranks the measured run ran on: its summary says; a run that stopped early:
    the devices of the simulated schedule, else its pipeline depth."""
    for value in ((run.summary or {}).get("world_size"), (sim.summary or {}).get("num_devices"),
                  (run.config.get("pipeline") or {}).get("stages")):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def _sim_columns(sim: Run) -> dict[str, Any]:
    s = sim.summary or {}
    per_device = s.get("per_device") or []
    peak = _max(d.get("peak_activation_bytes") for d in per_device)
    if peak is None:
        peak = s.get("peak_activation_bytes")
    makespan = s.get("makespan")
    # an asynchronous simulation covers schedule.windows steps without a flush
    steps = int(s.get("windows") or 1)
    return {
        "sim_step_time": makespan / steps if makespan is not None else None,
        "sim_bubble": s.get("bubble_ratio"),
        "sim_peak_activation_mib": peak / _MIB if peak is not None else None,
        "sim_run": sim.name,
        "sim_cost": (s.get("cost") or {}).get("name"),
        "sim_topology": (s.get("topology") or {}).get("name"),
    }


def run_table(runs: list[Run], target: float | None, window: int,
              tolerance: float | None = None) -> list[dict[str, Any]]:
    """One row per run (:data:`RUN_COLUMNS`), in the order given. ``tolerance``: the
    fidelity target for every paired run (null: :func:`sim_tolerance` by its ranks)."""
    sims = [(sim_key(run), run) for run in runs if run.kind == "simulated" and run.status == "finished"]
    rows = []
    for run in runs:
        pipe = run.config.get("pipeline") or {}
        summary = run.summary or {}
        row: dict[str, Any] = {
            "run": run.name,
            "label": run.label,
            "kind": run.kind,
            "status": run.status,
            "note": run.error or "",
            "schedule": run.schedule,
            "seed": run.seed,
            # stages, and replicas of the pipeline: world size = data_parallel x the schedule's devices
            **dict(zip(("stages", "data_parallel"), shape(run))),
            "microbatches": pipe.get("microbatches", summary.get("microbatches")),
        }
        if run.kind == "simulated":
            if run.status == "finished":
                row.update(_sim_columns(run))
            rows.append(row)
            continue
        losses = [r["loss"] for r in run.rows if r.get("loss") is not None]
        vals = [r["val_loss"] for r in run.rows if r.get("val_loss") is not None]
        last = run.rows[-1] if run.rows else {}
        saved = [v for k, v in last.items() if k.startswith("saved_mib/")]
        samples, updates = series(run, "samples")[0], series(run, "updates")[0]
        row.update({
            "steps": run.steps_done,
            "steps_planned": run.steps_planned,
            "samples": samples[-1] if samples else None,
            "updates": updates[-1] if updates else None,
            # a diverged run's last loss is not finite: its last finite one is no final loss
            "final_loss": losses[-1] if losses and run.status != "diverged" else None,
            "best_loss": min(losses) if losses else None,
            "final_val_loss": vals[-1] if vals else None,
            "best_val_loss": min(vals) if vals else None,
            "target_loss": target,
            **_reach(run, target, window),
        })
        if run.status == "finished":
            peaks = summary.get("peak_memory_bytes")
            row.update({
                "tokens_per_s": summary.get("mean_tokens_per_s"),
                "step_time_s": summary.get("mean_step_time"),
                "bubble": summary.get("measured_bubble_ratio"),
                "peak_memory_mib": _max(peaks) / _MIB if _max(peaks) is not None else None,
                "peak_saved_mib": (_max(summary.get("peak_saved_bytes")) or 0.0) / _MIB
                if summary.get("peak_saved_bytes") else None,
                "max_staleness": summary.get("max_staleness"),
                "max_mismatch": summary.get("max_mismatch"),
            })
        elif run.rows:  # partial: what the logged rows say
            row.update({
                "tokens_per_s": _steady(run.rows, "tokens_per_s"),
                "step_time_s": _steady(run.rows, "step_time"),
                "bubble": _steady(run.rows, "bubble"),
                "peak_saved_mib": max(saved) if saved else None,
                "max_staleness": _max(r.get("max_staleness") for r in run.rows),
                "max_mismatch": _max(r.get("max_mismatch") for r in run.rows),
            })
        key = sim_key(run)
        sim = partner(key, sims)
        if sim is None and sims:  # why not: the nearest simulation's differing fields
            row["sim_unpaired"] = why_unpaired(key, [k for k, _ in sims])
        if sim is not None:
            row.update(_sim_columns(sim))
            if row.get("step_time_s") and row.get("sim_step_time") is not None:
                row["sim_over_measured"] = row["sim_step_time"] / row["step_time_s"]
                if sim_in_seconds(sim):  # unit times are no seconds: no deviation to speak of
                    error = (row["sim_step_time"] - row["step_time_s"]) / row["step_time_s"]
                    limit = sim_tolerance(_world_size(run, sim), tolerance)
                    row.update(sim_error=error, sim_tolerance=limit, sim_flag=_flag(error, limit))
        rows.append(row)
    return [{c: r.get(c) for c in RUN_COLUMNS} for r in rows]


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else None


def group_table(runs: list[Run], table: list[dict]) -> list[dict[str, Any]]:
    """One row per configuration label (:data:`GROUP_COLUMNS`): means over its runs
    (seeds), the spread of the final loss, and how many of its runs finished."""
    rows_of = {r["run"]: r for r in table}
    out = []
    # a simulated and a measured run of one configuration share a label, not a group
    kinds = [by_label(r for r in runs if r.kind == kind) for kind in ("measured", "simulated")]
    for label, members in [item for groups in kinds for item in groups.items()]:
        rows = [rows_of[m.name] for m in members]
        finals = [r["final_loss"] for r in rows if r["final_loss"] is not None]
        peaks = [r["peak_memory_mib"] for r in rows if r.get("peak_memory_mib") is not None]
        out.append({
            "label": label,
            "kind": members[0].kind,
            "runs": len(members),
            "finished": sum(m.status == "finished" for m in members),
            "final_loss_mean": _mean(finals),
            "final_loss_std": statistics.stdev(finals) if len(finals) > 1 else None,
            "best_loss_mean": _mean(r["best_loss"] for r in rows),
            "time_to_target_s_mean": _mean(r["time_to_target_s"] for r in rows),
            "samples_to_target_mean": _mean(r["samples_to_target"] for r in rows),
            "tokens_per_s_mean": _mean(r["tokens_per_s"] for r in rows),
            "bubble_mean": _mean(r["bubble"] for r in rows),
            "step_time_s_mean": _mean(r["step_time_s"] for r in rows),
            "peak_memory_mib_max": max(peaks) if peaks else None,
            "sim_step_time": _mean(r["sim_step_time"] for r in rows),
            "sim_bubble": _mean(r["sim_bubble"] for r in rows),
            **_group_fidelity(rows),
            "sim_cost": next((r["sim_cost"] for r in rows if r.get("sim_cost")), None),
            "sim_topology": next((r["sim_topology"] for r in rows if r.get("sim_topology")), None),
        })
    return out


def _group_fidelity(rows: list[dict]) -> dict[str, Any]:
    """sim_error, sim_tolerance and sim_flag of a configuration: the mean deviation of
    its measured runs against the target (the strictest, should its runs differ)."""
    paired = [r for r in rows if r.get("sim_error") is not None and r.get("sim_tolerance") is not None]
    if not paired:
        return {"sim_error": None, "sim_tolerance": None, "sim_flag": None}
    error = _mean(r["sim_error"] for r in paired)
    limit = min(r["sim_tolerance"] for r in paired)
    return {"sim_error": error, "sim_tolerance": limit, "sim_flag": _flag(error, limit)}


def _where(label: str, table: list[dict]) -> str:
    """`` (p=N)`` after a measured configuration's label that does not say its depth."""
    stages = next((r.get("stages") for r in table
                   if r["kind"] == "measured" and r["label"] == label and r.get("stages") is not None), None)
    return f" (p={stages})" if stages is not None and "stages=" not in label else ""


def sim_disagreements(groups: list[dict], table: list[dict]) -> list[dict]:
    """The group rows of the measured configurations whose simulated step time deviates beyond
    the target, each with ``name`` (the label, and the depth where the label lacks it)."""
    return [{**g, "name": g["label"] + _where(g["label"], table)} for g in groups
            if g.get("kind") == "measured" and g.get("sim_flag")]


def sim_cautions(groups: list[dict], table: list[dict]) -> list[str]:
    """One entry per configuration whose simulated step time deviates from the measured
    one beyond the target, e.g. ``"1f1b (p=2): -23% (target ±10%)"``."""
    return [f"{g['name']}: {percent(g['sim_error'])} (target ±{percent(g['sim_tolerance'], sign=False)})"
            for g in sim_disagreements(groups, table)]
