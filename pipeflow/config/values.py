"""Closed value sets of the config, its error, and the number checks every check uses.
"""

from __future__ import annotations

import re
from typing import Any

from pipeflow.checks import is_whole
from pipeflow.families import BYTE_VOCAB, FAMILIES, MLM_VOCAB, data_family  # noqa: F401 - re-exported


EXPORT_FORMATS = ("torch_csv",)

OPTIMIZERS = ("adamw",)
BACKENDS = ("auto", "gloo", "nccl")
RUNTIME_DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")  # runtime.precision: the compute dtype under autocast
P2P_MODES = ("tagged", "ordered")  # runtime.p2p: messages matched by tag, or per pair in order (as NCCL does)
RECOMPUTE = ("none", "full", "selective")  # model.recompute (pipeflow.models.recompute.MODES, torch-free here)
ATTENTION = ("sdpa", "eager")  # model.attention (pipeflow.models.attention.MODES, torch-free here)
LOGGERS = ("wandb", "none")
LOGGER_MODES = ("auto", "offline", "online", "disabled")
FAIL_MODES = ("raise", "kill")
# The model families (pipeflow.families): each trains on its own data set, and a batch
# of one is meaningless to another's loss, so a mismatched pair is refused early.
DATA_FAMILY = data_family()  # data set -> the families it feeds
DATA_FOR_FAMILY = {f.name: f.data for f in FAMILIES.values()}  # data=auto picks the family's own
DATA_VOCAB = {f.data: f.vocab for f in FAMILIES.values() if f.vocab}  # token ids a data set feeds


class ConfigError(ValueError):
    """A configuration that cannot run. The message is one sentence naming the key."""


# ------------------------------------------------------------------------------ checks


def _naming_key(key: str, value: Any, err: Exception) -> ConfigError:
    """Wrap a lower layer's ValueError so the sentence names a config key."""
    msg = str(err).strip()
    # already naming one, e.g. "topology.nodes=0: ..." or "resume=...: ..."
    if re.search(r"\b(pipeline|schedule|model|topology|cost|export)\.\w+", msg) or msg.startswith(f"{key}="):
        return ConfigError(msg)
    return ConfigError(f"{key}={value}: {msg}")


def _number(key: str, value: Any, rule: str, ok: bool) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {rule}")


def _at_least(key: str, value: Any, low: int) -> None:
    _number(key, value, f"must be a whole number >= {low}", is_whole(value) and value >= low)
