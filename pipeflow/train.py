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

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeflow.config import (
    CONF_DIR,
    ConfigError,
    drop_empty_run_dir,
    run_app,
    prepare_training,
    register_configs,
    save_hydra_config,
)
from pipeflow.faults import Fault, WriteFailed
from pipeflow.config.groups.resume import resume_changes
from pipeflow.runtime.cluster import adopt_launcher_env, alive

# Hydra composes against these schemas, so they must be in the ConfigStore before main().
register_configs()

# Hydra sends it to the console (plain) and to the run folder's train.log (time-stamped)
log = logging.getLogger("pipeflow.train")


class JobError(CompactHydraException):
    """One multirun job that could not run. Hydra prints the message without a traceback,
    goes on with the other jobs, and exits non-zero at the end."""


def profile_for_partition(plain: dict, spec, num_stages: int, run_dir: str) -> str:
    """partition=profiled without a profile file: measure the model here, in the app
    process, before any rank starts (ranks profiling themselves would disagree on the
    split), and write run_dir/profile.json: the run plan's cut is that profile's."""
    import torch

    from pipeflow.models.profiler import profile_model

    rt = plain["runtime"]
    cuda = torch.cuda.is_available() and rt["device"] in ("auto", "cuda")
    prof = profile_model(
        plain["model"], int(plain["pipeline"]["microbatch_size"]), seed=int(plain["seed"]),
        device="cuda" if cuda else "cpu", threads=int(rt["threads_per_rank"]),
    )
    return str(prof.save(Path(run_dir) / "profile.json"))


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


CLAIM = ".pipeflow-run"  # in a run folder while a pipeflow-train writes there: its pid


def _place(mine: Path, path: Path) -> None:
    """``path`` made ``mine``'s copy, or FileExistsError: a hard link where the file system
    has them (the file appears whole), else an exclusive create written at once."""
    try:
        os.link(mine, path)
        return
    except FileExistsError:
        raise
    except OSError:  # no hard links here
        pass
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(mine.read_text())


def claim_run_dir(run_dir: str) -> Path:
    """Make ``run_dir`` this run's alone, or say why it cannot be: another pipeflow-train
    writing there now (two started in the same second share Hydra's default folder), or
    a finished run's metrics already there (two runs' steps would interleave). The claim
    is a file created exclusively, so of two racing runs exactly one gets the folder."""
    path = Path(run_dir) / CLAIM
    for earlier in ("metrics.jsonl", "summary.json"):
        if (Path(run_dir) / earlier).exists():
            raise ConfigError(f"hydra.run.dir={run_dir}: holds another run's {earlier}; give a new folder "
                              f"(or resume=<that folder> with a new hydra.run.dir to continue it)")
    # the claim appears with its pid already in it (written aside, then linked in place, which
    # fails where one exists): a racing run never reads a claim still empty and takes it
    # for a dead run's
    mine = path.with_name(f"{CLAIM}.{os.getpid()}")
    try:
        mine.write_text(f"{os.getpid()}\n")
    except OSError as err:
        mine.unlink(missing_ok=True)
        raise WriteFailed(mine, err) from None
    try:
        for _ in range(2):
            try:
                _place(mine, path)
            except FileExistsError:
                try:
                    pid = int(path.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and pid != os.getpid() and alive(pid):
                    raise ConfigError(f"hydra.run.dir={run_dir}: another pipeflow-train (pid {pid}) is writing "
                                      f"there; give this run its own folder (hydra.run.dir=...)") from None
                path.unlink(missing_ok=True)  # a claim left by a run that died: take the folder
                continue
            return path
    finally:
        mine.unlink(missing_ok=True)
    raise ConfigError(f"hydra.run.dir={run_dir}: could not claim the folder (another run took it just now)")


def _to_log_file(line: str) -> None:
    """``line`` into the run folder's train.log only (the console hears it from _stop)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


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
    # under torchrun every process is a rank writing into rank 0's folder: none claims it
    torchrun = adopt_launcher_env()  # torchrun's variables, or srun's translated into them
    try:
        claim = None if torchrun else claim_run_dir(run_dir)
    except Fault as err:
        drop_empty_run_dir(run_dir)
        _stop(str(err), hydra_cfg)
    try:
        save_hydra_config(cfg)  # once the folder is this run's: a run refused above leaves another's alone
        # (partition=profiled without a profile: measured into the claimed folder, after every check)
        inputs = prepare_training(cfg, hydra_cfg, lambda plain, spec, stages: profile_for_partition(
            plain, spec, stages, run_dir))
    except Fault as err:  # a bad config, a file that could not be written: one sentence
        if claim is not None:
            claim.unlink(missing_ok=True)
        drop_empty_run_dir(run_dir)
        _stop(str(err), hydra_cfg)
    if not torchrun:  # its imports run while this process imports torch and builds the job
        from pipeflow.runtime.rank_server import start_rank_server

        start_rank_server()
    try:
        _train(inputs, hydra_cfg, run_dir)
    finally:
        if claim is not None:
            claim.unlink(missing_ok=True)


def _train(inputs, hydra_cfg, run_dir: str) -> None:
    """Launch the checked job in its claimed folder and print its summary."""
    # The runtime imports torch; a config error above never pays for that.
    from pipeflow.runtime.launch import JobFailed, JobStopped, TrainJob, launch

    plan = inputs.plan
    for change in resume_changes(inputs.config):
        log.info(change)
    log.info(f"training {plan.record['model']['name']} with {plan.schedule.name}: p={plan.stages}, "
             f"m={plan.microbatches}, {plan.trainer.steps} steps on {plan.world_size} ranks; run folder {run_dir}")
    try:
        summary = launch(TrainJob(plan, run_dir), on_start=lambda rank, pid: log.info(f"rank {rank}: pid {pid}"))
    except JobStopped as stopped:
        last = stopped.summary.get("last_step", 0)
        log.info(f"stopped by {stopped.signal} after step {last} of {plan.trainer.steps}; "
                 f"summary.json (status: interrupted) and the metrics so far are in {run_dir}")
        raise SystemExit(128 + stopped.signum) from None
    except JobFailed as err:
        # one line, printed once (a rank's traceback, for a bug, it printed itself; the
        # whole of it is in failure.json), and into train.log beside the run's other lines
        line = str(err).splitlines()[0]
        _to_log_file(line)
        _stop(line, hydra_cfg)
    log.info(format_summary(summary, run_dir))
    if plan.record.get("export") == "hf" and summary.get("status") == "finished":
        from pipeflow.faults import Fault
        from pipeflow.formats.hf_folder import export_hf

        try:
            out = export_hf(run_dir, Path(run_dir) / "hf", plan.record["model"])
        except Fault as err:
            line = str(err)
            if isinstance(err, OSError):  # a full disk: the run and its checkpoint are whole, no export is there
                line += (f"; the run finished and its checkpoint is whole: make room and export it with "
                         f"python -m pipeflow.formats.hf_folder {run_dir}")
            _to_log_file(line)
            _stop(line, hydra_cfg)
        log.info(f"wrote the trained model as a Hugging Face folder: {out} (transformers' from_pretrained loads it)")
    if summary.get("status") == "diverged":
        log.info(f"the loss is not finite from step {summary['diverged_at']}: the run diverged "
                 f"(a lower optim.lr, or precision=bf16 rather than fp16, may hold it)")
    elif summary.get("status") == "no_updates":
        log.info("every step's gradients overflowed and were skipped: nothing was trained "
                 "(precision=bf16 or fp32 needs no loss scaling)")


def main() -> None:
    """The console script: the command line checked before Hydra composes (a group choice
    with no option file, a misspelt key, a run folder that cannot be written: one line
    each); Ctrl-C before the ranks start ends in one line too."""
    run_app(train_app, "train")


if __name__ == "__main__":
    main()
