"""Every headline comparison against the published papers, in one table.

Runs the benchmarks' measuring functions (not their printed tables) and writes one
markdown table, ``DIR/reproduction.md`` (also printed), with pipeflow's figure beside
the published one, and the same rows as structured data in ``DIR/reproduction.json``;
``DIR/results.json`` keeps each benchmark's raw results.

Published figures are the ones ALGORITHMS.md quotes (the benchmarks carry them as
constants); each row names the paper and the ALGORITHMS.md section (Megatron-LM's Table 1,
which ALGORITHMS.md does not quote, names the paper and the table; its rows state their
pass band, 0.8-1.2 of the published TFLOP/s per GPU, and ``--quick`` runs three of its
eight sizes). Rows without a
published figure are pipeflow's own acceptance targets (runtime against
torch.distributed.pipelining, simulator accuracy and speed, profiled partition); they
say so. Each row says how pipeflow got its figure (simulated with an analytic cost,
simulated with unit costs against a closed form, or measured on CPU ranks) and gives
the command that reproduces it alone.

A benchmark runs once for all the rows it feeds. If it raises (a crashed rank, an
invalid configuration), its rows say ``failed: <reason>``, and so does a row whose
result cannot stand for the claim (a simulated out-of-memory where the paper's run
fits); the suite goes on either way.

    .venv/bin/python -m benchmarks.reproduce            # 157 s on a shared 2-core machine, and the
                                                        # memory matrix's 112 devices: about 12 min more
    .venv/bin/python -m benchmarks.reproduce --quick    # fewer runs and steps: 72 s, and about 1.5 min
    .venv/bin/python -m benchmarks.reproduce --out outputs/reproduce/mine

The measured rows are small CPU runs: on a shared host their ratios move by tens of
percent from run to run (most of their figures say how many runs or steps they rest on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import (  # noqa: E402
    bench_async,
    bench_bapp,
    bench_closed_forms,
    bench_fidelity,
    bench_megatron,
    bench_memory,
    bench_partition,
    bench_planner,
    bench_predicted_vs_measured,
    bench_runtime_vs_torch,
    bench_seq1f1b,
    bench_simulator,
)

SIMULATED_A100 = "simulated (analytic A100 cost)"
SIMULATED_UNIT = "simulated (unit costs, closed form)"
MEASURED_CPU = "measured on 2 CPU ranks (gloo)"
NO_PAPER = "none: pipeflow's own target"
REASON_CHARS = 200


class MeasurementFailed(RuntimeError):
    """A benchmark ran but its result cannot stand for the claim (e.g. out of memory)."""


@dataclass(frozen=True)
class Source:
    """One benchmark measurement feeding one or more rows.

    ``run(**kwargs)`` returns the benchmark's structured results; ``full`` and ``quick``
    are the keyword arguments of a full and of a ``--quick`` run, each with the
    benchmark's own command-line options for the same sizes (for the rows' commands).
    """

    module: str
    run: Callable[..., Any]
    full: tuple[dict, str] = ({}, "")
    quick: tuple[dict, str] | None = None  # None: as full

    def sizes(self, quick: bool) -> tuple[dict, str]:
        return self.quick if quick and self.quick is not None else self.full

    def command(self, quick: bool) -> str:
        return f"python -m benchmarks.{self.module} {self.sizes(quick)[1]}".strip()


@dataclass(frozen=True)
class Claim:
    """One row: what is compared, the paper and section, the published figure, how
    pipeflow measures it, which source feeds it and how to read pipeflow's figure from
    that source's results."""

    claim: str
    paper: str
    published: str
    method: str
    source: str
    figure: Callable[[Any], str] = field(repr=False)


# ------------------------------------------------------------------------------ sources
SOURCES: dict[str, Source] = {
    **{
        f"closed_form:{key}": Source("bench_closed_forms", check.simulate)
        for key, check in bench_closed_forms.CHECKS.items()
    },
    "async": Source("bench_async", bench_async.results),
    "seq1f1b": Source("bench_seq1f1b", bench_seq1f1b.results),
    "megatron": Source("bench_megatron", bench_megatron.results, ({}, ""),
                       ({"sizes": bench_megatron.QUICK}, f"--sizes {','.join(bench_megatron.QUICK)}")),
    "bapp_simulated": Source("bench_bapp", bench_bapp.simulated, ({}, "--no-measure")),
    "bapp_measured": Source("bench_bapp", bench_bapp.measured_times, ({"steps": 30, "repeats": 2}, ""),
                            ({"steps": 10, "repeats": 2}, "--steps 10 --repeats 2")),
    "planner": Source("bench_planner", bench_planner.results, ({"microbatches": (16, 64)}, ""),
                      ({"microbatches": (16,)}, "--microbatches 16")),
    "simulator": Source("bench_simulator", bench_simulator.results, ({"repeats": 3}, ""),
                        ({"repeats": 1}, "--repeats 1")),
    "runtime_vs_torch": Source("bench_runtime_vs_torch", bench_runtime_vs_torch.results,
                               ({"repeats": 3, "steps": 15}, ""),
                               ({"repeats": 1, "steps": 10}, "--repeats 1 --steps 10")),
    "predicted_vs_measured": Source("bench_predicted_vs_measured", bench_predicted_vs_measured.results,
                                    ({"repeats": 3}, ""), ({"repeats": 1}, "--repeats 1")),
    "fidelity": Source("bench_fidelity", bench_fidelity.results, ({"ranks": (2, 4), "repeats": 2}, ""),
                       ({"ranks": (2,), "repeats": 1, "names": list(bench_fidelity.QUICK)},
                        f"--ranks 2 --repeats 1 --schedules {','.join(bench_fidelity.QUICK)}")),
    "memory": Source("bench_memory", bench_memory.results, ({}, ""), ({"quick": True}, "--quick")),
    "partition": Source("bench_partition", bench_partition.results, ({"stages": (2, 4), "steps": 8}, ""),
                        ({"stages": (2,), "steps": 6}, "--stages 2 --steps 6")),
}


# ------------------------------------------------------------------- reading the figures
def _closed_form_claims() -> list[Claim]:
    return [
        Claim(c.claim, f"{c.paper}; ALGORITHMS.md §{c.section}", f"{c.formula} = {c.expected:.4f}", SIMULATED_UNIT,
              f"closed_form:{key}", lambda value: f"{value:.4f}")
        for key, c in bench_closed_forms.CHECKS.items()
    ]


def _amdp_row(model: str, d: int, batch: int) -> Callable[[dict], str]:
    def figure(res: dict) -> str:
        row = next(r for r in res["rows"] if (r["model"], r["d"], r["batch"]) == (model, d, batch))
        ours = row["pipeflow"]
        if ours["amdp"] is None or ours["2bw"] is None:
            raise MeasurementFailed("amdp or pipedream_2bw does not apply to this configuration")
        inter = ours["inter-1f1b"]
        vs_inter = f"{ours['amdp']['ktok'] / inter['ktok']:.3f}x Inter-1F1B" if inter else "Inter-1F1B n/a"
        return (f"{ours['amdp']['ktok'] / ours['2bw']['ktok']:.3f}x 2BW, {vs_inter} "
                f"(AMDP {ours['amdp']['ktok']:.1f} ktok/s)")
    return figure


def _amdp_published(model: str, d: int, batch: int) -> str:
    two_bw, inter, amdp = bench_async.PUBLISHED[(model, d, batch)]
    return f"{amdp / two_bw:.3f}x 2BW, {amdp / inter:.3f}x Inter-1F1B (AMDP {amdp} ktok/s)"


def _amdp_claims() -> list[Claim]:
    paper = "AMDP (ICML 2026); ALGORITHMS.md §AMDP, headline table"
    out = [
        Claim(f"AMDP throughput vs PipeDream-2BW and Inter-1F1B, {model} d={d} update batch {batch}", paper,
              _amdp_published(model, d, batch), SIMULATED_A100, "async", _amdp_row(model, d, batch))
        for (model, d, batch) in bench_async.PUBLISHED
    ]
    rounds = bench_async.PUBLISHED_ROUNDS
    out.append(Claim(
        "AMDP ktokens/s by accumulation threshold R = " + "/".join(map(str, rounds)) + " rounds, GPT d=8",
        "AMDP (ICML 2026); ALGORITHMS.md §AMDP, convergence paragraph",
        "/".join(f"{x:.1f}" for x in rounds.values()), SIMULATED_A100, "async",
        lambda res: "/".join(f"{x['pipeflow']:.1f}" for x in res["rounds"].values()),
    ))
    return out


def _fits(r: dict, what: str) -> dict:
    if r["oom"]:
        raise MeasurementFailed(f"{what} simulated out of memory ({r['mem']:.1f} GB > {bench_seq1f1b.LIMIT_GB:.0f} GB)")
    return r


def _seq_speedup(seq: int) -> Callable[[dict], str]:
    def figure(rows: dict) -> str:
        r = rows[seq]
        base, comp, uni = _fits(r["1f1b"], "1F1B"), _fits(r["seq1f1b compute"], "Seq1F1B"), r["seq1f1b uniform"]
        return (f"{comp['tok'] / base['tok']:.3f}x ({comp['tok']:,.0f} vs {base['tok']:,.0f} tok/s, compute split "
                f"s={comp['segments']}; uniform split {uni['tok'] / base['tok']:.3f}x)")
    return figure


def _seq_published(seq: int) -> str:
    one, _, seq1 = bench_seq1f1b.PUBLISHED[seq]
    return f"{seq1 / one:.3f}x ({seq1:,} vs {one:,} tok/s)"


def _seq_longest(rows: dict) -> str:
    r = rows[max(rows)]
    seq1 = _fits(r["seq1f1b compute"], "Seq1F1B")

    def state(x: dict) -> str:
        return f"{'OOM' if x['oom'] else 'fits'} ({x['mem']:.1f} GB)"

    return (f"1F1B {state(r['1f1b'])}, 1F1B-I {state(r['interleaved_1f1b (v=2)'])}; Seq1F1B "
            f"{seq1['tok']:,.0f} tok/s ({seq1['mem']:.1f} GB, s={seq1['segments']})")


def _seq_memory(rows: dict) -> str:
    r = rows[min(rows)]
    base, comp = r["1f1b"], r["seq1f1b compute"]
    return (f"{comp['mem'] / base['mem']:.2f}x peak per GPU ({comp['mem']:.1f} vs {base['mem']:.1f} GB), "
            f"activations {comp['act'] / base['act']:.2f}x, seq {min(rows)}")


def _seq_split(rows: dict) -> str:
    r = rows[32768]["seq1f1b compute"]
    if r["segments"] != 4:
        raise MeasurementFailed(f"s=4 did not fit in memory (s={r['segments']} used)")
    return str(r["lengths"])


def _seq1f1b_claims() -> list[Claim]:
    paper = "Seq1F1B (NAACL 2025); ALGORITHMS.md §Seq1F1B"
    longest = max(bench_seq1f1b.SEQS)
    return [
        *(Claim(f"Seq1F1B throughput / 1F1B, 7B on 32 GPUs, seq {seq}, m=8", paper, _seq_published(seq),
                SIMULATED_A100, "seq1f1b", _seq_speedup(seq))
          for seq in bench_seq1f1b.SEQS if bench_seq1f1b.PUBLISHED[seq][0] is not None),
        Claim(f"Seq {longest}: who runs out of memory, Seq1F1B throughput", paper,
              f"1F1B and 1F1B-I OOM; Seq1F1B {bench_seq1f1b.PUBLISHED[longest][2]:,} tok/s", SIMULATED_A100,
              "seq1f1b", _seq_longest),
        Claim("Seq1F1B memory / 1F1B's", paper, "about 0.5x (about half the memory)", SIMULATED_A100, "seq1f1b",
              _seq_memory),
        Claim("Computation-wise split of a 32768-token sequence, s=4, 7B", paper, "[11021, 8421, 7087, 6239]",
              "computed (per-layer FLOP model)", "seq1f1b", _seq_split),
    ]


def _megatron_row(params: str) -> Callable[[list[dict]], str]:
    def figure(rows: list[dict]) -> str:
        row = next((r for r in rows if r["size"] == params), None)
        if row is None:
            raise MeasurementFailed(f"{params}B was not run (--quick runs {', '.join(bench_megatron.QUICK)})")
        if row["oom"]:
            raise MeasurementFailed(f"simulated out of memory ({row['memory_gb']:.1f} GB > "
                                    f"{bench_megatron.LIMIT_GB:.0f} GB)")
        low, high = bench_megatron.BAND
        verdict = "within" if bench_megatron.in_band(row["ratio"]) else "OUTSIDE"
        return (f"{row['tflops']:.1f} TFLOP/s per GPU, {row['ratio']:.3f}x published, {verdict} the "
                f"{low}-{high} band (step {row['step_s']:.2f} s)")
    return figure


def _megatron_claims() -> list[Claim]:
    low, high = bench_megatron.BAND
    out = []
    for params, s in bench_megatron.SIZES.items():
        claim = (f"Megatron-LM weak scaling, GPT {params}B on {s.gpus} A100s (TP {s.tp}, PP {s.pp}, DP {s.dp}, "
                 f"batch {s.batch}, microbatch {s.microbatch}, 1F1B, full recomputation): TFLOP/s per GPU")
        out.append(Claim(claim, bench_megatron.PAPER, f"{s.published:.0f} TFLOP/s per GPU (pass: {low}-{high}x)",
                         SIMULATED_A100, "megatron", _megatron_row(params)))
    return out


def _bapp_simulated(rows: list[dict]) -> str:
    ratios = [r["chimera"] / r["bapp"] for r in rows]
    return (f"{statistics.mean(ratios):.2f}x mean over {len(ratios)} configurations "
            f"({min(ratios):.2f}x to {max(ratios):.2f}x)")


def _bapp_measured(times: dict[str, list[float]]) -> str:
    mean = {k: statistics.mean(v) for k, v in times.items()}
    per_run = ", ".join(f"{c / b:.2f}x" for b, c in zip(times["bapp"], times["chimera"]))
    return (f"{mean['chimera'] / mean['bapp']:.3f}x (step {mean['bapp'] * 1e3:.1f} ms vs Chimera "
            f"{mean['chimera'] * 1e3:.1f} ms; per run {per_run})")


def _bapp_claims() -> list[Claim]:
    paper = "BAPP / Flexpipe (Tsinghua Sci. & Tech. 2025); ALGORITHMS.md §BAPP"
    return [
        Claim("BAPP throughput / Chimera on a concurrent-branch model (A100 node, p=4 and 8)", paper,
              "1.20x (+20% on average)", SIMULATED_A100, "bapp_simulated", _bapp_simulated),
        Claim("BAPP throughput / Chimera, cbm_tiny, 2 stages, m=8", paper, "1.20x (+20% on average)", MEASURED_CPU,
              "bapp_measured", _bapp_measured),
    ]


def _planner_speedup(baseline: str) -> Callable[[dict], str]:
    def figure(res: dict) -> str:
        s = res["summary"][baseline]
        return (f"best {s['best']:.2f}x, median {s['median']:.2f}x over {len(res['rows'])} cases "
                f"(one pipeline: best {s['best_1pipe']:.2f}x)")
    return figure


def _planner_claims() -> list[Claim]:
    paper = "Luo et al. (INFOCOM 2022); ALGORITHMS.md §Topology-aware synchronous planning"
    return [
        Claim(f"Topology-aware planner speedup over {label}'s plan (GPT-1.5B, BERT-1B; 4 topologies)", paper,
              "up to 2.57x (up to 157% faster than the state of the art)", SIMULATED_A100, "planner",
              _planner_speedup(baseline))
        for baseline, label in (("pipedream", "PipeDream"), ("dapple", "DAPPLE"), ("uniform", "uniform partition"))
    ]


def _runtime_vs_torch(schedule: str) -> Callable[[dict], str]:
    def figure(res: dict) -> str:
        r = res["schedules"][schedule]
        med = r["median"]
        return (f"{r['ratio']:.3f} ({med['pipeflow'] * 1e3:.1f} vs {med['torch'] * 1e3:.1f} ms, median of "
                f"{r['steady_steps']} steady steps; losses differ by at most {r['loss_max_rel_diff']:.0e})")
    return figure


def _fidelity_block(res: dict, p: int) -> dict:
    if p not in res["ranks"]:
        raise MeasurementFailed(f"{p} ranks were not run (--quick runs 2)")
    return res["ranks"][p]


def _fidelity_errors(p: int) -> Callable[[dict], str]:
    def figure(res: dict) -> str:
        block = _fidelity_block(res, p)
        rows = block["rows"]
        worst = max(rows, key=lambda n: abs(rows[n]["error"]))
        beyond = [n for n, r in rows.items() if abs(r["error"]) > block["target"]]
        return (f"worst {rows[worst]['error']:+.1%} ({worst}) over {len(rows)} schedules; "
                f"beyond {block['target']:.0%}: {', '.join(beyond) or 'none'}")
    return figure


def _fidelity_order(p: int) -> Callable[[dict], str]:
    def figure(res: dict) -> str:
        bad = _fidelity_block(res, p)["misordered"]
        return "all ordered alike" if not bad else "ordered the other way: " + ", ".join(f"{a}/{b}" for a, b in bad)
    return figure


def _fidelity_split(res: dict) -> str:
    split = res["ranks"][2]["split"]
    if split is None:
        raise MeasurementFailed("zb_h1 and 1f1b were not both measured")
    sums = ", ".join(f"stage {s}: {v['I+W / B']:.3f}" for s, v in split["stages"].items())
    return f"{split['step_ratio']:.3f}; mean(I)+mean(W) over 1F1B's mean(B): {sums}"


def _fidelity_branched(res: dict) -> str:
    pair = res["ranks"][2].get("branched_pair")
    if pair is None:
        raise MeasurementFailed("bapp and chimera_cbm were not both measured")
    return f"measured {pair['measured']:.3f}, simulated {pair['simulated']:.3f}: {pair['apart']:+.1%} apart"


def _prediction(schedule: str) -> Callable[[list[dict]], str]:
    def figure(rows: list[dict]) -> str:
        e = bench_predicted_vs_measured.errors(rows)[schedule]["calibrated"]
        return f"{e['median']:+.1%} median, worst {e['worst']:+.1%} over {e['runs']} run(s)"
    return figure


def _partition(res: dict) -> str:
    return "; ".join(f"p={r['stages']}: measured {r['run_ratio']:.3f}, simulated {r['sim_ratio']:.3f} "
                     f"({r['splits']['uniform']} -> {r['splits']['profiled']})" for r in res["rows"])


def _memory(rows: list[dict]) -> str:
    ratios = [r["ratio"] for r in rows]
    if not ratios:
        raise MeasurementFailed("no case was measured")
    within = sum(abs(x - 1) <= 0.03 for x in ratios)
    return f"{within} of {len(ratios)} devices within 3% ({min(ratios):.3f} to {max(ratios):.3f})"


def _simulator(rows: list[dict]) -> str:
    big = rows[0]
    return f"{big['simulate']:.3f} s ({big['actions']:,} actions, compile included)"


def _target_claims() -> list[Claim]:
    return [
        *(Claim(f"Step time pipeflow {name} / torch.distributed.pipelining {torch_name}, gpt_tiny, 2 ranks",
                NO_PAPER, "none; target <= 1.0, identical losses", MEASURED_CPU, "runtime_vs_torch",
                _runtime_vs_torch(name))
          for name, torch_name in ((n, pair.torch_schedule) for n, pair in bench_runtime_vs_torch.SCHEDULES.items())),
        *(Claim(f"Simulated vs measured step time, every schedule the runtime executes, {p} CPU ranks", NO_PAPER,
                f"none; target every error within +/-{bench_fidelity.TARGETS.get(p, bench_fidelity.TARGET_MANY):.0%}",
                f"measured on {p} CPU ranks (gloo) vs simulated (cost=calibrated)", "fidelity", _fidelity_errors(p))
          for p in (2, 4)),
        *(Claim(f"Schedule pairs measured >5% apart that the simulator orders alike, {p} CPU ranks", NO_PAPER,
                "none; target all", f"measured on {p} CPU ranks (gloo) vs simulated (cost=calibrated)", "fidelity",
                _fidelity_order(p))
          for p in (2, 4)),
        Claim("Step time zb_h1 / 1f1b, gpt_tiny, m=8", NO_PAPER, "none; target <= 1.0, I+W <= 1.1 x B per stage",
              MEASURED_CPU, "fidelity", _fidelity_split),
        Claim("BAPP / Chimera step time on cbm_tiny, measured against simulated", NO_PAPER,
              "none; target within 10%", f"{MEASURED_CPU} vs simulated (cost=calibrated)", "fidelity",
              _fidelity_branched),
        *(Claim(f"Simulator's predicted / measured step time - 1, {name}, gpt_tiny, 2 stages", NO_PAPER,
                "none; target within +/-15%", f"{MEASURED_CPU} vs simulated", "predicted_vs_measured",
                _prediction(name))
          for name in bench_predicted_vs_measured.SCHEDULES),
        Claim("Step time profiled / uniform partition, gpt_tiny with an 8192-word head", NO_PAPER,
              "none; below 1 means the profiled split is faster",
              "measured on CPU ranks (gloo, one per stage) and simulated", "partition",
              _partition),
        Claim("Simulator wall time, 1F1B p=64 m=1024 (131k actions)", NO_PAPER, "none; target <= 1.0 s",
              "measured (simulator wall time, this host)", "simulator", _simulator),
        Claim("Simulated / measured peak memory per device (every allocation of the step, runtime.memory=profile)",
              "Megatron-LM's memory estimator; a public DualPipeV estimator (MEMORY_AND_PARALLELISM.md)",
              "within 1% (Llama 2 7B, 8 GPUs); 1-7%; pipeflow's target within 3%",
              "measured on 2 and 4 CPU ranks (gloo) vs simulated (local_cpu)", "memory", _memory),
    ]


def claims() -> list[Claim]:
    """Every row of the table, in order: closed forms, then the papers, then pipeflow's targets."""
    return (_closed_form_claims() + _amdp_claims() + _seq1f1b_claims() + _megatron_claims() + _bapp_claims()
            + _planner_claims() + _target_claims())


# ------------------------------------------------------------------------ running them
def reason(exc: BaseException) -> str:
    """One line naming the exception: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def run_claims(rows: list[Claim], sources: dict[str, Source], quick: bool, log=None) -> tuple[list[dict], dict]:
    """Run each source the claims need once, in the claims' order, and read every row.

    Returns the table rows (dicts with claim, paper, published, pipeflow, method, command,
    status "ok" or "failed", and reason) and, per source, ``status``, ``seconds`` and its
    ``results`` (or the failure's ``reason``). An exception in a source fails its rows;
    one in reading a figure fails that row only.
    """
    runs: dict[str, dict] = {}
    out = []
    for c in rows:
        src = sources[c.source]
        if c.source not in runs:
            kwargs = src.sizes(quick)[0]
            t0 = time.perf_counter()
            try:
                runs[c.source] = {"status": "ok", "results": src.run(**kwargs)}
            except Exception as exc:  # a failed measurement is a row, not the end of the suite
                runs[c.source] = {"status": "failed", "reason": reason(exc)}
            runs[c.source]["seconds"] = time.perf_counter() - t0
            if log:
                log(f"{c.source}: {runs[c.source]['status']} in {runs[c.source]['seconds']:.1f} s")
        run = runs[c.source]
        status, why = run["status"], run.get("reason")
        if status == "ok":
            try:
                figure = c.figure(run["results"])
            except Exception as exc:
                status, why = "failed", reason(exc)
        out.append({
            "claim": c.claim, "paper": c.paper, "published": c.published,
            "pipeflow": figure if status == "ok" else f"failed: {why}",
            "method": c.method, "command": src.command(quick), "status": status, "reason": why,
        })
    return out, runs


COLUMNS = (("claim", "claim"), ("paper", "paper, section"), ("published", "published"),
           ("pipeflow", "pipeflow"), ("method", "how pipeflow measured it"), ("command", "reproduce this row"))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict]) -> str:
    """The table: one line per row, the command in backticks."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"`{r[k]}`" if k == "command" else _cell(r[k]) for k, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def reproduce(out_dir: Path, quick: bool, rows: list[Claim] | None = None,
              sources: dict[str, Source] | None = None, log=None) -> list[dict]:
    """Run the claims (all by default), write reproduction.md, reproduction.json and
    results.json under ``out_dir``, return the table rows."""
    t0 = time.perf_counter()
    table, runs = run_claims(claims() if rows is None else rows, SOURCES if sources is None else sources, quick, log)
    wall = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = sum(r["status"] != "ok" for r in table)
    head = (f"pipeflow reproduction{' (--quick)' if quick else ''}: {len(table)} rows, {failed} failed, "
            f"{wall:.0f} s\n\n")
    (out_dir / "reproduction.md").write_text(head + markdown(table))
    (out_dir / "reproduction.json").write_text(json.dumps(
        {"quick": quick, "wall_seconds": wall, "rows": table}, indent=1) + "\n")
    (out_dir / "results.json").write_text(json.dumps(runs, indent=1, default=str) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs, steps and configurations")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default outputs/reproduce/<YYYY-MM-DD_HH-MM-SS>)")
    args = ap.parse_args(argv)
    out = args.out or Path("outputs/reproduce") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    reproduce(out, args.quick, log=partial(print, file=sys.stderr, flush=True))
    print((out / "reproduction.md").read_text())
    print(f"written: {out / 'reproduction.md'}, {out / 'reproduction.json'}, {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
