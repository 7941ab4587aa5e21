"""The up-front checks of a composed config: value ranges and combinations a type
cannot express, each refused with one sentence naming the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeflow.checks import is_whole
from pipeflow.planning.transformer import TransformerSpec

from .schema import CONF_DIR
from .values import (
    BACKENDS,
    DATA_FAMILY,
    DATA_FOR_FAMILY,
    FAIL_MODES,
    LOGGER_MODES,
    LOGGERS,
    OPTIMIZERS,
    RUNTIME_DEVICES,
    PRECISIONS,
    P2P_MODES,
    ConfigError,
    _at_least,
    _naming_key,
    _number,
)


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse a key no schema has, however it was written (``+trainer.stepz=5``,
    ``++pipeline.data_parallel=2``, or in a YAML): Hydra adds a forced key to a typed
    group without complaint, and nothing would read it. Untyped groups (data, partition,
    a user's schedule) check their own keys, and so does the schedule: its sentence lists
    the schedule's own options (:func:`pipeflow.config.assembly.schedule_options`)."""

    def walk(node: DictConfig, path: str) -> None:
        kind = OmegaConf.get_type(node)
        if dataclasses.is_dataclass(kind):
            fields = [f.name for f in dataclasses.fields(kind)]
            for key in node.keys():
                if key not in fields:
                    where = path.rstrip(".") or "the config"
                    value = node.get(key)
                    raise ConfigError(f"{path}{key}={value}: unknown key; {where} has {', '.join(fields)}")
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, DictConfig) and f"{path}{key}" != "schedule":
                walk(child, f"{path}{key}.")

    walk(cfg, "")


def _check_pipeline(cfg: DictConfig) -> None:
    pipe = cfg.pipeline
    for key in ("stages", "microbatches", "virtual_stages", "segments", "microbatch_size", "data_parallel"):
        value = pipe[key]
        if not is_whole(value) or value < 1:
            raise ConfigError(f"pipeline.{key}={value}: must be a whole number >= 1")


def _check_trainer(trainer: DictConfig) -> None:
    _at_least("trainer.steps", trainer.steps, 1)
    _at_least("trainer.log_every", trainer.log_every, 1)
    _at_least("trainer.val_every", trainer.val_every, 0)  # 0: never
    _at_least("trainer.val_batches", trainer.val_batches, 1 if trainer.val_every > 0 else 0)
    _at_least("trainer.save_every", trainer.save_every, 0)  # 0: only the final checkpoint
    if trainer.timeline_step is not None:
        _at_least("trainer.timeline_step", trainer.timeline_step, 1)  # steps count from 1


def _check_optim(optim: DictConfig) -> None:
    if optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={optim.name}: unknown optimizer; allowed values: {', '.join(OPTIMIZERS)}")
    _number("optim.lr", optim.lr, "the learning rate must be > 0", optim.lr > 0)
    _number("optim.weight_decay", optim.weight_decay, "must be >= 0", optim.weight_decay >= 0)
    for key in ("beta1", "beta2"):
        _number(f"optim.{key}", optim[key], "must be in [0, 1)", 0 <= optim[key] < 1)
    _number("optim.eps", optim.eps, "must be > 0", optim.eps > 0)
    _at_least("optim.warmup_steps", optim.warmup_steps, 0)
    _number("optim.min_lr_ratio", optim.min_lr_ratio, "must be in [0, 1]", 0 <= optim.min_lr_ratio <= 1)
    if optim.grad_clip is not None:
        _number("optim.grad_clip", optim.grad_clip, "must be >= 0, or null for no clipping", optim.grad_clip >= 0)


def _cuda_devices() -> int:
    # torch is imported only when a config asks for CUDA, so checking a CPU config stays fast
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_runtime(rt: DictConfig, world_size: int) -> None:
    if rt.backend not in BACKENDS:
        raise ConfigError(f"runtime.backend={rt.backend}: unknown backend; allowed values: {', '.join(BACKENDS)}")
    if rt.device not in RUNTIME_DEVICES:
        raise ConfigError(f"runtime.device={rt.device}: unknown device; allowed values: {', '.join(RUNTIME_DEVICES)}")
    if rt.precision not in PRECISIONS:
        raise ConfigError(f"runtime.precision={rt.precision}: unknown precision; allowed values: {', '.join(PRECISIONS)}")
    _number("runtime.loss_scale", rt.loss_scale, "must be > 0", rt.loss_scale > 0)
    if rt.p2p not in P2P_MODES:
        raise ConfigError(f"runtime.p2p={rt.p2p}: unknown matching; allowed values: {', '.join(P2P_MODES)}")
    if rt.backend == "nccl" and rt.device == "cpu":
        raise ConfigError("runtime.backend=nccl: NCCL moves CUDA tensors only; use runtime.backend=gloo (or auto) "
                          "with runtime.device=cpu")
    if rt.backend == "nccl" or rt.device == "cuda":
        key, value = ("runtime.backend", rt.backend) if rt.backend == "nccl" else ("runtime.device", rt.device)
        gpus = _cuda_devices()
        if gpus == 0:
            raise ConfigError(f"{key}={value}: no CUDA device is available here; use {key}=auto (gloo on CPU)")
        if gpus < world_size:
            # NCCL refuses two ranks on one GPU
            raise ConfigError(
                f"{key}={value}: the schedule needs {world_size} ranks but only {gpus} CUDA devices are visible; "
                f"use fewer pipeline.stages or runtime.device=cpu"
            )
    _number("runtime.timeout_s", rt.timeout_s, "must be > 0 seconds", rt.timeout_s > 0)
    _number("runtime.hang_timeout_s", rt.hang_timeout_s, "must be >= 0 seconds (0: never)", rt.hang_timeout_s >= 0)
    _at_least("runtime.threads_per_rank", rt.threads_per_rank, 1)
    if rt.master_port is not None:
        _number("runtime.master_port", rt.master_port, "must be null (a free port) or in 1..65535",
                is_whole(rt.master_port) and 1 <= rt.master_port <= 65535)
    if (rt.fail_at_step is None) != (rt.fail_rank is None):
        unset = "runtime.fail_rank" if rt.fail_rank is None else "runtime.fail_at_step"
        raise ConfigError(f"{unset}=null: the failure test hook needs both runtime.fail_rank and runtime.fail_at_step")
    if rt.fail_rank is not None:
        _number("runtime.fail_rank", rt.fail_rank, f"must be a rank in 0..{world_size - 1}",
                is_whole(rt.fail_rank) and 0 <= rt.fail_rank < world_size)
        _at_least("runtime.fail_at_step", rt.fail_at_step, 1)
        if rt.fail_mode not in FAIL_MODES:
            raise ConfigError(f"runtime.fail_mode={rt.fail_mode}: allowed values: {', '.join(FAIL_MODES)}")


def check_logger(logger: DictConfig) -> None:
    """``logger.*`` of any app (train, simulate, plan): a known logger and W&B mode, and
    credentials when online is asked for explicitly. Raises ConfigError naming the key."""
    if logger.name not in LOGGERS:
        raise ConfigError(f"logger.name={logger.name}: unknown logger; allowed values: {', '.join(LOGGERS)}")
    if logger.name != "wandb":
        return
    if logger.mode not in LOGGER_MODES:
        raise ConfigError(f"logger.mode={logger.mode}: unknown W&B mode; allowed values: {', '.join(LOGGER_MODES)}")
    if logger.mode == "online":
        # Caught here, since in rank 0 it would only surface after every rank has started.
        from pipeflow.tracking.sink import wandb_credentials

        found, why = wandb_credentials()
        if not found:
            raise ConfigError(
                f"logger.mode=online: {why}; run `wandb login` (or set WANDB_API_KEY), "
                f"or use logger.mode=offline or auto"
            )


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


def _check_data_files(data: DictConfig) -> None:
    files = data.get("files")
    if files is not None and not isinstance(files, str) and len(files) == 0:
        raise ConfigError(
            "data.files=[]: the list is empty; list at least one file, or set data.files=null for the default data"
        )
    data_file_list(files)


def check_text_data(data: DictConfig, seq_len: int) -> None:
    """A byte-level text data set (one with ``max_bytes`` and ``val_fraction``), checked
    here as the ranks would find it: the held-out share in [0, 1), ``max_bytes`` a whole
    number, and the user's files non-empty UTF-8 text that (with ``max_bytes``) makes at
    least one training window of seq_len + 1 bytes and, when a share is held out, one
    validation window. Reads the leading files up to ``max_bytes``, as the ranks do."""
    if "val_fraction" not in data or "max_bytes" not in data:
        return
    frac, cap = data.get("val_fraction"), data.get("max_bytes")
    _number("data.val_fraction", frac, "the held-out share of the text; use a number in [0, 1)",
            isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0 <= frac < 1)
    if cap is not None:
        _at_least("data.max_bytes", cap, 1)
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


def _check_resume(resume: str | None, expect: dict | None = None) -> None:
    """``resume`` names a whole checkpoint (every rank's file there, at the size written)
    written for this pipeline (``expect``: schedule, stages, world_size, placement)."""
    if resume is None:
        return
    if not Path(resume).expanduser().is_dir():
        raise ConfigError(
            f"resume={resume}: no such directory; give a previous run's folder (outputs/train/<date>/<time>) "
            f"or one of its checkpoints/step_N folders"
        )
    # The runtime's own reading of `resume` (run dir -> latest checkpoint), torch-free
    from pipeflow.runtime.checkpoint import verify

    try:
        verify(str(Path(resume).expanduser()), expect or {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise _naming_key("resume", resume, err) from None


def _check_profiled_partition(part: DictConfig, spec: TransformerSpec, num_stages: int) -> None:
    """partition=profiled: a memory limit in bytes, and a profile file that fits the model
    (null: pipeflow-train profiles before launching); with a file, the split is computed
    now, so a memory limit nothing fits stops the run here."""
    limit, path = part.get("memory_limit"), part.get("profile")
    if limit is not None:
        _number("partition.memory_limit", limit, "must be a number of bytes > 0, or null for no limit",
                isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0)
    if path is None:
        return
    from pipeflow.planning.partition import partition_layers

    try:
        partition_layers("profiled", spec, num_stages, {"profile": str(Path(path).expanduser()), "memory_limit": limit})
    except ValueError as err:
        msg = str(err)
        raise (ConfigError(msg) if msg.startswith("partition.") else _naming_key("partition.profile", path, err)) from None


def _resolve_auto_data(cfg: DictConfig) -> None:
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


def resolve_model(cfg: DictConfig) -> None:
    """model.family=hf_causal: read the Hugging Face config (model.config, model.hf) and
    fill the model group's shape keys from it (pipeflow.hf), so every later check, the
    cost model and the planner read a Llama as they read a GPT. Other families: nothing."""
    if cfg.get("model") is None or cfg.model.get("family") != "hf_causal":
        return
    from pipeflow.hf import resolve

    try:
        keys = resolve(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for key, value in keys.items():
        cfg.model[key] = value
