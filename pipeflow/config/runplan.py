"""Config -> the run plan (:class:`pipeflow.formats.runplan.RunPlan`): the one place a
training job's schedule, partition, segments, precision, attention and adapter are
decided. :func:`pipeflow.config.prepare_training` builds it after its checks; the
launcher hands it to the ranks.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from pipeflow.families import family_of
from pipeflow.formats.runplan import AdapterRef, RunPlan
from pipeflow.planning.partition import partition_layers
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.schedules.common import ScheduleConfigError
from pipeflow.schedules.ir import Schedule, WeightPolicy
from pipeflow.schedules.registry import build_schedule

from .assembly import PLANNED, schedule_options, schedule_spec, segment_lengths
from .values import ConfigError


def build_run_plan(cfg: DictConfig, schedule: Schedule, spec: TransformerSpec | None,
                   branch_layers: list[int] | None = None) -> RunPlan:
    """The plan of a checked train config whose ``schedule`` was validated. ``spec``: the
    chain model's shape (None for a concurrent-branch model, whose stages' layer counts
    are ``branch_layers``). A profiled partition without its profile gets no layers
    yet (pipeflow-train measures the model, then :meth:`RunPlan.with_layers`)."""
    family = family_of(cfg.model)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    pipe = cfg.pipeline
    mbs, seed = int(pipe.microbatch_size), int(cfg.seed)
    lengths = None
    if family.branched:
        bapp = schedule_spec(cfg.schedule).branch_aware
        # bapp cuts each branch into pipeline.stages stages; chain schedules group the graph
        adapter = AdapterRef(family.adapter, dict(model_cfg=model, microbatch_size=mbs, seed=seed,
                                                  num_devices=int(pipe.stages),
                                                  stage_counts=(int(pipe.stages),) * 2 if bapp else None))
        layers = list(branch_layers or [])
    else:
        if schedule.name == PLANNED:
            layers = list(schedule.layers_per_stage)
        elif cfg.partition.name == "profiled" and not cfg.partition.get("profile"):
            layers = []
        else:
            layers = partition_layers(cfg.partition.name, spec, schedule.num_stages,
                                      OmegaConf.to_container(cfg.partition, resolve=True))
        lengths = segment_lengths(cfg)
        adapter = AdapterRef(family.adapter, dict(model_cfg=model, layers_per_stage=layers, microbatch_size=mbs,
                                                  seq_len=spec.seq_len, seed=seed,
                                                  **({"segment_lengths": lengths} if lengths else {})))
    plan = RunPlan(schedule, layers, adapter, str(cfg.precision), str(model.get("attention") or "sdpa"), lengths,
                   tensor_parallel=int(pipe.get("tensor_parallel", 1)),
                   sequence_parallel=bool(pipe.get("sequence_parallel", False)))
    if schedule.policy != WeightPolicy.SYNC:
        _asynchronous(plan, cfg, family.branched)
    return plan


def _asynchronous(plan: RunPlan, cfg: DictConfig, branched: bool) -> None:
    """An asynchronous run's other schedules: its evaluation (a forward-only 1F1B over
    pipe 0, whose every mirror replica holds the same weights after a flush) and the
    shorter last chunk a run whose steps are no multiple of the schedule's windows ends on."""
    pipe, schedule = cfg.pipeline, plan.schedule
    plan.eval_schedule = build_schedule("1f1b", pipe.stages, pipe.microbatches)
    if plan.eval_schedule.placement.table[0] != schedule.placement.table[0]:
        raise ConfigError(f"schedule.name={schedule.name}: pipe 0 must place stage i on device i for evaluation")
    last = int(cfg.trainer.steps) % schedule.windows
    if last:
        options = dict(schedule_options(cfg.schedule), windows=last)
        try:
            plan.chunk_schedules[last] = build_schedule(
                cfg.schedule.name, pipe.stages, pipe.microbatches, pipe.virtual_stages, pipe.segments,
                **({"graph": schedule.graph} if branched else {}), **options)
        except ScheduleConfigError as err:
            raise ConfigError(str(err)) from None
