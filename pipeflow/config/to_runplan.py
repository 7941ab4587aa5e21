"""Config -> the run plan (:class:`pipeflow.formats.runplan.RunPlan`): the one place a
training job's schedule, partition, segments, precision, attention, adapter and settings
are decided. :func:`pipeflow.config.prepare_training` builds it after its checks; the
launcher hands it to the ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from pipeflow.formats.checkpoint_folder import model_record, read_meta, resolve, restart_step, training_record
from pipeflow.formats.runplan import AdapterRef, Lowered, RunPlan
from pipeflow.planning.partitioners import partition_layers
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.data_parallel import pipeline_shape
from pipeflow.schedules.ir import Schedule, WeightPolicy
from pipeflow.schedules.registry import build_schedule
from pipeflow.tracking.labels import logger_labels
from pipeflow.tracking.record import run_key

from .assembly import PLANNED, schedule_options, validated
from .groups.data import data_file_list
from .resolved import Resolved
from .values import ConfigError

# partition=profiled without a profile file: (the plain config, the model's shape, the
# stages) -> the profile it measured and wrote (pipeflow-train measures the model in its
# own process, before any rank starts: ranks profiling themselves would disagree)
Measure = Callable[[dict, TransformerSpec, int], str]


def build_run_plan(cfg: DictConfig, run: Resolved, completion: list, hydra=None,
                   measure: Measure | None = None) -> RunPlan:
    """The plan of a checked train config that resolved to ``run``, whose schedule was
    validated (``completion``: its dry run's order). ``hydra``: the app's Hydra config,
    which labels a multirun's W&B runs; ``measure``: profiles the model where
    ``partition=profiled`` names no profile (without it, such a plan has no layers)."""
    family, schedule, spec, lengths = run.family, run.schedule, run.spec, run.segments
    plain = run_record(cfg, hydra)
    model, pipe = plain["model"], cfg.pipeline
    mbs, seed = int(pipe.microbatch_size), int(cfg.seed)
    tied = ()
    if family.branched:
        # bapp cuts each branch into pipeline.stages stages; chain schedules group the graph
        adapter = AdapterRef(family.adapter, dict(model_cfg=model, microbatch_size=mbs, seed=seed,
                                                  num_devices=int(pipe.stages),
                                                  stage_counts=(int(pipe.stages),) * 2
                                                  if run.schedule_spec.branch_aware else None))
        layers = [s.hi - s.lo for s in run.parts]
    else:
        layers = _layers(cfg, plain, schedule, spec, measure)
        adapter = AdapterRef(family.adapter, dict(model_cfg=model, layers_per_stage=layers, microbatch_size=mbs,
                                                  seq_len=spec.seq_len, seed=seed, spec=spec,
                                                  **({"segment_lengths": lengths} if lengths else {})))
        # the embedding (first stage) and the head (last) share one weight where the family ties them
        tied = (0, schedule.num_stages - 1) if family.tied(model) else ()
    asynchronous = schedule.policy != WeightPolicy.SYNC
    return RunPlan(
        schedule, layers, adapter, run.precision, str(model.get("attention") or "sdpa"),
        str(model.get("recompute") or "none"), Lowered.of(schedule, tied, completion),
        optim=OmegaConf.to_object(cfg.optim), trainer=OmegaConf.to_object(cfg.trainer),
        runtime=OmegaConf.to_object(cfg.runtime), logger=_logger(cfg, plain), data=plain["data"], seed=seed,
        microbatches=int(pipe.microbatches), stages=int(pipe.stages), record=plain,
        run_key=run_key(plain, **pipeline_shape(schedule, pipe.stages)),
        checkpoint_records={"model": model_record(model), "training": training_record(plain)},
        spec=spec, topology=run.topology, resume=plain.get("resume"), tied_stages=tied, segment_lengths=lengths,
        eval_lowered=_evaluation(cfg, schedule, tied) if asynchronous else None,
        chunk_lowered=_short_chunks(cfg, plain, run, tied) if asynchronous else {},
        tensor_parallel=run.tensor, sequence_parallel=run.sequence, compile=bool(cfg.get("compile", False)),
    )


def run_record(cfg: DictConfig, hydra=None) -> dict:
    """The resolved config as the run records it: plain, with the W&B labels a multirun
    gives its jobs, and paths made absolute (ranks started by torchrun may not share the
    app's working directory): ``resume``, ``partition.profile``, and ``data.files`` as the
    list of files its globs name."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    if hydra is not None:
        plain["logger"].update(logger_labels(cfg.logger, hydra))
    if plain["partition"].get("profile"):
        plain["partition"]["profile"] = str(Path(plain["partition"]["profile"]).expanduser().resolve())
    if plain.get("resume"):
        plain["resume"] = str(Path(plain["resume"]).expanduser().resolve())
    if plain["data"].get("files") is not None:
        plain["data"]["files"] = [str(Path(f).resolve()) for f in data_file_list(plain["data"]["files"])]
    return plain


def _logger(cfg: DictConfig, plain: dict):
    """The logger's settings, its labels as :func:`run_record` filled them in."""
    logger = OmegaConf.to_object(cfg.logger)
    for key in ("group", "tags", "run_name"):
        if key in plain["logger"] and hasattr(logger, key):
            setattr(logger, key, plain["logger"][key])
    return logger


def _layers(cfg: DictConfig, plain: dict, schedule: Schedule, spec: TransformerSpec, measure: Measure | None) -> list:
    """Layers per stage: the planner's own cut, else the partitioner's (a profiled one from
    the profile ``measure`` takes, where the config names none)."""
    if schedule.name == PLANNED:
        return list(schedule.layers_per_stage)
    options = plain["partition"]
    if cfg.partition.name == "profiled" and not options.get("profile"):
        if measure is None:
            return []
        options["profile"] = measure(plain, spec, schedule.num_stages)
    try:
        return partition_layers(cfg.partition.name, spec, schedule.num_stages, options)
    except ValueError as err:  # (a measured profile nothing fits into: its memory limit)
        raise ConfigError(str(err)) from None


def _evaluation(cfg: DictConfig, schedule: Schedule, tied: tuple) -> Lowered:
    """An asynchronous run's evaluation: a forward-only 1F1B over pipe 0, whose every
    mirror replica holds the same weights after a flush."""
    pipe = cfg.pipeline
    evaluation = build_schedule("1f1b", pipe.stages, pipe.microbatches)
    if evaluation.placement.table[0] != schedule.placement.table[0]:
        raise ConfigError(f"schedule.name={schedule.name}: pipe 0 must place stage i on device i for evaluation")
    return Lowered.of(evaluation, tied)


def _short_chunks(cfg: DictConfig, plain: dict, run: Resolved, tied: tuple) -> dict[int, Lowered]:
    """The chunks shorter than the schedule's windows a run trains, {their windows: their
    schedule, lowered}: the last, which the run's end cuts short, and a resumed run's
    first, from where it restarts to the windows' grid (a synchronous checkpoint, or one
    written with other windows, lies off the grid)."""
    schedule, pipe, steps = run.schedule, cfg.pipeline, int(cfg.trainer.steps)
    windows = schedule.windows
    begin = 0  # the step the run's first chunk starts after
    if plain.get("resume"):
        folder, _ = resolve(plain["resume"])
        begin = restart_step(read_meta(folder, plain["resume"]), steps)
    lengths = {_chunk_length(begin, steps, windows), steps - max(begin, (steps - 1) // windows * windows)}
    out = {}
    for length in sorted(lengths - {windows}):
        options = dict(schedule_options(cfg.schedule, run.schedule_spec), windows=length)
        try:
            chunk = build_schedule(cfg.schedule.name, pipe.stages, pipe.microbatches, pipe.virtual_stages,
                                   pipe.segments, check=False,
                                   **({"graph": schedule.graph} if run.family.branched else {}), **options)
        except ScheduleConfigError as err:
            raise ConfigError(str(err)) from None
        out[length] = Lowered.of(chunk, tied, validated(chunk, cfg))
    return out


def _chunk_length(done: int, steps: int, windows: int) -> int:
    """The steps of the chunk after step ``done``: chunks lie on a grid of ``windows``
    steps (1..W, W+1..2W, ...), the last cut by the run's end (the runtime's
    ``_chunk_end``)."""
    return min(steps, (done // windows + 1) * windows) - done
