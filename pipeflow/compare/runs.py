"""Find and read the runs a comparison is made of.

A *run directory* is what one ``pipeflow-train`` (``metrics.jsonl``, ``config.json``,
``summary.json`` once finished, ``failure.json`` when a rank failed) or
``pipeflow-simulate`` job (``summary.json``) writes; a *multirun directory* holds them at
any depth. Every run found is kept, whatever its :attr:`Run.status`: ``finished``,
``interrupted``, ``crashed``, ``incomplete``, ``empty``, ``diverged`` or ``no_updates``
(docs/comparing.md); all but the first are listed apart and left out of the target loss."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

__all__ = ["Run", "CompareInputError", "find_runs", "read_run", "label_runs", "flatten", "UNFINISHED",
           "UNTRAINED"]

UNFINISHED = ("crashed", "interrupted", "incomplete", "empty")  # stopped before their last step
UNTRAINED = ("diverged", "no_updates")  # ran to the end, and trained nothing usable

# a directory holding any of these is a run directory
_MARKERS = ("metrics.jsonl", "summary.json", "config.json", "failure.json", ".hydra")
_MAX_DEPTH = 6  # how deep under a given directory runs are looked for

# Config keys that never tell two runs apart for a reader: where files went, how the
# run was logged, ports. The seed is left out too: runs differing only by seed are
# repeats of one configuration (their mean and spread are reported).
_NOT_LABELS = ("seed", "resume", "logger", "hydra", "data.files", "runtime.master_port", "partition.profile",
               "runtime.fail_at_step", "runtime.fail_rank", "runtime.fail_mode", "runtime.dump_grads",
               "runtime.cuda_paths", "runtime.trace_steps", "trainer.timeline_step", "draw", "export")
# groups whose option is named by their `name` key: a sub-key only labels runs that
# share the option (schedule.stash matters between two pipedream runs, not across schedules)
_GROUPS = ("model", "schedule", "partition", "topology", "data", "optim", "cost", "runtime")


class CompareInputError(ValueError):
    """A path given to pipeflow-compare that holds no run, or does not exist."""


@dataclass
class Run:
    """One run directory, read. ``rows`` are metrics.jsonl's lines (empty when none)."""

    path: Path
    kind: str  # "measured" | "simulated"
    status: str  # "finished" | "interrupted" | "crashed" | "incomplete" | "empty" | "diverged" | "no_updates"
    config: dict
    summary: dict | None = None
    rows: list[dict] = field(default_factory=list)
    error: str | None = None  # crashed: the failing rank's error, first line
    name: str = ""  # unique among the compared runs: the path relative to their common root
    label: str = ""  # the configuration: the config values that differ across the compared runs
    seed: Any = None

    @property
    def schedule(self) -> str:
        cfg = self.config.get("schedule")
        if isinstance(cfg, dict) and cfg.get("name"):
            return str(cfg["name"])
        return str((self.summary or {}).get("schedule", "?"))

    @property
    def steps_planned(self) -> int | None:
        steps = (self.config.get("trainer") or {}).get("steps")
        return int(steps) if steps is not None else None

    @property
    def steps_done(self) -> int:
        return max((int(r.get("step", 0)) for r in self.rows), default=0)


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every run under ``paths`` (run or multirun directories), in path order. A path
    that does not exist or holds no run raises CompareInputError naming it."""
    dirs: list[Path] = []
    for given in paths:
        root = Path(given).expanduser()
        if not root.exists():
            raise CompareInputError(f"{given}: no such directory")
        if not root.is_dir():
            raise CompareInputError(f"{given}: not a directory (give a run or multirun directory)")
        found = _run_dirs(root, 0)
        if not found:
            raise CompareInputError(
                f"{given}: no run found (a run directory holds metrics.jsonl, summary.json or .hydra/)"
            )
        dirs += found
    unique = list(dict.fromkeys(d.resolve() for d in dirs))
    runs = [read_run(d) for d in unique]
    _name_runs(runs)
    label_runs(runs)
    return runs


def _run_dirs(root: Path, depth: int) -> list[Path]:
    if any((root / m).exists() for m in _MARKERS):
        return [root]
    if depth >= _MAX_DEPTH:
        return []
    out: list[Path] = []
    for child in sorted(root.iterdir(), key=_natural):
        if child.is_dir() and not child.name.startswith(".") and child.name != "wandb":
            out += _run_dirs(child, depth + 1)
    return out


def _natural(path: Path) -> tuple:
    """Hydra names jobs 0_..., 1_..., 10_...: sort by the number, then the name."""
    head = path.name.split("_", 1)[0]
    return (0, int(head), path.name) if head.isdigit() else (1, 0, path.name)


def read_run(path: Path) -> Run:
    """Read one run directory; never raises for missing or cut-short files."""
    summary = _json(path / "summary.json")
    config = _json(path / "config.json") or _hydra_config(path) or {}
    rows = _metrics(path / "metrics.jsonl")  # None: there, but not text
    unreadable = [f"{path / name} cannot be read as {what}" for name, what, ok in (
        ("summary.json", "a JSON object (cut short or overwritten)", summary is not None),
        ("metrics.jsonl", "text (not UTF-8)", rows is not None))
        if (path / name).is_file() and not ok]
    rows = rows or []
    failure = _json(path / "failure.json")
    simulated = summary is not None and (summary.get("kind") == "simulated" or "makespan" in summary)
    kind = "simulated" if simulated else "measured"
    if simulated and not config:  # simulated in-process (no Hydra files): its summary names the configuration
        config = _config_of_simulation(summary)
    interrupted = summary is not None and summary.get("status") == "interrupted"
    if failure is not None and (summary is None or interrupted):
        # a rank failed: the launcher stopped the others, whose summary says interrupted
        status, error = "crashed", str(failure.get("error") or "a rank failed")
    elif interrupted:
        status, error = "interrupted", f"stopped by {summary.get('stopped_by')} after step {summary.get('last_step')}"
    elif summary is not None and not unreadable and summary.get("status") in UNTRAINED:
        status, error = summary["status"], _untrained(summary)
    elif summary is not None and not unreadable:
        status, error = "finished", None
    elif unreadable:  # named, and the comparison goes on without it
        status, error = "incomplete", "; ".join(unreadable)
    elif rows:
        status, error = "incomplete", "no summary.json: the run was stopped or is still running"
    else:
        status, error = "empty", "no metrics: the job stopped before its first step"
    return Run(path=path, kind=kind, status=status, config=config, summary=summary, rows=rows, error=error,
               seed=config.get("seed"))


def _untrained(summary: dict) -> str:
    """Why a run that ran to its end (pipeflow.runtime.worker's verdict) trained nothing usable."""
    if summary["status"] == "diverged":
        return f"the loss is not finite from step {summary.get('diverged_at', '?')}"
    skipped = summary.get("skipped_steps")
    return (f"every step's update was skipped{f' ({skipped} steps)' if skipped else ''}: the fp16 gradients "
            f"overflowed at every loss scale, nothing was trained")


def _config_of_simulation(summary: dict) -> dict:
    pipe_keys = ("stages", "microbatches", "virtual_stages", "segments", "microbatch_size", "data_parallel")
    return {
        "schedule": {"name": summary.get("schedule")},
        "pipeline": {k: summary[k] for k in pipe_keys if k in summary},
        **{group: {"name": (summary.get(group) or {}).get("name")} for group in ("model", "topology", "cost")},
    }


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _metrics(path: Path) -> list[dict] | None:
    rows: list[dict] = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short when the run died
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    # a resumed run re-logs the steps after its checkpoint: the last record of a step wins
    by_step = {r["step"]: r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def _hydra_config(path: Path) -> dict | None:
    """The job's config as Hydra saved it, interpolations resolved where they can be."""
    f = path / ".hydra" / "config.yaml"
    if not f.exists():
        return None
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(f)
        try:
            return OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # an interpolation only Hydra's runtime could resolve (${now:...})
            return OmegaConf.to_container(cfg, resolve=False)
    except (OSError, yaml.YAMLError, ValueError):
        return None


def _name_runs(runs: list[Run]) -> None:
    """Name each run by its path below the deepest folder all runs share."""
    if not runs:
        return
    parts = [r.path.parts for r in runs]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    for run in runs:
        run.name = "/".join(run.path.parts[common:]) or run.path.name


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as {"a.b.c": value}; lists become tuples (hashable)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


def _labelled(key: str) -> bool:
    return not any(key == k or key.startswith(k + ".") for k in _NOT_LABELS)


def label_runs(runs: list[Run]) -> None:
    """Set each run's ``label``: the config values that differ across the runs of its kind,
    schedule first (``"amdp, microbatches=8"``); runs that differ only by seed share one."""
    for kind in ("measured", "simulated"):
        group = [r for r in runs if r.kind == kind]
        flat = [{k: v for k, v in flatten(r.config).items() if _labelled(k)} for r in group]
        keys = list(dict.fromkeys(k for f in flat for k in f))
        varying = []
        for key in keys:
            top = key.split(".", 1)[0]
            if top in _GROUPS and key != f"{top}.name" and f"{top}.name" in keys:
                # a group's sub-key: does it differ among runs sharing the group's option?
                by_option: dict[Any, set] = {}
                for f in flat:
                    if key in f:
                        by_option.setdefault(f.get(f"{top}.name"), set()).add(repr(f[key]))
                differs = any(len(v) > 1 for v in by_option.values())
            else:  # a key some configs lack (a job that stopped early, an older run) is no difference
                differs = len({repr(f[key]) for f in flat if key in f}) > 1
            if differs:
                varying.append(key)
        varying.sort(key=lambda k: (k != "schedule.name", k))
        shorts = _short_names(varying)
        # a file or folder reads as its name, with as many folders above as tell the runs apart
        paths = {key: _path_tails([f[key] for f in flat if key in f]) for key in varying}
        for run, f in zip(group, flat):
            parts = []
            for key in varying:
                if key not in f:
                    continue
                value = paths[key].get(f[key]) or _fmt_value(f[key])
                parts.append(value if key == "schedule.name" else f"{shorts[key]}={value}")
            run.label = ", ".join(parts) or run.schedule


def _path_tails(values: list) -> dict[str, str]:
    """Each path among ``values`` as its last components, as few as tell the values apart
    (``/data/llama/config.json`` -> ``llama/config.json``; a lone ``/runs/a/weights`` ->
    ``weights``)."""
    distinct = list(dict.fromkeys(v for v in values if isinstance(v, str) and "/" in v))
    parts = {v: [p for p in v.rstrip("/").split("/") if p] or [v] for v in distinct}
    out: dict[str, str] = {}
    for v, mine in parts.items():
        others = [p for w, p in parts.items() if w != v]
        n = 1
        while n < len(mine) and any(p[-n:] == mine[-n:] for p in others):
            n += 1
        tail = "/".join(mine[-n:])
        # the same tail as another's ("a/b" and "/a/b"): the whole path
        out[v] = v if any(p[-n:] == mine[-n:] for p in others) else tail
    return out


def _short_names(keys: list[str]) -> dict[str, str]:
    """The last component of each key, longer where two keys would read the same; a
    config group's ``name`` as the group."""
    out = {}
    for key in keys:
        parts = key.split(".")
        if len(parts) == 2 and parts[0] in _GROUPS and parts[1] == "name":
            out[key] = parts[0]  # a config group's choice reads as on the command line: topology=pcie_8
            continue
        n = 1
        while n < len(parts) and sum(k.split(".")[-n:] == parts[-n:] for k in keys) > 1:
            n += 1
        out[key] = ".".join(parts[-n:])
    return out


def _fmt_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
