"""The caution wherever simulated and measured step times disagree beyond the fidelity
target (the configurations of :func:`pipeflow.compare.table.sim_disagreements`): what the
simulator predicts, what was measured and why they can differ under its cost model, in the
same sentences on the page and the console."""

from __future__ import annotations

from .fmt import percent, significant

__all__ = ["pairs", "direction", "reasons", "console_caution"]

_MEASUREMENT = ("A measured step also holds what no cost model prices: interpreter and framework overhead, "
                "data loading, and other processes on the same cores.")


def pairs(disagreements: list[dict]) -> list[str]:
    """One phrase per configuration: ``"1f1b (p=2): simulated 0.140 s per step, measured
    0.197 s (-28.9%, target ±10%)"``."""
    return [f"{g['name']}: simulated {significant(g['sim_step_time'])} s per step, measured "
            f"{significant(g['step_time_s_mean'])} s ({percent(g['sim_error'])}, "
            f"target ±{percent(g['sim_tolerance'], sign=False)})" for g in disagreements]


def direction(disagreements: list[dict]) -> str:
    """Which way the simulator errs, and by what factor: ``"the simulator predicts
    shorter steps than were measured: measured 1.4× to 2.8× the prediction"``."""
    ratios = [g["step_time_s_mean"] / g["sim_step_time"] for g in disagreements
              if g.get("sim_step_time") and g.get("step_time_s_mean")]
    if not ratios:
        return ""
    lo, hi = min(ratios), max(ratios)
    span = f"{significant(lo, 2)}×" if significant(lo, 2) == significant(hi, 2) \
        else f"{significant(lo, 2)}× to {significant(hi, 2)}×"
    if lo > 1:
        return f"the simulator predicts shorter steps than were measured (measured {span} the prediction)"
    if hi < 1:
        return f"the simulator predicts longer steps than were measured (measured {span} the prediction)"
    return f"the simulator errs both ways (measured {span} the prediction)"


def _cost_reason(cost: str | None, topologies: list[str]) -> str:
    where = "topology=" + ", ".join(topologies) if topologies else "the topology"
    if cost == "analytic":
        return (f"cost=analytic prices each action from the model's FLOPs and bytes at the nominal peak FLOP/s "
                f"and bandwidth of {where} (at cost.efficiency of peak): a model of a machine, not a measurement "
                f"of the one these runs trained on.")
    if cost == "profiled":
        return ("cost=profiled adds up layer times profiled one layer at a time; a real step adds the messages, "
                "synchronisation and contention of ranks running together.")
    if cost == "calibrated":
        return ("cost=calibrated priced the actions on this machine when it was calibrated; its load then and "
                "during training can differ, and on shared cores runs of one configuration minutes apart can "
                "differ by more than the target.")
    return f"cost={cost or 'unknown'} is a model of a machine, not a measurement of the one these runs trained on."


def reasons(disagreements: list[dict]) -> list[str]:
    """Why simulated and measured can differ, one sentence per cost model used, then what
    no cost model prices, then what to do about it."""
    costs: dict[str | None, list[str]] = {}
    for g in disagreements:
        topologies = costs.setdefault(g.get("sim_cost"), [])
        if g.get("sim_topology") and g["sim_topology"] not in topologies:
            topologies.append(g["sim_topology"])
    out = [_cost_reason(cost, topologies) for cost, topologies in costs.items()]
    out.append(_MEASUREMENT)
    if any(cost != "calibrated" for cost in costs):
        out.append("Compare schedules by their simulated times with one another, not with these measurements; "
                   "to predict this machine, simulate with cost=calibrated (docs/benchmarks.md, "
                   "\"Simulating this machine\").")
    else:
        out.append("Calibrate right before training and repeat the runs to see how far they spread.")
    return out


def console_caution(disagreements: list[dict]) -> str:
    """The caution's reasons for the console, one paragraph (the configurations are
    listed on the line before it)."""
    if not disagreements:
        return ""
    head = direction(disagreements)
    return ((head[0].upper() + head[1:] + ". ") if head else "") + " ".join(reasons(disagreements))
