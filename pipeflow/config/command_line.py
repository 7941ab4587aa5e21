"""Command-line helpers of the apps, refusing before Hydra composes: a group choice that
names no option file, a key no schema has or a value of the wrong type, and an output
folder that cannot be written.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
from pathlib import Path
from typing import Sequence

from pipeflow.faults import WriteFailed
from pipeflow.formats.files import check_folder, write_aside

from .schema import CONF_DIR
from .values import ConfigError


def check_group_choices(args: Sequence[str], config_dir: Path = CONF_DIR) -> None:
    """Refuse a command-line group choice that names no option file (``schedule=nope``)
    with one sentence, before Hydra composes: Hydra's own report spans many lines.

    ``args`` are the command-line arguments; only ``group=option`` overrides (and choice
    sweeps of them) of groups under ``config_dir`` are checked. With an extra config
    directory (``--config-dir``, ``hydra.searchpath``) options may live elsewhere, so
    nothing is checked and Hydra reports as usual; so are overrides it cannot parse.
    """
    if any(a.startswith(("-cd", "--config-dir", "hydra.searchpath")) for a in args):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except Exception:  # noqa: BLE001 - malformed overrides are Hydra's to report
        return
    for override in overrides:
        group = override.key_or_group
        if (override.package is not None or override.is_delete() or not (config_dir / group).is_dir()
                or group.startswith("hydra/")):  # Hydra's groups have options of their own and plugins'
            continue
        try:
            values = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                      else [override.get_value_element_as_str()])
        except Exception:  # noqa: BLE001 - ranges and the like are not group choices
            continue
        options = sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        for value in values:
            if value not in options:
                raise ConfigError(f"{group}={value}: unknown {group}; allowed values: {', '.join(options)}")


def schedule_table() -> str:
    """Every registered schedule as a markdown table, from its spec: what the docs and the
    README show (a test keeps them equal to this)."""
    from .assembly import PLANNED_SPEC  # noqa: F401 - schedule=planned is registered there
    from pipeflow.schedules.registry import specs

    def mark(flag: bool) -> str:
        return "yes" if flag else ""

    rows = ["| schedule | what it does | weights | chunks | segments | concurrent-branch model | train | torch export "
            "| options |", "|---|---|---|---|---|---|---|---|---|"]
    for spec in specs():
        d = spec.describe()
        options = ", ".join(f"`{k}`" for k in d["options"])
        rows.append(f"| `{d['name']}` | {d['summary']} | {'asynchronous' if d['asynchronous'] else 'flush'} "
                    f"| {mark(d['virtual_stages'])} | {mark(d['segments'])} | {d['branched']} "
                    f"| {mark(d['runtime'])} | {mark(d['export'])} | {options} |")
    return "\n".join(rows)


def check_overrides(config_name: str, args: Sequence[str]) -> None:
    """Refuse a plain override of a key no schema has (``trainer.stepz=5``) or with a
    value of the wrong type (``trainer.steps=abc``) in one sentence naming the key and
    what its group has, before Hydra composes: Hydra's own refusal suggests forcing the
    key in with ``+``, which :func:`pipeflow.config.checks.check_known_keys` refuses too.

    One trial composition of the command line's overrides (a fraction of a second);
    multiruns, extra config directories and Hydra's own keys are left to Hydra."""
    if any(a in ("-m", "--multirun") or a.startswith(("-cd", "--config-dir", "-cp", "--config-path")) for a in args):
        return
    overrides = [a for a in args if "=" in a and not a.startswith(("-", "hydra.", "hydra/", "~"))]
    if not overrides:
        return
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from .schema import compose

    remaining, unknown = list(overrides), []
    for _ in range(len(overrides) + 1):  # each unknown key found and set aside, then the next
        try:
            node = compose(config_name, remaining)
            break
        except ConfigCompositionException as err:
            cause = err.__cause__
            full_key = re.search(r"full_key: (\S+)", str(cause or ""))
            if full_key is None:
                if not unknown:
                    return  # not about one key: Hydra's report stands
                node = None
                break
            key = full_key.group(1)

            def names(arg: str, key=key) -> bool:  # the override of this key, or of a key under it
                written = arg.lstrip("+").split("=", 1)[0]
                return written == key or written.startswith(key + ".")

            given = next((a.lstrip("+").split("=", 1) for a in remaining if names(a)), [key, ""])
            if "not in" not in str(cause).splitlines()[0]:
                raise ConfigError(f"{given[0]}={given[1]}: {str(cause).splitlines()[0]}") from None
            unknown.append((key, given))
            left = [a for a in remaining if not names(a)]
            if left == remaining:
                return
            remaining = left
    else:
        return
    if not unknown:
        return
    said, listed = [], set()
    for key, given in unknown:
        parent, _, name = key.rpartition(".")
        try:
            keys = list((OmegaConf.select(node, parent) if parent else node).keys()) if node is not None else []
        except Exception:  # noqa: BLE001 - the rest of the line has its own problem: Hydra reports it
            keys = []
        near = difflib.get_close_matches(name, keys, n=1)
        hint = f" (did you mean {parent + '.' if parent else ''}{near[0]}?)" if near else ""
        if key in MOVED:
            hint = f" (it moved: {MOVED[key]}={given[1]})"
        has = f"; {parent or 'the config'} has {', '.join(keys)}" if keys and parent not in listed else ""
        listed.add(parent)
        said.append(f"{given[0]}={given[1]}: unknown key{has}{hint}")
    raise ConfigError("; ".join(said)) from None


# keys that moved, and where to: an old command line gets the new spelling
MOVED = {"runtime.precision": "precision"}  # issue 31: one precision key for every app


def check_output_dir(key: str, path: str | os.PathLike) -> None:
    """Refuse a folder the app could not create or write (``hydra.run.dir=/proc/x``, a
    read-only disk) in one sentence naming the key, the path and the reason. Creates
    nothing that is left behind."""
    why = check_folder(path)
    if why is not None:
        raise ConfigError(f"{key}={path}: {why}" + ("; give a folder you can write" if why.startswith("cannot") else ""))


def save_hydra_config(cfg) -> None:
    """The run folder's ``.hydra/`` (config.yaml, hydra.yaml, overrides.yaml: what Hydra
    itself writes there), each file written whole: the apps set ``hydra.output_subdir``
    to null, since Hydra's own writing leaves a file cut short and a traceback on a full
    disk. Raises WriteFailed naming the file; the caller drops the folder it made."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    whole = HydraConfig.instance().cfg  # {"hydra": ...}, as Hydra saves it
    folder = Path(whole.hydra.runtime.output_dir) / ".hydra"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteFailed(folder, err) from None
    for name, node in (("config.yaml", cfg), ("hydra.yaml", whole), ("overrides.yaml", whole.hydra.overrides.task)):
        write_aside(folder / name, OmegaConf.to_yaml(node))


def drop_empty_run_dir(run_dir: str | os.PathLike) -> None:
    """A refused config leaves no run folder: remove it when it holds nothing but
    Hydra's own files (.hydra/ and an empty log). Every app calls it with its refusal."""
    folder = Path(run_dir)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    if all(e.name == ".hydra" or (e.suffix == ".log" and e.is_file() and e.stat().st_size == 0) for e in entries):
        shutil.rmtree(folder, ignore_errors=True)


def check_run_dir(args: Sequence[str]) -> None:
    """The run folder an app will create (``hydra.run.dir=...`` on the command line, or
    the default under the current folder) can be written."""
    if any(a in ("-m", "--multirun") for a in args):
        given = [a.split("=", 1) for a in args if a.startswith("hydra.sweep.dir=")]
    else:
        given = [a.split("=", 1) for a in args if a.startswith("hydra.run.dir=")]
    if given:
        key, path = given[-1]
        if "${" not in path:
            check_output_dir(key, path)
        return
    check_output_dir("hydra.run.dir", Path.cwd() / "outputs")  # the default's root


# groups whose keys are another library's, not a schema's: model.hf holds any transformers
# config field (rope_theta, sliding_window, ...), set or added alike
FREE_FORM = ("model.hf.",)


def check_launcher(args: Sequence[str]) -> None:
    """``hydra/launcher=slurm``: refused in one sentence, before Hydra writes anything
    (its multirun.yaml, submitit's folder), where it cannot submit: without ``-m`` (a
    launcher runs a multirun's jobs; the run would train here), without the ``slurm``
    extra, or on a machine with no ``sbatch``/``srun``."""
    chosen = [a.split("=", 1)[1] for a in args if "=" in a and a.split("=", 1)[0].lstrip("+~") == "hydra/launcher"]
    if not chosen or chosen[-1] != "slurm":
        return
    if not any(a in ("-m", "--multirun") for a in args):
        raise ConfigError("hydra/launcher=slurm: a launcher runs a multirun's jobs, so without -m nothing is "
                          "submitted and the run would train here; add -m (pipeflow-train -m hydra/launcher=slurm "
                          "...), or leave hydra/launcher out")
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:
        raise ConfigError("hydra/launcher=slurm: needs the slurm extra (pip install -e '.[slurm]', which installs "
                          "hydra-submitit-launcher)") from None
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if missing:
        raise ConfigError(f"hydra/launcher=slurm: {' and '.join(missing)} not found on PATH, so this machine cannot "
                          f"submit to Slurm; run from a Slurm login node, or leave hydra/launcher out to train here")


def free_form(args: list[str]) -> list[str]:
    """``model.hf.rope_theta=1e4`` as ``++model.hf.rope_theta=1e4``: Hydra adds a key only
    when told to, and a transformers config field is the user's to add."""
    return [f"++{a}" if a.startswith(FREE_FORM) and "=" in a else a for a in args]


class _Stopped(BaseException):
    """A stop signal, raised where the app's main thread is (as KeyboardInterrupt is)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_app(app, config_name: str, argv: Sequence[str] | None = None) -> None:
    """A console script's front: the command line checked as the checks above do (one
    sentence on stderr and exit status 1 for a bad one, before Hydra composes), then the
    Hydra app ``app``; Ctrl-C before the app's own handling ends in one line too."""
    import logging
    import signal
    import sys

    args = free_form(list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        sys.argv[1:] = args  # what Hydra parses
    try:
        check_launcher(args)
        check_group_choices(args)
        check_overrides(config_name, args)
        check_run_dir(args)
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    # Ctrl-C, a scheduler's SIGTERM and a closed terminal's SIGHUP end the app in one line,
    # however it was started (a shell starts a background job with SIGINT ignored, which
    # Python keeps); an app with processes of its own (train's ranks, the search's
    # workers) stops them on the way out
    stopped = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}

    def stop(signum, frame):
        raise _Stopped(signum)

    for sig in stopped:
        signal.signal(sig, stop)
    # a log line that cannot be written (train.log on a full disk) is dropped, not printed
    # with a traceback: the write that matters (metrics, a summary) fails in one sentence
    logging.raiseExceptions = False
    try:
        app()
    except (KeyboardInterrupt, _Stopped) as err:
        signum = err.signum if isinstance(err, _Stopped) else signal.SIGINT
        sys.stderr.write(f"pipeflow-{config_name}: stopped by {stopped[signum]}\n")
        raise SystemExit(128 + signum) from None
