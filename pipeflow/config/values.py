"""Closed value sets of the config, its error, and the number checks every check uses.
"""

from __future__ import annotations

import re
from typing import Any

from pipeflow.checks import is_whole


EXPORT_FORMATS = ("torch_csv",)

OPTIMIZERS = ("adamw",)
BACKENDS = ("auto", "gloo", "nccl")
RUNTIME_DEVICES = ("auto", "cpu", "cuda")
LOGGERS = ("wandb", "none")
LOGGER_MODES = ("auto", "offline", "online", "disabled")
FAIL_MODES = ("raise", "kill")
# The runtime's stage models (pipeflow.models.gpt, pipeflow.models.bert).
TRAIN_FAMILIES = ("gpt", "bert", "cbm")
# The family whose objective a data set feeds: next-token text for GPT, masked text for
# BERT. A batch of one is meaningless to the other's loss, so the pair is refused early.
DATA_FAMILY = {"text_corpus": "gpt", "mlm_corpus": "bert", "image_text": "cbm"}
# data=auto (the default) picks the data set the model's family trains on
DATA_FOR_FAMILY = {family: data for data, family in DATA_FAMILY.items()}
# text_corpus feeds UTF-8 bytes as tokens (pipeflow.data.text.ByteTokenizer), mlm_corpus
# bytes plus four special ids (pipeflow.data.mlm.MLM_VOCAB); a test keeps these equal to
# the data package's (importing it here would cost torch and datasets)
BYTE_VOCAB = 256
MLM_VOCAB = 260
DATA_VOCAB = {"text_corpus": BYTE_VOCAB, "mlm_corpus": MLM_VOCAB}


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
