"""The baselines' classic figures, simulated, beside their closed forms.

ALGORITHMS.md ("Baselines", "Seq1F1B", "AMDP") gives each schedule's bubble ratio,
activation footprint or weight mismatch as a formula in p (stages), m (microbatches),
v (virtual stages) and s (sequence segments). With unit costs (F = 1, B = 2, W = 1, so
I = B - W = 1), equal stages and free messages the simulator must reproduce them
exactly (Chimera's formula counts equal F and B slots, so its check uses F = B = 1),
so these checks catch a wrong order or a wrong bubble accounting in the
generators or in the engine rather than a modelling choice. Each check simulates one
small schedule (milliseconds).

    .venv/bin/python -m benchmarks.bench_closed_forms

It reports, it does not fail (tests/test_closed_forms.py asserts the same formulas
over many sizes).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeflow.planning.unit_cost import UnitCost  # noqa: E402
from pipeflow.schedules.registry import build_schedule  # noqa: E402
from pipeflow.sim.engine import simulate  # noqa: E402
from pipeflow.topology.presets import get_topology  # noqa: E402

P, M, V, S = 4, 8, 2, 4  # the sizes every check uses (Chimera: m = p, one basic unit)
AMDP_D = 8


def _sim(name: str, p: int, m: int, backward: float = 2.0, **kw):
    sched = build_schedule(name, p, m, **kw)
    cost = UnitCost(sched.num_stages, forward=1.0, backward=backward, weight=backward / 2, comm=0.0)
    return simulate(sched, cost, get_topology("local_cpu", sched.num_devices), record=False)


def _idle(result) -> float:
    """The largest idle (bubble) time over the devices; with equal stages they idle alike."""
    return max(d.idle for d in result.per_device)


@dataclass(frozen=True)
class Check:
    """One closed form: what it is about, where it is stated, its value at the sizes
    above, and how to simulate the same quantity."""

    claim: str
    paper: str
    section: str  # of ALGORITHMS.md
    formula: str
    expected: float
    simulate: Callable[[], float]


CHECKS: dict[str, Check] = {
    "gpipe_bubble": Check(
        f"GPipe bubble ratio, p={P} m={M}", "GPipe", "Baselines", "(p-1)/(m+p-1)", (P - 1) / (M + P - 1),
        lambda: _sim("gpipe", P, M).bubble_ratio),
    "1f1b_bubble": Check(
        f"1F1B bubble ratio, p={P} m={M}", "1F1B (PipeDream-Flush)", "Baselines", "(p-1)/(m+p-1)",
        (P - 1) / (M + P - 1), lambda: _sim("1f1b", P, M).bubble_ratio),
    "1f1b_memory": Check(
        f"1F1B microbatches in flight on stage 0, p={P} m={M} (GPipe: m)", "1F1B (PipeDream-Flush)", "Baselines",
        "p", float(P), lambda: float(_sim("1f1b", P, M).per_device[0].peak_live_microbatches)),
    "interleaved_bubble": Check(
        f"Interleaved 1F1B bubble ratio, p={P} m={M} v={V}", "Megatron interleaved 1F1B", "Baselines",
        "(p-1)/(v*m+p-1)", (P - 1) / (V * M + P - 1),
        lambda: _sim("interleaved_1f1b", P, M, virtual_stages=V).bubble_ratio),
    # F = I = W: 1F1B idles (p-1)(F+B) per device, ZB-H1 (p-1)(F+B-2W), a third of it
    "zb_h1_bubble": Check(
        f"ZB-H1 bubble time / 1F1B's, p={P} m={M}, F=I=W", "Zero bubble (ZB-H1)", "Baselines", "about 1/3", 1 / 3,
        lambda: _idle(_sim("zb_h1", P, M)) / _idle(_sim("1f1b", P, M))),
    # the closed form counts slots of equal length: F = B here (B = 2F gives 0.25)
    "chimera_bubble": Check(
        f"Chimera bubble ratio, p={P} m={P}, F=B", "Chimera (SC'21)", "Baselines", "(p-2)/(2m+p-2)",
        (P - 2) / (2 * P + P - 2), lambda: _sim("chimera", P, P, backward=1.0).bubble_ratio),
    "seq1f1b_bubble": Check(
        f"Seq1F1B bubble ratio, p={P} m={M} s={S}, equal segments", "Seq1F1B (NAACL 2025)", "Seq1F1B",
        "(p-1)/(m*s+p-1)", (P - 1) / (M * S + P - 1), lambda: _sim("seq1f1b", P, M, segments=S).bubble_ratio),
    "seq1f1b_memory": Check(
        f"Seq1F1B microbatches' activations on stage 0, p={P} s={S}", "Seq1F1B (NAACL 2025)", "Seq1F1B",
        "(p-1+s)/s", (P - 1 + S) / S,
        lambda: float(_sim("seq1f1b", P, M, segments=S).per_device[0].peak_live_microbatches)),
    "amdp_mismatch": Check(
        f"AMDP max forward/backward weight mismatch, d={AMDP_D} (async 1F1B: d-1)", "AMDP (ICML 2026)", "AMDP",
        "min(2, d-i)-1 <= 1", 1.0,
        lambda: float(_sim("amdp", AMDP_D, 2 * AMDP_D, windows=4).staleness["max_mismatch"])),
}


def measure() -> list[dict]:
    """Every check simulated: one dict per check with its ``key``, the :class:`Check`
    fields (``simulate`` left out) and the ``simulated`` value."""
    return [{"key": key, "claim": c.claim, "paper": c.paper, "section": c.section, "formula": c.formula,
             "expected": c.expected, "simulated": c.simulate()} for key, c in CHECKS.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    print("unit costs F=1, B=2 (I=1, W=1; Chimera F=B=1), free messages, local_cpu\n")
    print("| check | ALGORITHMS.md | closed form | expected | simulated |")
    print("|---|---|---|---|---|")
    for r in measure():
        print(f"| {r['claim']} | {r['section']} | {r['formula']} | {r['expected']:.4f} | {r['simulated']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
