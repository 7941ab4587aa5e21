"""pipeflow-simulate: predict a schedule's iteration time, bubble and memory, no GPU needed.

    pipeflow-simulate                                    # 1F1B, gpt_tiny, 4 local CPU ranks
    pipeflow-simulate schedule=chimera topology=dgx_a100_8 model=gpt_1.5b
    pipeflow-simulate -m schedule=gpipe,1f1b,zb_h1 pipeline.microbatches=8,16
    pipeflow-simulate -m --config-dir sweeps --config-name simulate_schedules   # one W&B group

Composition only: config -> schedule -> cost model -> topology -> simulator -> the run folder's files
(docs/simulation.md lists them) -> with ``logger=wandb`` one W&B run per job
(:mod:`pipeflow.tracking.simulated`)."""

from __future__ import annotations

import gc
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeflow.config import (
    CONF_DIR,
    ConfigError,
    check_logger,
    drop_empty_run_dir,
    prepare_simulation,
    register_configs,
    run_app,
    save_hydra_config,
)
from pipeflow.faults import Fault
from pipeflow.schedules.data_parallel import pipeline_shape
from pipeflow.schedules.export import write_torch_csv
from pipeflow.config.assembly import schedule_refusal
from pipeflow.schedules.validate import ScheduleError, check_complete, check_overlaps, validate
from pipeflow.sim.engine import SimulationError, simulate
from pipeflow.sim.gantt import draw_timeline, unreadable
from pipeflow.sim.device_memory import device_memory, library_workspace
from pipeflow.planning.operator_cost import device_split
from pipeflow.topology.presets import profile_note
from pipeflow.tracking.record import run_key, write_summary

# Hydra composes against these schemas, so they must be in the ConfigStore before main().
register_configs()


DRAW_VALUES = ("auto", True, False)


def run_simulation(cfg: DictConfig, out_dir: str | Path, notes: list[str] | None = None,
                   actions: list | None = None) -> dict:
    """Simulate the configured run, write its files into ``out_dir`` and return the summary. ConfigError
    (one sentence naming the key) before any work. ``notes`` receives console lines on what was not
    written; ``actions`` (per device, an action's name or None) adds each device's ``memory_at_action``."""
    # Checking, simulating and writing 64 x 1024 allocate millions of objects and no
    # reference cycles; left on, the cyclic collector rescans them again and again (half
    # a second). It is back on once they are freed, when _run_simulation has returned.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _run_simulation(cfg, out_dir, notes, actions)
    finally:
        if was_enabled:
            gc.enable()


def _run_simulation(cfg: DictConfig, out_dir: str | Path, notes: list[str] | None, actions: list | None) -> dict:
    """:func:`run_simulation`'s work (the cyclic collector off)."""
    if cfg.draw not in DRAW_VALUES:
        raise ConfigError(f"draw={cfg.draw}: allowed values: auto (the picture when it can be read), "
                          f"true (always), false (never)")
    inputs = prepare_simulation(cfg)
    pipe = cfg.pipeline
    schedule, cost, topology = inputs.schedule, inputs.cost, inputs.topology
    try:
        result = _simulate_checked(schedule, cost, topology)
    except ScheduleError as err:  # a schedule that cannot run, named where it came from
        raise schedule_refusal(err, schedule, cfg) from None
    sim_summary = result.summary()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a large trace is gzipped (timeline.json.gz); Timeline.load reads either name. It is
    # compressed and written while the memory walk runs (Timeline.save_beside)
    saving = result.timeline.save_beside(out / "timeline.json", compress=None)
    categories = (device_memory(schedule, cost, result.per_device, library_workspace(topology, schedule.num_devices),
                                actions, inputs.periods) if cost.name != "unit" else None)
    files = ["summary.json", Path(saving.result()).name]
    png = out / "timeline.png"
    reason = unreadable(result.timeline) if cfg.draw == "auto" else None
    if cfg.draw is True or (cfg.draw == "auto" and reason is None):
        title = timeline_title(schedule.name, pipe.stages, pipe.microbatches, cfg.model.name, topology.name)
        draw_timeline(result.timeline, png, title=title)
        files.append("timeline.png")
    elif png.exists():
        png.unlink()  # an earlier run's picture in this folder is not this run's
    if reason is not None and notes is not None:
        notes.append(f"timeline.png not drawn: {reason}; draw=true draws it anyway")
    said = profile_note(topology.devices)  # (a GPU's profile pricing another GPU: both named)
    if said is not None and notes is not None:
        notes.append(said)
    if cfg.export == "torch_csv":
        write_torch_csv(schedule, out / "schedule.csv")
        files.append("schedule.csv")

    summary = _summary(cfg, inputs, result, sim_summary, categories, files)
    write_summary(out, summary)
    return summary


def _summary(cfg: DictConfig, inputs, result, sim_summary: dict, categories: list[dict] | None,
             files: list[str]) -> dict:
    """summary.json of a simulated run (``kind: simulated``)."""
    pipe = cfg.pipeline
    schedule, cost, topology = inputs.schedule, inputs.cost, inputs.topology
    memory = memory_fit(schedule, cost, topology, sim_summary["per_device"], categories)
    operators = operator_breakdown(schedule, cost, topology)
    summary = {
        "kind": "simulated",  # predicted by the simulator; pipeflow-train's summaries are measured
        "schedule": schedule.name,
        # stages, and data_parallel replicas of the pipeline (a plan's own): devices = data_parallel x stages
        **pipeline_shape(schedule, pipe.stages),
        "shard": schedule.shard,
        "gather": schedule.gather,  # pipeline.shard=full: when a stage gathers (else null)
        "microbatches": pipe.microbatches,
        "virtual_stages": pipe.virtual_stages,
        "segments": pipe.segments,
        # tokens per sequence segment, first to last (schedule.split); null: whole sequences
        "segment_lengths": inputs.segment_lengths,
        "microbatch_size": pipe.microbatch_size,
        "num_stages": schedule.num_stages,
        "num_devices": schedule.num_devices,
        "makespan": result.makespan,
        "bubble_ratio": result.bubble_ratio,
        "peak_activation_bytes": result.peak_activation_bytes,
        # model state + peak activations against each device's memory (null: not modelled)
        **memory,
        "p2p_bytes": result.p2p_bytes,
        "collective_bytes": result.collective_bytes,
        # weight versions (pipeflow.schedules.versions): all 0 for synchronous schedules
        "staleness": sim_summary["staleness"],
        **{k: sim_summary[k] for k in ("microbatches_per_step", "windows", "updates") if k in sim_summary},
        # branched models: compute time per branch and idle time per cause, summed over
        # devices (per device in per_device[*].busy_by_branch / idle_by_cause)
        **{k: sim_summary[k] for k in ("busy_by_branch", "idle_by_cause") if k in sim_summary},
        "placement": schedule.placement.as_lists(),
        # per device; for branched models with busy_by_branch and idle_by_cause
        "per_device": sim_summary["per_device"],
        # a device priced by its measured operators (Device.profile): each device's compute
        # seconds by operator class (pipeflow.planning.operators.CLASSES); null otherwise
        "operator_seconds": operators,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "cost": cost.describe(),
        "topology": topology.to_dict(),
        "precision": cfg.precision,
        "files": files,
    }
    summary["run_key"] = run_key(cfg, **pipeline_shape(schedule, pipe.stages))
    return summary


def memory_fit(schedule, cost, topology, per_device: list[dict], categories: list[dict] | None = None) -> dict:
    """Whether every device's peak memory (its stages' model state and what the walk holds) fits: adds
    ``model_state_bytes``, ``peak_memory_bytes`` and ``memory_bytes`` to each ``per_device`` entry;
    returns ``fits`` (null for cost=unit) and ``out_of_memory_devices``."""
    if cost.name == "unit":
        return {"fits": None, "out_of_memory_devices": []}
    short = []
    for d in per_device:
        dev = d["device"]
        d["model_state_bytes"] = sum(cost.model_state_bytes(s) for _, s in schedule.placement.stages_on(dev))
        if categories is not None:  # the peak of the sum over time, by category (pipeflow.sim.device_memory)
            d["peak_memory_bytes"] = categories[dev]["peak_bytes"]
            d["memory_at_peak"] = categories[dev]["at_peak"]
            d["memory_peak_action"] = categories[dev]["peak_action"]  # "1I3": stage 1's I of microbatch 3
            if "at_action" in categories[dev]:
                d["memory_at_action"] = categories[dev]["at_action"]
            d["memory_category_peaks"] = categories[dev]["category_peaks"]
        else:
            d["peak_memory_bytes"] = d["model_state_bytes"] + d["peak_activation_bytes"]
        d["memory_bytes"] = topology.devices[dev].memory_bytes
        if d["peak_memory_bytes"] > d["memory_bytes"]:
            short.append(dev)
    return {"fits": not short, "out_of_memory_devices": short}


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def memory_line(s: dict) -> str | None:
    """The console's memory verdict: the fullest device against its memory."""
    if s.get("fits") is None or not s.get("per_device"):
        return None
    worst = max(s["per_device"], key=lambda d: d["peak_memory_bytes"] / max(d["memory_bytes"], 1))
    need = f"device {worst['device']} needs {_bytes(worst['peak_memory_bytes'])} of {_bytes(worst['memory_bytes'])}"
    at = worst.get("memory_at_peak") or {}
    top = sorted(((v, k) for k, v in at.items() if v > 0), reverse=True)[:3]
    parts = [k.replace("_", " ") + " " + _bytes(v) for v, k in top]
    split = "; most of it " + ", ".join(parts) if parts else ""
    if s["fits"]:
        return f"memory        fits: at most {need.split(' needs ', 1)[1]} (device {worst['device']}{split})"
    need += split
    model = s.get("model") or {}
    recompute = model.get("recompute", "none")
    hint = "; model.attention=sdpa keeps no score" if model.get("attention") == "eager" else ""
    hint += {"none": "; model.recompute=selective or full keeps fewer activations",
             "selective": "; model.recompute=full keeps fewer activations"}.get(recompute, "")
    if recompute != "none" and s.get("segments", 1) == 1:
        # what is left grows with the tokens of one forward (eager: with their square)
        hint += "; schedule=seq1f1b pipeline.segments=N rebuilds a layer for one segment of the sequence at a time"
    return f"memory        OUT OF MEMORY on {len(s['out_of_memory_devices'])} of {len(s['per_device'])} devices: " \
           f"{need}{hint}"


def _simulate_checked(schedule, cost, topology):
    """Simulate ``schedule`` and check it once: the completeness checks first; the validator's dependency
    and deadlock walk only where the simulator stopped, to name the actions at fault (ScheduleError)."""
    check_complete(schedule)
    check_overlaps(schedule)
    try:
        return simulate(schedule, cost, topology, record=True, waits=False)
    except SimulationError:
        validate(schedule)  # raises ScheduleError naming the actions at fault
        raise  # the schedule is valid: the cost model or the topology is at fault


def timeline_title(schedule: str, stages: int, microbatches: int, model: str, topology: str) -> str:
    """The title of a simulated timeline (picture and W&B caption)."""
    return f"{schedule}: p={stages}, m={microbatches}, {model} on {topology}"


def format_report(summary: dict) -> str:
    """The console table: the run, then one row per device."""
    s = summary
    head = [
        f"schedule      {s['schedule']}",
        f"stages        {s['stages']}" + (f" x {s['virtual_stages']} virtual" if s["virtual_stages"] > 1 else ""),
        f"microbatches  {s['microbatches']}" + (f" x {s['segments']} segments" if s["segments"] > 1 else "")
        + (f" of {', '.join(map(str, s['segment_lengths']))} tokens" if s.get("segment_lengths") and s["segments"] > 1
           else ""),
        f"model         {s['model']['name']} on {s['topology']['name']} ({s['cost']['name']} cost)",
        f"makespan      {s['makespan']:.6g}",
        f"bubble ratio  {s['bubble_ratio']:.4f}",
    ]
    if memory_line(s):
        head.append(memory_line(s))
    is_async = "microbatches_per_step" in s
    if is_async:
        st = s.get("staleness") or {}
        head += [
            f"windows       {s['windows']} x {s['microbatches_per_step']} microbatches, {s['updates']} updates, "
            f"no flush",
            f"staleness     max {st.get('max_staleness', 0)}, mean {st.get('mean_staleness', 0.0):.3g} updates",
            f"mismatch      max {st.get('max_mismatch', 0)}, mean {st.get('mean_mismatch', 0.0):.3g} "
            f"({st.get('mismatched', 0)} forward/backward pairs on different versions)",
        ]
    head.append("")
    cols = ("device", "busy", "idle", "peak act. bytes", "peak live mb")
    if is_async:
        cols += ("weight versions", "weight bytes")
    rows = [
        (
            str(d["device"]),
            f"{d['busy']:.6g}",
            f"{d['idle']:.6g}",
            f"{d['peak_activation_bytes']:.6g}",
            f"{d['peak_live_microbatches']:g}",
        )
        + ((str(d.get("peak_weight_versions", "")), f"{d.get('weight_bytes', 0.0):.6g}") if is_async else ())
        for d in s["per_device"]
    ]
    table = _table(cols, rows)
    branches = _branch_table(s["per_device"])
    if branches:
        table += [""] + branches
    table += _operator_table(s.get("operator_seconds"))
    return "\n".join(head + table)


def operator_breakdown(schedule, cost, topology) -> list[dict] | None:
    """Each device's compute seconds by operator class where a measured profile prices it, else None."""
    if not hasattr(cost, "operator_split") or not any(d.profile for d in topology.devices):
        return None
    return [device_split(cost, orders, topology.devices[i].profile) if topology.devices[i].profile else None
            for i, orders in enumerate(schedule.orders)]


def _operator_table(rows: list[dict] | None) -> list[str]:
    """The console's breakdown by operator class: seconds and share of each device's compute."""
    if not rows or not any(rows):
        return []
    classes = [c for c in rows[next(i for i, r in enumerate(rows) if r)] if any(r and r[c] > 0 for r in rows)]
    out = [f"{'device':>6}  " + "  ".join(f"{c:>16}" for c in classes)]
    for i, r in enumerate(rows):
        if r:
            total = sum(r.values()) or 1.0
            out.append(f"{i:>6}  " + "  ".join(f"{r[c]:9.4g} s {100 * r[c] / total:3.0f}%" for c in classes))
    return ["", "compute by operator class (the device's measured profile; host: waiting on launches)", *out]


def _table(cols, rows) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    out += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return out


def _branch_table(per_device: list[dict]) -> list[str]:
    """Branched models: busy time per branch and idle time per cause, a row per device."""
    if not any(d.get("busy_by_branch") for d in per_device):
        return []
    labels = list(dict.fromkeys(k for d in per_device for k in d.get("busy_by_branch", {})))
    causes = [  # in the simulator's order (interaction first), those that occur
        c for c in dict.fromkeys(k for d in per_device for k in (d.get("idle_by_cause") or {}))
        if any((d.get("idle_by_cause") or {}).get(c, 0.0) > 0 for d in per_device)
    ]
    cols = ("device", *(f"busy {b}" for b in labels), *(f"idle {c}" for c in causes))
    rows = [
        (str(d["device"]),
         *(f"{d['busy_by_branch'].get(b, 0.0):.6g}" for b in labels),
         *(f"{(d.get('idle_by_cause') or {}).get(c, 0.0):.6g}" for c in causes))
        for d in per_device
    ]
    note = ("idle causes: interaction = a message between branches, head = into the head, chain = along a "
            "branch, reduce = an all-reduce, stream = the device's own order, drain = done early")
    return _table(cols, rows) + [note] if causes else _table(cols, rows)


# An absolute config path: a relative one ("../conf") is resolved as a Python package
# when the app starts from its console script, and conf/ is a folder, not a package.
@hydra.main(config_path=str(CONF_DIR), config_name="simulate", version_base="1.3")
def simulate_app(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    out_dir = hydra_cfg.runtime.output_dir
    notes: list[str] = []
    try:
        save_hydra_config(cfg)
        check_logger(cfg.logger)
        summary = run_simulation(cfg, out_dir, notes)
    except Fault as err:  # a bad config, a file that could not be written: one sentence
        drop_empty_run_dir(out_dir)
        raise SystemExit(str(err)) from None  # the sentence on stderr, exit status 1, no traceback
    print(format_report(summary))
    print(f"\nwrote {', '.join(summary['files'])} to {out_dir}")
    for note in notes:
        print(note)
    if cfg.logger.name == "wandb":
        # imported here: logger=none (the default) pays nothing for tracking
        from pipeflow.tracking.simulated import log_simulated_run

        title = timeline_title(summary["schedule"], summary["stages"], summary["microbatches"],
                               summary["model"]["name"], summary["topology"]["name"])
        log_simulated_run(cfg, hydra_cfg, out_dir, summary, title)


def main() -> None:
    """The console script: the command line checked before Hydra composes, then the app."""
    run_app(simulate_app, "simulate")


if __name__ == "__main__":
    main()
