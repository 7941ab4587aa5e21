"""Command-line helpers of the apps: a group choice that names no option file is refused
before Hydra composes.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Sequence

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
        if override.package is not None or override.is_delete() or not (config_dir / group).is_dir():
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

    rows = ["| schedule | what it does | weights | chunks | segments | branched model | train | torch export "
            "| options |", "|---|---|---|---|---|---|---|---|---|"]
    for spec in specs():
        d = spec.describe()
        options = ", ".join(f"`{k}`" for k in d["options"])
        rows.append(f"| `{d['name']}` | {d['summary']} | {'asynchronous' if d['asynchronous'] else 'flush'} "
                    f"| {mark(d['virtual_stages'])} | {mark(d['segments'])} | {d['branched']} "
                    f"| {mark(d['runtime'])} | {mark(d['export'])} | {options} |")
    return "\n".join(rows)
