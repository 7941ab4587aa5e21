"""The config's error, where its files are, and the number checks every group's checks
use. The groups' own value sets live with their groups (:mod:`pipeflow.config.groups`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipeflow.faults import Fault
from pipeflow.numbers import is_whole
from pipeflow.families import BYTE_VOCAB, MLM_VOCAB  # noqa: F401 - re-exported

# conf/ sits next to the package in the repository; an editable install finds it there.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

EXPORT_FORMATS = ("torch_csv",)  # pipeflow-simulate's export

class ConfigError(Fault, ValueError):
    """A configuration that cannot run. The message is one sentence naming the key."""


# ------------------------------------------------------------------------------ checks


def naming_key(key: str, value: Any, err: Exception) -> ConfigError:
    """Wrap a lower layer's ValueError so the sentence names a config key."""
    msg = str(err).strip()
    # already naming one, e.g. "topology.nodes=0: ..." or "resume=...: ..."
    if re.search(r"\b(pipeline|schedule|model|topology|cost|export)\.\w+", msg) or msg.startswith(f"{key}="):
        return ConfigError(msg)
    return ConfigError(f"{key}={value}: {msg}")


def number(key: str, value: Any, rule: str, ok: bool) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {rule}")


def at_least(key: str, value: Any, low: int) -> None:
    number(key, value, f"must be a whole number >= {low}", is_whole(value) and value >= low)
