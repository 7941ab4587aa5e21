"""pipeflow-train: train a model with a pipeline schedule over torch.distributed ranks.

    pipeflow-train                                        # gpt_tiny, 1F1B, 2 local CPU ranks
    pipeflow-train schedule=chimera pipeline.stages=4
    pipeflow-train -m schedule=gpipe,1f1b,chimera trainer.steps=20   # one W&B group

Composition only: config -> up-front check (pipeflow.config.prepare_training; a bad
config stops here, before any process starts) -> W&B group, tags and run name -> the
runtime's launcher (pipeflow.runtime.launch), which spawns one rank per device and
writes metrics.jsonl, timeline.json/png, checkpoints/, summary.json and wandb/ into the
Hydra run directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeflow.config import (
    CONF_DIR,
    ConfigError,
    check_group_choices,
    data_file_list,
    prepare_training,
    register_configs,
)
from pipeflow.tracking.labels import logger_labels

# Hydra composes against these schemas, so they must be in the ConfigStore before main().
register_configs()


class JobError(CompactHydraException):
    """One multirun job that could not run. Hydra prints the message without a traceback,
    goes on with the other jobs, and exits non-zero at the end."""


def job_config(cfg: DictConfig, hydra_cfg: DictConfig) -> dict:
    """The config the ranks get: resolved, plain, with the logger labels filled in and
    paths made absolute (ranks started by torchrun may not share the launcher's working
    directory): ``resume``, and ``data.files`` as the list of files its globs name."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["logger"].update(logger_labels(cfg.logger, hydra_cfg))
    if plain["partition"].get("profile"):
        plain["partition"]["profile"] = str(Path(plain["partition"]["profile"]).expanduser().resolve())
    if plain.get("resume"):
        plain["resume"] = str(Path(plain["resume"]).expanduser().resolve())
    if plain["data"].get("files") is not None:
        plain["data"]["files"] = [str(Path(f).resolve()) for f in data_file_list(plain["data"]["files"])]
    return plain


def profile_for_partition(plain: dict, run_dir: str, spec, num_stages: int) -> str:
    """partition=profiled without a profile file: measure the model here, in the app
    process, before any rank starts (ranks profiling themselves would disagree on the
    split), write run_dir/profile.json and point the job's partition.profile at it.
    The split is computed once here too, so a memory limit nothing fits stops the run."""
    import torch

    from pipeflow.models.profiler import profile_model
    from pipeflow.planning.partition import partition_layers

    rt = plain["runtime"]
    cuda = torch.cuda.is_available() and rt["device"] in ("auto", "cuda")
    prof = profile_model(
        plain["model"], int(plain["pipeline"]["microbatch_size"]), seed=int(plain["seed"]),
        device="cuda" if cuda else "cpu", threads=int(rt["threads_per_rank"]),
    )
    path = str(prof.save(Path(run_dir) / "profile.json"))
    plain["partition"]["profile"] = path
    partition_layers("profiled", spec, num_stages, plain["partition"])
    return path


def format_summary(summary: dict, run_dir: str) -> str:
    """The console lines after a run: the summary's numbers, then where the files are."""
    lines = []
    for key, value in summary.items():
        if isinstance(value, float):
            lines.append(f"{key:<22}{value:.6g}")
        elif isinstance(value, (int, str)) and not isinstance(value, bool):
            lines.append(f"{key:<22}{value}")
    lines.append(f"\nwrote metrics.jsonl, summary.json and the rest to {run_dir}")
    return "\n".join(lines)


def _stop(message: str, hydra_cfg: DictConfig) -> None:
    # A single run ends here: the sentence on stderr, exit status 1, no traceback. A
    # multirun job raises instead, so the sweep's other jobs still run.
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sys.stderr.write(f"[{Path(hydra_cfg.runtime.output_dir).name}] {message}\n")
        raise JobError(message)
    raise SystemExit(message)


# An absolute config path: a relative one ("../conf") is resolved as a Python package
# when the app starts from its console script, and conf/ is a folder, not a package.
@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def train_app(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = str(Path(hydra_cfg.runtime.output_dir).resolve())
    try:
        inputs = prepare_training(cfg)
    except ConfigError as err:
        _stop(str(err), hydra_cfg)

    # The runtime imports torch; a config error above never pays for that.
    from pipeflow.runtime.launch import JobFailed, TrainJob, launch

    plain = job_config(cfg, hydra_cfg)
    if plain["partition"]["name"] == "profiled" and plain["partition"].get("profile") is None:
        try:
            profile_for_partition(plain, run_dir, inputs.spec, inputs.schedule.num_stages)
        except ValueError as err:
            _stop(str(err), hydra_cfg)
    job = TrainJob(cfg=plain, run_dir=run_dir, world_size=inputs.world_size)
    try:
        summary = launch(job)
    except JobFailed as err:
        _stop(str(err), hydra_cfg)
    print(format_summary(summary, run_dir))


def main() -> None:
    """The console script: a group choice with no option file (``schedule=nope``) is
    refused in one line, as every other config error is, before Hydra composes."""
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    train_app()


if __name__ == "__main__":
    main()
