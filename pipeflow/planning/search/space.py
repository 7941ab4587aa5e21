"""What the schedule search walks: every (schedule, stages, data and tensor parallelism,
microbatches, microbatch size, chunks, segments, recomputation, partition, sharding) that
uses all ``stages x data_parallel x tensor_parallel`` devices and trains the same global
batch, ``data_parallel x microbatches x microbatch_size`` sequences per update."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterator, Sequence

from pipeflow.schedules.registry import get_spec, specs
from pipeflow.schedules.spec import ScheduleSpec

RECOMPUTE = ("none", "selective", "full")
SHARDS = ("none", "optimizer", "gradients", "full")  # pipeline.shard (with data parallelism)
GATHERS = ("step", "chunk", "microbatch")  # pipeline.gather (with pipeline.shard=full)
PARTITIONS = ("uniform", "parameters")
SPLITS = ("uniform", "compute")


@dataclass(frozen=True)
class Candidate:
    """One way to train the global batch; its fields are pipeflow-train's keys."""

    schedule: str
    stages: int  # pipeline.stages: devices per pipeline
    data_parallel: int  # pipeline.data_parallel: replicas of the pipeline
    microbatches: int  # pipeline.microbatches, per replica
    microbatch_size: int  # pipeline.microbatch_size
    virtual_stages: int = 1  # pipeline.virtual_stages: model chunks per device
    segments: int = 1  # pipeline.segments: sequence segments per microbatch
    recompute: str = "none"  # model.recompute
    partition: str = "uniform"  # partition.name
    split: str = "uniform"  # schedule.split: how a segmented schedule cuts the sequence (uniform, compute)
    shard: str = "none"  # pipeline.shard: what the data-parallel replicas of a stage shard
    gather: str = "step"  # pipeline.gather: when a fully sharded stage gathers (shard=full only)
    tensor_parallel: int = 1  # pipeline.tensor_parallel: GPUs (of one node) splitting each pipeline device
    sequence_parallel: bool = False  # pipeline.sequence_parallel (tensor_parallel > 1)

    @property
    def devices(self) -> int:
        return self.stages * self.data_parallel * self.tensor_parallel

    @property
    def global_batch(self) -> int:
        return self.data_parallel * self.microbatches * self.microbatch_size

    def overrides(self) -> list[str]:
        """The pipeflow-train (and pipeflow-simulate) command-line overrides that run it."""
        return [f"schedule={self.schedule}", f"pipeline.stages={self.stages}",
                f"pipeline.data_parallel={self.data_parallel}", f"pipeline.microbatches={self.microbatches}",
                f"pipeline.microbatch_size={self.microbatch_size}", f"pipeline.virtual_stages={self.virtual_stages}",
                f"pipeline.segments={self.segments}", f"model.recompute={self.recompute}",
                f"partition={self.partition}", *([f"schedule.split={self.split}"] if self.segments > 1 else []),
                *([f"pipeline.shard={self.shard}"] if self.shard != "none" else []),
                *([f"pipeline.gather={self.gather}"] if self.shard == "full" else []),
                *([f"pipeline.tensor_parallel={self.tensor_parallel}"] if self.tensor_parallel > 1 else []),
                *(["pipeline.sequence_parallel=true"] if self.sequence_parallel else [])]

    def label(self) -> str:
        """A short name: 1f1b p4xdp2xtp8-sp m8x2 v2 s4 full params."""
        out = [self.schedule, f"p{self.stages}" + (f"xdp{self.data_parallel}" if self.data_parallel > 1 else "")
               + (f"xtp{self.tensor_parallel}" + ("-sp" if self.sequence_parallel else "")
                  if self.tensor_parallel > 1 else ""),
               f"m{self.microbatches}x{self.microbatch_size}"]
        if self.virtual_stages > 1:
            out.append(f"v{self.virtual_stages}")
        if self.segments > 1:
            out.append(f"s{self.segments}")
        if self.recompute != "none":
            out.append(self.recompute)
        if self.partition != "uniform":
            out.append(self.partition)
        if self.split != "uniform":
            out.append(f"{self.split}-split")
        if self.shard != "none":  # ZeRO-1, 2, 3 (and when a fully sharded stage gathers)
            out.append({"optimizer": "zero1", "gradients": "zero2"}.get(self.shard, f"zero3-{self.gather}"))
        return " ".join(out)

    def to_dict(self) -> dict:
        # (its fields are plain values: no deep copy, which took most of writing a
        # 100,000-row candidates.csv)
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in fields(Candidate))


@dataclass
class SearchSpace:
    """The options each dimension may take (``search.*`` keys)."""

    devices: int  # devices every candidate uses (stages x data_parallel x tensor_parallel)
    global_batch: int  # sequences per update
    n_layer: int  # the model's layers: a stage (chunk) holds one at least
    schedules: Sequence[str]
    stages: Sequence[int] | None = None  # None: every divisor of devices up to n_layer
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8)
    virtual_stages: Sequence[int] = (2, 4)  # for schedules that interleave chunks
    segments: Sequence[int] = (2, 4, 8)  # for schedules that cut sequences into segments
    recompute: Sequence[str] = RECOMPUTE
    partitions: Sequence[str] = PARTITIONS
    splits: Sequence[str] = SPLITS  # for schedules that cut sequences into segments
    shards: Sequence[str] = SHARDS  # for candidates with data-parallel replicas
    gathers: Sequence[str] = ("step",)  # for shards=full
    # (tensor degree, sequence parallel) options, already those the model and a node take
    tensors: Sequence[tuple[int, bool]] = ((1, False),)
    skipped: dict = field(default_factory=dict)  # why combinations were left out -> how many

    def stage_counts(self, tensor: int = 1) -> list[int]:
        """Pipeline depths that divide the devices left to pipelines (devices / tensor)."""
        devices = self.devices // tensor
        if self.stages is not None:
            return sorted({int(p) for p in self.stages if devices % int(p) == 0})
        return [p for p in range(1, devices + 1) if devices % p == 0 and p <= self.n_layer]


def default_schedules(staleness: bool) -> list[str]:
    """Every built-in chain schedule the runtime trains: the synchronous ones, and with
    ``staleness`` (weights updated without a flush allowed) the asynchronous ones too."""
    return [s.name for s in specs() if searchable(s) is None and (staleness or not s.asynchronous)]


def searchable(spec: ScheduleSpec) -> str | None:
    """Why a schedule cannot be searched over, or None."""
    if spec.branch_aware:
        return "it schedules a branched model's stage graph"
    if spec.assemble is not None or not spec.sized:
        return "it is not generated from the pipeline's sizes alone"
    if not spec.runtime:
        return "pipeflow-train does not run it"
    return None


def _chunk_options(spec: ScheduleSpec, space: SearchSpace) -> list[int]:
    return sorted({int(v) for v in space.virtual_stages if v > 1}) if spec.virtual_stages else [1]


def _segment_options(spec: ScheduleSpec, space: SearchSpace) -> list[int]:
    return sorted({int(s) for s in space.segments if s > 1}) if spec.segments else [1]


def candidates(space: SearchSpace) -> Iterator[Candidate]:
    """Every combination whose sizes add up (the global batch divides, a chunk per layer at
    least; a schedule's own size rules are the generator's, checked when it is priced).
    Combinations left out are counted in ``space.skipped`` by reason."""
    def skip(why: str) -> None:
        space.skipped[why] = space.skipped.get(why, 0) + 1

    for name in space.schedules:
        spec = get_spec(name)
        for t, sp in space.tensors:
            if t > 1 and spec.asynchronous:
                skip("asynchronous schedules keep whole stages (no tensor parallelism)")
                continue
            for p in space.stage_counts(t):
                yield from _pipelines(space, spec, p, t, sp, skip)


def _pipelines(space: SearchSpace, spec: ScheduleSpec, p: int, t: int, sp: bool, skip) -> Iterator[Candidate]:
    """The candidates of one schedule on pipelines of ``p`` devices of ``t`` GPUs each."""
    dp = space.devices // (p * t)
    if dp > 1 and spec.asynchronous:
        skip("asynchronous schedules run one pipeline (no data parallelism)")
        return
    for mbs in space.microbatch_sizes:
        per_replica, rest = divmod(space.global_batch, dp * mbs)
        if rest or per_replica < 1:
            skip("the global batch does not divide into data_parallel x microbatch_size")
            continue
        for v in _chunk_options(spec, space):
            if p * v > space.n_layer:
                skip("more stages (stages x virtual_stages) than layers")
                continue
            for s in _segment_options(spec, space):
                for split in (space.splits if s > 1 else space.splits[:1]):
                    for r in space.recompute:
                        # one stage: every partition is the same
                        for part in (space.partitions if p * v > 1 else space.partitions[:1]):
                            for shard, gather in _shardings(space, dp, spec):
                                yield Candidate(spec.name, p, dp, per_replica, int(mbs), v, s, r, part, split,
                                                shard, gather, t, sp)


def _shardings(space: SearchSpace, dp: int, spec: ScheduleSpec) -> list[tuple[str, str]]:
    """(pipeline.shard, pipeline.gather) options: with replicas each level asked for (full
    with each gather policy), without them (or asynchronous) none but "none"."""
    if dp == 1 or spec.asynchronous:
        return [("none", "step")]
    return [(sh, g) for sh in space.shards for g in (space.gathers if sh == "full" else ("step",))]
