"""pipeflow-plan's configuration: its schema (the ``plan`` options beside the model,
topology, pipeline and precision every app shares), composition and the up-front check
that builds the model shape and topology.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from pipeflow.families import FAMILIES, family_of
from pipeflow.planning.baselines import BASELINES
from pipeflow.planning.placement_plan import GB
from pipeflow.planning.transformer import TransformerSpec
from pipeflow.topology.presets import build_topology
from pipeflow.topology.topology import Topology

from .checks import check_known_keys
from .groups.model import resolve_model
from .groups.precision import resolve_precision
from .schema import CONF_DIR, register_configs
from .tensor_degree import grouped_topology
from .values import ConfigError, at_least


# plan.method: the topology-aware planner, or one of the baselines it is compared with
METHODS = ("planner", *BASELINES)


@dataclass
class PlanPipelineConfig:
    microbatches: int = 16
    microbatch_size: int = 1


@dataclass
class PlanOptions:
    memory_limit_gb: Optional[float] = None
    stages: Optional[int] = None
    replicas: Optional[int] = None
    efficiency: float = 0.5
    dtype_bytes: Optional[int] = None  # null: from precision (fp32: 4, bf16/fp16: 2)
    top_k: int = 12
    method: str = "planner"  # planner, or a baseline of pipeflow.planning.baselines (uniform, pipedream, dapple)
    # tensor degrees to plan with (pipeline.tensor_parallel: each device a group of T GPUs of one node);
    # those the nodes and the model take, the fastest fitting plan of them wins
    tensor_parallel: List[int] = field(default_factory=lambda: [1])
    sequence_parallel: bool = True  # with T > 1 (pipeline.sequence_parallel)


@dataclass
class PlanAppConfig:
    pipeline: PlanPipelineConfig = field(default_factory=PlanPipelineConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)
    model: Any = MISSING
    topology: Any = MISSING
    baselines: bool = True
    draw: bool = True
    precision: str = "auto"  # auto | fp32 | bf16 | fp16 (auto: fp32 on CPUs, bf16 on GPUs)
    logger: Any = MISSING  # logger/none (plan.yaml's default) or logger/wandb: one W&B run per job


def register_plan_configs() -> None:
    register_configs()
    ConfigStore.instance().store(group="schema", name="plan_app", node=PlanAppConfig)


register_plan_configs()


def compose_plan(overrides=()) -> DictConfig:
    """Compose conf/plan.yaml outside ``@hydra.main`` (tests)."""
    from hydra import compose, initialize_config_dir

    register_plan_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("plan", overrides=list(overrides))


@dataclass
class PlanInputs:
    """What a plan config composes into; built once by :func:`prepare_plan`."""

    spec: TransformerSpec
    topology: Topology
    limit: float | None  # bytes per device; None: each device's own memory
    kw: dict  # efficiency and dtype_bytes, as the planner and the baselines take them
    # plan.tensor_parallel: each degree the nodes and the model take -> the topology seen as its
    # groups (the physical one at T = 1); and why each other degree is left out
    tensors: dict[int, Topology] = field(default_factory=dict)
    left_out: dict[int, str] = field(default_factory=dict)
    sequence_parallel: bool = False  # plan.sequence_parallel (it applies at T > 1)


def prepare_plan(cfg: DictConfig) -> PlanInputs:
    """Check a plan config and build the model shape and topology it names, or raise
    ConfigError, one sentence naming the key. Nothing is planned or written."""
    check_known_keys(cfg)
    resolve_model(cfg)
    pipe, opts = cfg.pipeline, cfg.plan
    at_least("pipeline.microbatches", pipe.microbatches, 1)
    at_least("pipeline.microbatch_size", pipe.microbatch_size, 1)
    try:
        family = family_of(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not family.transformer:
        shaped = ", ".join(f.name for f in FAMILIES.values() if f.transformer)
        raise ConfigError(f"model.family={family.name}: pipeflow-plan plans one transformer stack; "
                          f"allowed values: {shaped}")
    try:
        spec = TransformerSpec.from_config(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        topology = build_topology(cfg.topology)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    limit_gb = opts.memory_limit_gb
    if limit_gb is not None and not (isinstance(limit_gb, (int, float)) and limit_gb > 0):
        raise ConfigError(f"plan.memory_limit_gb={limit_gb}: must be a number > 0, or null for the devices' memory")
    if opts.method not in METHODS:
        raise ConfigError(f"plan.method={opts.method}: unknown planning method; allowed values: {', '.join(METHODS)}")
    if opts.method != "planner" and opts.replicas not in (None, 1):
        raise ConfigError(f"plan.replicas={opts.replicas}: plan.method={opts.method} plans one pipeline; "
                          f"replicas need plan.method=planner")
    limit = None if limit_gb is None else float(limit_gb) * GB
    precision = resolve_precision(cfg, topology)
    dtype = opts.dtype_bytes if opts.dtype_bytes is not None else 4 if precision == "fp32" else 2
    sp = opts.sequence_parallel
    if not isinstance(sp, bool):
        raise ConfigError(f"plan.sequence_parallel={sp}: allowed values: true, false")
    tensors, left_out = tensor_degrees(cfg, spec, topology)
    return PlanInputs(spec, topology, limit, dict(efficiency=float(opts.efficiency), dtype_bytes=int(dtype)),
                      tensors, left_out, sp)


def tensor_degrees(cfg: DictConfig, spec: TransformerSpec, topology: Topology) -> tuple[dict, dict]:
    """plan.tensor_parallel: ({T: the topology seen as tensor groups of T}, {T: why it is
    left out}) by the rules a run with pipeline.tensor_parallel=T is checked by (the model's
    heads, key/value heads, MLP width, with plan.sequence_parallel its sequence:
    :func:`pipeflow.config.tensor_degree.check_tensor_parallel`; a group inside a node:
    :func:`pipeflow.topology.tensor.tensor_topology`). ConfigError when none is left."""
    given = list(cfg.plan.tensor_parallel or [])
    if not given or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in given):
        raise ConfigError(f"plan.tensor_parallel={given}: give a list of whole numbers >= 1 (tensor degrees, "
                          f"e.g. [1, 2, 4, 8])")
    tensors: dict[int, Topology] = {}
    left: dict[int, str] = {}
    def grouped(t: int) -> Topology | str:
        return grouped_topology(spec, topology, t, cfg.plan.sequence_parallel)

    for t in sorted(set(given)):
        got = grouped(t)
        if isinstance(got, str):
            left[t] = got
        else:
            tensors[t] = got
    if not tensors:
        most = min(sum(d.node == n for d in topology.devices) for n in {d.node for d in topology.devices})
        allowed = [t for t in range(1, most + 1) if not isinstance(grouped(t), str)]
        raise ConfigError(f"plan.tensor_parallel={given}: no degree splits model '{spec.name}' inside a node of "
                          f"topology '{topology.name}'; allowed values: {allowed} (" + "; ".join(left.values()) + ")")
    return tensors, left
