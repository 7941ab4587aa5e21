"""What a search says and writes: the console table (the top candidates, why each one
lost to the pick), the candidates that do not fit and by how much, the Pareto front of
step time against peak memory as a picture, the pick as a ready-to-run training config,
and the top candidates as configs the sweep ``sweeps/search_top.yaml`` trains."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

from pipeflow.formats.files import write_aside

from . import GIB, SearchResult
from .price import Priced, pareto
from .progress_line import duration


def why_lost(q: Priced, best: Priced) -> str:
    """One phrase: where the candidate's extra step time goes against the pick's."""
    if q is best:
        return "the pick"
    d_compute, d_waits = q.compute - best.compute, q.waits - best.waits
    gap = q.step_time - best.step_time
    if gap <= 0:
        return "ties the pick"
    c, b = q.candidate, best.candidate
    if d_compute >= d_waits:
        if c.recompute != b.recompute and c.recompute != "none":
            cause = f"recomputes ({c.recompute})"
        elif c.tensor_parallel > b.tensor_parallel:
            cause = f"{c.tensor_parallel}-way tensor collectives in every layer (on its busiest device)"
        elif c.tensor_parallel < b.tensor_parallel:
            cause = f"less of each stage's work split ({c.tensor_parallel}-way tensor parallel)"
        elif c.partition != b.partition or c.stages != b.stages or c.virtual_stages != b.virtual_stages:
            cause = "a slower busiest device (its stages' split)"
        else:
            cause = "more compute on its busiest device"
        return f"{cause}: +{duration(d_compute)} compute"
    if c.data_parallel != b.data_parallel and c.data_parallel > 1:
        cause = f"waits (bubble, {c.data_parallel}-way all-reduce)"
    else:
        cause = "waits (bubble and messages)"
    return f"{cause}: +{duration(d_waits)}"


def top_table(result: SearchResult, rows: int) -> list[str]:
    best = result.best
    cols = ("#", "candidate", "step time", "tokens/s", "bubble", "peak GiB", "closed form", "why it lost")
    closed = {q.candidate: q for q in result.closed}
    out = []
    for n, q in enumerate(result.ranked[:rows], 1):
        cf = closed.get(q.candidate)
        out.append((str(n), q.candidate.label(), duration(q.step_time), f"{q.tokens_per_s:,.0f}", f"{q.bubble:.3f}",
                    f"{q.peak_memory / GIB:.1f}/{q.memory_limit / GIB:.0f}",
                    duration(cf.step_time) if cf else "", why_lost(q, best)))
    return _table(cols, out)


def schedule_table(result: SearchResult) -> list[str]:
    """The fastest simulated candidate of every schedule, against the pick."""
    best = result.best
    seen, rows = set(), []
    for q in result.ranked:
        if q.candidate.schedule in seen:
            continue
        seen.add(q.candidate.schedule)
        rows.append((q.candidate.schedule, q.candidate.label(), duration(q.step_time), f"{q.step_time / best.step_time:.3f}",
                     f"{q.bubble:.3f}", f"{q.peak_memory / GIB:.1f}", why_lost(q, best)))
    return _table(("schedule", "its fastest", "step time", "vs pick", "bubble", "peak GiB", "why it lost"), rows)


def tensor_table(result: SearchResult) -> list[str]:
    """The fastest simulated candidate of every tensor degree (with and without sequence
    parallelism where both were searched), against the pick."""
    best = result.best
    seen, rows = set(), []
    for q in sorted(result.ranked, key=lambda q: (q.candidate.tensor_parallel, q.step_time)):
        c = q.candidate
        if (c.tensor_parallel, c.sequence_parallel) in seen:
            continue
        seen.add((c.tensor_parallel, c.sequence_parallel))
        rows.append((f"{c.tensor_parallel}" + (" sp" if c.sequence_parallel else ""), c.label(),
                     duration(q.step_time), f"{q.step_time / best.step_time:.3f}", f"{q.bubble:.3f}",
                     f"{q.peak_memory / GIB:.1f}", why_lost(q, best)))
    return _table(("tensor", "its fastest", "step time", "vs pick", "bubble", "peak GiB", "why it lost"), rows)


def _unfit_schedules(result: SearchResult) -> list[str]:
    """The schedules none of whose candidates fits (they have no row above)."""
    fit = {q.candidate.schedule for q in result.ranked}
    none = sorted({q.candidate.schedule for q in result.closed} - fit)
    return [f"no candidate fits: {', '.join(none)}"] if none else []


def oom_lines(result: SearchResult, rows: int) -> list[str]:
    oom = result.out_of_memory
    if not oom:
        return ["every priced candidate fits the memory limit"]
    head = [f"{len(oom)} of {len(result.closed)} priced candidates do not fit; the closest:"]
    # (the limit as given, 1.5 not "2"; the excess to three figures however small)
    body = [(q.candidate.label(), f"{q.peak_memory / GIB:.2f}", f"{q.memory_limit / GIB:.2f}",
             f"+{q.over / GIB:.3g}", str(q.device), q.how) for q in oom[:rows]]
    return head + _table(("candidate", "needs GiB", "limit GiB", "over by GiB", "device", "priced"), body)


def format_search(result: SearchResult, model: str, topology: str, devices: int, rows: int) -> str:
    b = result.best
    lines = [
        f"model         {model} on {topology} ({devices} devices), global batch {b.candidate.global_batch} sequences",
        f"searched      {result.considered} candidates in {result.seconds:.1f} s: {len(result.closed)} priced in "
        f"closed form, {len(result.simulated)} simulated"
        + (f", {sum(result.refused.values())} refused by a schedule's rule" if result.refused else ""),
        f"pick          {b.candidate.label()}: {duration(b.step_time)} a step, {b.tokens_per_s:,.0f} tokens/s, "
        f"peak {b.peak_memory / GIB:.1f} of {b.memory_limit / GIB:.0f} GiB (simulated)",
        f"              pipeflow-train {' '.join(b.candidate.overrides())}",
        *sharding_lines(result),
        "",
        "top candidates (simulated; 'closed form' is the pre-filter's estimate):",
        *top_table(result, rows),
        "",
        "the fastest of each schedule (simulated):",
        *schedule_table(result),
        *_unfit_schedules(result),
        *(["", "the fastest of each tensor-parallel degree (simulated):", *tensor_table(result)]
          if len({(q.candidate.tensor_parallel, q.candidate.sequence_parallel) for q in result.closed}) > 1 else []),
        "",
        *oom_lines(result, min(rows, 5)),
    ]
    return "\n".join(lines)


def only_sharded(result: SearchResult) -> list[tuple[Priced, Priced]]:
    """(candidate, its unsharded twin) for every candidate that fits only because its
    replicas shard (``pipeline.shard``): the twin, the same but unsharded, does not."""
    twins = {q.candidate: q for q in result.closed if q.candidate.shard == "none"}
    out = []
    for q in result.ranked + [q for q in result.closed if q.fits and q.how != "simulated"]:
        if q.candidate.shard != "none":
            twin = twins.get(dataclasses.replace(q.candidate, shard="none", gather="step"))
            if twin is not None and not twin.fits:
                out.append((q, twin))
    return out


def sharding_lines(result: SearchResult) -> list[str]:
    """What sharding the replicas does for the search: how many candidates fit only
    sharded, and whether the pick is one of them."""
    pairs = only_sharded(result)
    if not pairs:
        return []
    fitting = {q.candidate for q in result.closed if q.fits}
    b = result.best
    lines = [f"sharding      {len({q.candidate for q, _ in pairs})} of the {len(fitting)} candidates that fit do so "
             f"only because their replicas shard (pipeline.shard)"]
    mine = next((twin for q, twin in pairs if q.candidate == b.candidate), None)
    if mine is not None:
        lines.append(f"              the pick fits only sharded: unsharded it needs {mine.peak_memory / GIB:.1f} GiB "
                     f"(closed form)")
    return lines


_TEXT = ("candidate", "its fastest", "schedule", "why it lost", "tensor")  # left-aligned columns


def _table(cols, rows) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    left = [c in _TEXT for c in cols]

    def line(values) -> str:
        return "  ".join(v.ljust(w) if lf else v.rjust(w) for v, w, lf in zip(values, widths, left)).rstrip()
    return [line(cols)] + [line(r) for r in rows]


# ------------------------------------------------------------------------------ files

def draw_pareto(result: SearchResult, path: Path, title: str) -> None:
    """Step time against peak memory: every priced candidate (closed form, grey), the
    simulated ones by schedule, the Pareto front of the simulated ones, the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.scatter([q.peak_memory / GIB for q in result.closed], [q.step_time for q in result.closed], s=4,
               color="0.8", label=f"closed form ({len(result.closed)})", zorder=1)
    every = pareto(result.closed)
    ax.step([q.peak_memory / GIB for q in every], [q.step_time for q in every], where="post", color="0.5", lw=1,
            label="Pareto front (closed form)", zorder=2)
    sims = result.simulated
    for name in sorted({q.candidate.schedule for q in sims}):
        mine = [q for q in sims if q.candidate.schedule == name]
        ax.scatter([q.peak_memory / GIB for q in mine], [q.step_time for q in mine], s=18, label=name, zorder=3)
    front = pareto(result.ranked)
    ax.step([q.peak_memory / GIB for q in front], [q.step_time for q in front], where="post", color="k", lw=1,
            label="Pareto front (simulated, fits)", zorder=2)
    limit = result.best.memory_limit / GIB
    ax.axvline(limit, color="r", ls="--", lw=1, label=f"limit {limit:.3g} GiB")
    b = result.best
    ax.scatter([b.peak_memory / GIB], [b.step_time], s=120, facecolors="none", edgecolors="k", zorder=4, label="pick")
    ax.set_xlabel("peak memory on the fullest device (GiB)")
    ax.set_ylabel("step time (s)")
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    try:
        write_aside(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    finally:
        plt.close(fig)


def _keys(c, attention: str, precision: str) -> list[str]:
    """The candidate's pipeline, recomputation, the attention and precision it was priced
    with and its split as YAML lines."""
    lines = [f"precision: {precision}", "pipeline:"]
    lines += [f"  {key}: {getattr(c, key)}" for key in
              ("stages", "microbatches", "virtual_stages", "segments", "microbatch_size", "data_parallel", "shard",
               "tensor_parallel")]
    lines += [f"  sequence_parallel: {str(c.sequence_parallel).lower()}"]
    lines += [f"  gather: {c.gather}"] if c.shard == "full" else []
    lines += ["model:", f"  recompute: {c.recompute}", f"  attention: {attention}"]
    return lines + (["schedule:", f"  split: {c.split}"] if c.segments > 1 else [])


def train_config(q: Priced, model: str, header: str, attention: str = "sdpa", precision: str = "bf16") -> str:
    """A primary config for ``pipeflow-train --config-dir <dir> --config-name <name>``."""
    c = q.candidate
    lines = [f"# {header}", f"# {c.label()}: predicted {duration(q.step_time)} a step, "
             f"peak {q.peak_memory / GIB:.2f} GiB ({q.how})",
             "defaults:", "  - train", f"  - override model: {model}", f"  - override schedule: {c.schedule}",
             f"  - override partition: {c.partition}", "  - _self_", ""]
    return "\n".join(lines + _keys(c, attention, precision)) + "\n"


def candidate_config(q: Priced, n: int, model: str, attention: str = "sdpa", precision: str = "bf16") -> str:
    """One of the top candidates as a config group option (``+candidate=cN`` in a sweep)."""
    c = q.candidate
    lines = ["# @package _global_", f"# #{n}: {c.label()}: predicted {duration(q.step_time)} a step ({q.how})",
             "defaults:", f"  - override /model: {model}", f"  - override /schedule: {c.schedule}",
             f"  - override /partition: {c.partition}", ""]
    return "\n".join(lines + _keys(c, attention, precision)) + "\n"


def write_candidates_csv(result: SearchResult, path: Path) -> None:
    """Every priced candidate, simulated ones with both prices."""
    sims = {q.candidate: q for q in result.simulated}
    rows: list[dict] = []
    for q in result.closed:
        row = {**q.to_dict(), "closed_form_step_time": q.step_time}
        s = sims.get(q.candidate)
        if s is not None:
            row.update({**s.to_dict(), "closed_form_step_time": q.step_time})
        rows.append(row)
    names = list(rows[0])
    text = io.StringIO(newline="")
    w = csv.writer(text)  # (rows as lists: DictWriter checks each row's keys)
    w.writerow(names)
    w.writerows([row[k] for k in names] for row in rows)
    write_aside(path, text.getvalue())


def write_json(path: Path, doc: dict) -> None:
    write_aside(path, json.dumps(doc, indent=2) + "\n")
