"""The ``pipeline`` group: depth, microbatches, chunks, segments and replicas of every app."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from pipeflow.numbers import is_whole

from pipeflow.schedules.sharding import GATHER_POLICIES

from ..values import ConfigError

# what data-parallel replicas of a stage shard (pipeflow.runtime.sharded): nothing, the
# optimizer state (ZeRO-1: each replica updates its slice of the stage, then all gather),
# the gradients too (ZeRO-2: the stage's gradients reduce-scattered into the slices), or
# the parameters too (ZeRO-3/FSDP: gathered by the schedule's GATHERs, pipeline.gather)
SHARD_LEVELS = ("none", "optimizer", "gradients", "full")


@dataclass
class PipelineConfig:
    stages: int = 4  # pipeline depth p (devices of one pipeline)
    microbatches: int = 8  # m per iteration
    virtual_stages: int = 1  # model chunks per device (interleaved_1f1b)
    segments: int = 1  # sequence segments per microbatch (Seq1F1B)
    microbatch_size: int = 1  # sequences per microbatch
    data_parallel: int = 1  # replicas of the whole pipeline (n x stages devices); microbatches is per replica
    shard: str = "none"  # what the replicas shard: none | optimizer (ZeRO-1) | gradients (ZeRO-2) | full (ZeRO-3)
    gather: str = "step"  # full: when a stage's parameters are gathered: step | chunk | microbatch
    tensor_parallel: int = 1  # ranks each device's stages are split across, Megatron style (T x devices ranks)
    sequence_parallel: bool = False  # tensor_parallel > 1: norms, dropout and stage messages on s/T tokens

def check_pipeline(cfg: DictConfig) -> None:
    pipe = cfg.pipeline
    for key in ("stages", "microbatches", "virtual_stages", "segments", "microbatch_size", "data_parallel",
                "tensor_parallel"):
        value = pipe[key]
        if not is_whole(value) or value < 1:
            raise ConfigError(f"pipeline.{key}={value}: must be a whole number >= 1")
    shard = pipe.get("shard", "none")
    if shard not in SHARD_LEVELS:
        raise ConfigError(f"pipeline.shard={shard}: allowed values: {', '.join(SHARD_LEVELS)}")
    gather = pipe.get("gather", "step")
    if gather not in GATHER_POLICIES:
        raise ConfigError(f"pipeline.gather={gather}: allowed values: {', '.join(GATHER_POLICIES)}")
    sp = pipe.get("sequence_parallel", False)
    if not isinstance(sp, bool):
        raise ConfigError(f"pipeline.sequence_parallel={sp}: allowed values: true, false")
    if sp and pipe.tensor_parallel == 1:
        raise ConfigError("pipeline.sequence_parallel=true: it splits the sequence across a stage's tensor-parallel "
                          "ranks; use it with pipeline.tensor_parallel > 1 (or sequence_parallel=false)")
