"""Typed schemas for the Hydra config groups, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` starts from one of these schemas
(``defaults: [/schema/..., _self_]``), so a misspelt key in a file or on the command line
fails at composition time instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from pipeflow.planning.costs import COST_MODELS
from pipeflow.schedules.registry import specs
from pipeflow.topology.presets import PRESETS

from .assembly import PLANNED_SPEC  # noqa: F401 - registers schedule=planned before the schemas are derived
from .apphelp import register_help
from .derive import _cost_schema, _topology_schema, schedule_schema


# conf/ sits next to the package in the repository; an editable install finds it there.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


# ----------------------------------------------------------------------------- schemas


@dataclass
class PipelineConfig:
    stages: int = 4  # pipeline depth p (devices of one pipeline)
    microbatches: int = 8  # m per iteration
    virtual_stages: int = 1  # model chunks per device (interleaved_1f1b)
    segments: int = 1  # sequence segments per microbatch (Seq1F1B)
    microbatch_size: int = 1  # sequences per microbatch
    data_parallel: int = 1  # replicas of the whole pipeline (n x stages devices); microbatches is per replica


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = "gpt"  # one of pipeflow.families.FAMILIES: gpt, bert (hf_causal: HFModelConfig; cbm: cbm_shape)
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    n_inner: Optional[int] = None  # FFN width; None means 4 * n_embd
    vocab_size: int = MISSING
    n_positions: int = MISSING
    seq_len: int = MISSING
    dropout: float = 0.0  # read by pipeflow.models; the cost model counts dropout masks when > 0
    recompute: str = "none"  # activation recomputation: none | full | selective (pipeflow.models.recompute)
    attention: str = "sdpa"  # sdpa (the fused kernel) | eager (scores kept): pipeflow.models.attention


@dataclass
class HFModelConfig:
    """model.family=hf_causal: a Hugging Face decoder from its config (pipeflow.hf)."""

    name: str = MISSING
    family: str = "hf_causal"
    config: Optional[str] = None  # a config.json, or a local model folder holding one (never a hub id)
    hf: Dict[str, Any] = field(default_factory=dict)  # transformers config fields, over the file's (model_type, ...)
    weights: Optional[str] = None  # a local folder of *.safetensors to start from; null: seeded initialisation
    seq_len: int = MISSING  # tokens per training sequence
    recompute: str = "none"  # activation recomputation: none | full | selective (pipeflow.models.recompute)
    attention: str = "sdpa"  # sdpa (the fused kernel) | eager (scores kept): pipeflow.models.attention
    # read from the HF config before any rank starts (pipeflow.hf.resolve); leave them unset
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    n_inner: Optional[int] = None
    vocab_size: Optional[int] = None
    n_positions: Optional[int] = None
    n_kv_head: Optional[int] = None  # grouped-query attention: key/value heads
    head_dim: Optional[int] = None
    mlp: Optional[str] = None  # gated (gate, up, down: SwiGLU) | gelu (two matrices)
    norm: Optional[str] = None  # rmsnorm | layernorm
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    mlp_bias: Optional[bool] = None
    tied: Optional[bool] = None  # the LM head shares the token embedding
    positions: Optional[str] = None  # rotary | learned
    dropout: Optional[float] = None  # the HF config's largest dropout probability


@dataclass
class SimulateConfig:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    schedule: Any = MISSING  # typed by the schedule's own schema (schedule_schema)
    model: Any = MISSING  # GPT/BERT options compose /schema/model, HF decoders /schema/model_hf; a CBM: cbm_shape
    # Typed by the option's own schema (cost/unit and cost/analytic differ), hence Any.
    topology: Any = MISSING
    cost: Any = MISSING
    export: Optional[str] = None  # torch_csv: also write schedule.csv
    draw: Union[bool, str] = "auto"  # timeline.png: auto (when it can be read), true (always), false (never)
    precision: str = "bf16"  # fp32 | bf16 | fp16: bytes per element and the devices' peak for it (analytic cost)
    logger: Any = MISSING  # logger/none (simulate.yaml's default) or logger/wandb: one W&B run per job


@dataclass
class TrainerConfig:
    steps: int = 300  # optimizer steps (pipeline iterations) of the whole run
    log_every: int = 1  # a metrics.jsonl line every N steps
    val_every: int = 50  # validation loss every N steps; 0: never
    val_batches: int = 4  # batches per validation
    save_every: int = 0  # a checkpoint every N steps; 0: only at the end
    timeline_step: Optional[int] = 5  # the step (1..steps) whose actions are timed into timeline.json/png; null: none


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20  # linear warm-up from 0
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at trainer.steps
    grad_clip: Optional[float] = 1.0  # global gradient-norm clip; null or 0: none


@dataclass
class LocalRuntimeConfig:
    name: str = "local"
    backend: str = "auto"  # auto: nccl when CUDA is available, else gloo
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast dtype; fp32 master weights and optimizer state
    loss_scale: float = 65536.0  # fp16: the initial dynamic loss scale
    p2p: str = "tagged"  # tagged | ordered: point-to-point messages matched by tag, or per pair in order (NCCL)
    timeout_s: float = 60.0  # a collective or P2P op that takes longer fails the run
    hang_timeout_s: float = 30.0  # a rank silent this long (stopped, stuck) fails the run, named; 0: never
    master_port: Optional[int] = None  # null: a free port
    threads_per_rank: int = 1  # torch intra-op threads of each rank
    fail_at_step: Optional[int] = None  # test hook: rank fail_rank fails at this step
    fail_rank: Optional[int] = None
    fail_mode: str = "raise"  # raise: a Python error; kill: SIGKILL, as an out-of-memory kill would
    dump_grads: bool = False  # test hook: each rank writes run_dir/grads/rank<r>.pt after its first backward


@dataclass
class WandbLoggerConfig:
    name: str = "wandb"
    project: str = "pipeflow"
    mode: str = "auto"  # auto: WANDB_MODE if set, else online when logged in, else offline
    group: Optional[str] = None  # null: a multirun's jobs share one group named after the sweep
    tags: List[str] = field(default_factory=list)  # a multirun adds each job's overrides
    run_name: Optional[str] = None  # null: a multirun names the run after its job folder
    entity: Optional[str] = None


@dataclass
class NoLoggerConfig:
    name: str = "none"


@dataclass
class TrainConfig:
    # The default pipeline is small enough for two CPU ranks; train.yaml spells it out.
    pipeline: PipelineConfig = field(
        default_factory=lambda: PipelineConfig(stages=2, microbatches=4, microbatch_size=4)
    )
    schedule: Any = MISSING  # typed by the schedule's own schema (schedule_schema)
    # GPT and BERT options compose /schema/model themselves (so a misspelt key still
    # fails); a concurrent-branch model has two branches and is checked by cbm_shape
    model: Any = MISSING
    # data and partition options carry their own keys (pipeflow.data, planning.partition)
    data: Any = MISSING
    partition: Any = MISSING
    topology: Any = MISSING
    optim: AdamWConfig = MISSING
    runtime: LocalRuntimeConfig = MISSING
    logger: Any = MISSING  # logger/wandb and logger/none differ
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resume: Optional[str] = None  # a previous run dir to continue from (its latest checkpoint)
    seed: int = 1234


# Schemas by their ConfigStore path. They live under schema/ rather than beside the
# options they type, so `--help` and `cost=...` list only real options; an option
# file pulls its schema in with `defaults: [/schema/<group>/<option>@_here_, _self_]`.
SCHEMAS: dict[str, type] = {
    "schema/simulate": SimulateConfig,
    "schema/train": TrainConfig,
    "schema/optim/adamw": AdamWConfig,
    "schema/runtime/local": LocalRuntimeConfig,
    "schema/logger/wandb": WandbLoggerConfig,
    "schema/logger/none": NoLoggerConfig,
    **{f"schema/schedule/{spec.name}": schedule_schema(spec) for spec in specs()},
    "schema/model": ModelConfig,
    "schema/model_hf": HFModelConfig,
    **{f"schema/cost/{name}": _cost_schema(name) for name in COST_MODELS},
    **{f"schema/topology/{preset}": _topology_schema(preset) for preset in PRESETS},
}


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore and the help page's resolvers in OmegaConf;
    call before composing (idempotent)."""
    register_help()
    cs = ConfigStore.instance()
    for path, node in SCHEMAS.items():
        group, name = path.rsplit("/", 1)
        cs.store(group=group, name=name, node=node)


def compose(config_name: str = "simulate", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a config from ``conf/`` outside ``@hydra.main`` (tests, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))
