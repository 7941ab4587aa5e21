"""The ``data`` group: the family's own data set (data=auto) and a user's files, checked as the
ranks will read them."""

from __future__ import annotations

import glob
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeflow.families import FAMILIES, data_family

from ..values import CONF_DIR, ConfigError, at_least, number

# The model families (pipeflow.families): each trains on its own data set, and a batch
# of one is meaningless to another's loss, so a mismatched pair is refused early.
DATA_FAMILY = data_family()  # data set -> the families it feeds

DATA_FOR_FAMILY = {f.name: f.data for f in FAMILIES.values()}  # data=auto picks the family's own

DATA_VOCAB = {f.data: f.vocab for f in FAMILIES.values() if f.vocab}  # token ids a data set feeds

def data_file_list(files: Any) -> list[str] | None:
    """``data.files`` as the list of files it names: one path or a list, globs expanded
    (sorted), or None for the data set's default corpus. Raises ConfigError naming the
    first entry that matches nothing."""
    if files is None:
        return None
    found: list[str] = []
    for pattern in [files] if isinstance(files, str) else list(files):
        path = os.path.expanduser(str(pattern))
        if glob.has_magic(path):
            matches = sorted(m for m in glob.glob(path) if os.path.isfile(m))
            what = "no file matches"
        else:
            matches = [path] if os.path.isfile(path) else []
            what = "no such file"
        if not matches:
            raise ConfigError(
                f"data.files={pattern}: {what} (relative paths start at {os.getcwd()}); "
                f"give existing files or globs, or data.files=null"
            )
        found += matches
    return found

def check_data_files(data: DictConfig) -> None:
    files = data.get("files")
    if files is not None and not isinstance(files, str) and len(files) == 0:
        raise ConfigError(
            "data.files=[]: the list is empty; list at least one file, or set data.files=null for the default data"
        )
    data_file_list(files)

def check_text_data(data: DictConfig, seq_len: int) -> None:
    """A byte-level text data set (with ``max_bytes`` and ``val_fraction``), checked as the ranks
    read it: the held-out share in [0, 1), ``max_bytes`` whole, and the user's files UTF-8 text
    making at least one training window of seq_len + 1 bytes (and one validation window)."""
    if "val_fraction" not in data or "max_bytes" not in data:
        return
    frac, cap = data.get("val_fraction"), data.get("max_bytes")
    number("data.val_fraction", frac, "the held-out share of the text; use a number in [0, 1)",
            isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0 <= frac < 1)
    if cap is not None:
        at_least("data.max_bytes", cap, 1)
    files = data_file_list(data.get("files"))
    total = 0
    for f in files or ():
        size = os.path.getsize(f)
        if size == 0:
            raise ConfigError(f"data.files: {f} is empty; list files that hold text")
        try:
            with open(f, "rb") as handle:
                head = handle.read(cap - total if cap is not None else -1)
            head.decode("utf-8")  # a cut in the middle of a character is tolerated below
        except UnicodeDecodeError as err:
            if err.start < len(head) - 3:  # not just a character cut by max_bytes
                raise ConfigError(f"data.files: {f} is not UTF-8 text (byte {err.start} cannot be decoded); "
                                  f"list text files") from None
        except OSError as err:
            raise ConfigError(f"data.files: {f} cannot be read ({err.strerror})") from None
        total += size + 1  # each document ends in one separator
        if cap is not None and total >= cap:
            break
    if files is None and cap is None:
        return  # the default corpus, whole: megabytes
    tokens = min(total, cap) if files else cap
    windows = tokens // (seq_len + 1)
    held = 0 if frac == 0 else max(1, round(windows * frac))
    if windows - held < 1:
        key = "data.max_bytes" if cap is not None and (not files or cap < total) else "data.files"
        value = cap if key == "data.max_bytes" else ",".join(files)
        need = (seq_len + 1) * (2 if frac else 1)
        raise ConfigError(f"{key}={value}: too little text, about {tokens} bytes for windows of seq_len+1={seq_len + 1} "
                          f"bytes, and training{' and validation' if frac else ''} need one each; "
                          f"give at least {need} bytes")

def resolve_auto_data(cfg: DictConfig) -> None:
    """data=auto: replace the data group by the option file of the model family's data set."""
    if cfg.data.get("name") != "auto":
        return
    family = cfg.model.get("family")
    if family not in DATA_FOR_FAMILY:
        raise ConfigError(
            f"data.name=auto: no default data set for model.family={family}; pick one of {', '.join(DATA_FAMILY)}"
        )
    chosen = OmegaConf.load(CONF_DIR / "data" / f"{DATA_FOR_FAMILY[family]}.yaml")
    chosen.pop("defaults", None)
    for key, value in cfg.data.items():
        if key == "name" or value is None:
            continue  # null keeps the chosen data set's default
        if key not in chosen:
            raise ConfigError(
                f"data.{key}={value}: data set '{chosen.name}' (data=auto for model.family={family}) has no such key; "
                f"its keys: {', '.join(k for k in chosen if k != 'name')}"
            )
        chosen[key] = value
    with open_dict(cfg):
        cfg.data = chosen
