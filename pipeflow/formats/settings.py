"""The settings a rank reads, typed: the ``optim``, ``trainer``, ``runtime`` and ``logger``
groups' schemas, checked by :mod:`pipeflow.config.groups` and carried to the ranks as
instances in the run plan (a rank reads ``plan.optim.lr``, never the config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


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
    impl: str = "auto"  # auto (fused where torch has the kernel: CPU, CUDA) | fused | foreach | single


@dataclass
class TrainerConfig:
    steps: int = 300  # optimizer steps (pipeline iterations) of the whole run
    log_every: int = 1  # a metrics.jsonl line every N steps
    val_every: int = 50  # validation loss every N steps; 0: never
    val_batches: int = 4  # batches per validation
    save_every: int = 0  # a checkpoint every N steps; 0: only at the end
    timeline_step: Optional[int] = 5  # the step (1..steps) whose actions are timed into timeline.json/png; null: none


@dataclass
class LocalRuntimeConfig:
    name: str = "local"
    backend: str = "auto"  # auto: nccl when CUDA is available, else gloo
    device: str = "auto"  # auto | cpu | cuda
    loss_scale: float = 65536.0  # fp16: the initial dynamic loss scale
    p2p: str = "tagged"  # tagged | ordered: point-to-point messages matched by tag, or per pair in order (NCCL)
    timeout_s: float = 60.0  # a collective or P2P op that takes longer fails the run
    hang_timeout_s: float = 30.0  # a rank silent this long (stopped, stuck) fails the run, named; 0: never
    master_port: Optional[int] = None  # null: a free port
    threads_per_rank: int = 1  # torch intra-op threads of each rank
    fail_at_step: Optional[int] = None  # test hook: rank fail_rank fails at this step
    fail_rank: Optional[int] = None
    fail_mode: str = "raise"  # raise: a Python error; kill: SIGKILL, as an out-of-memory kill would; collective: stuck in a collective no other rank joins
    expandable_segments: bool = True  # CUDA: the caching allocator's expandable segments (no block larger than asked)
    memory: str = "count"  # count: saved bytes (cheap, always); profile: every allocation of the last step, by category
    dump_grads: bool = False  # test hook: each rank writes run_dir/grads/rank<r>.pt after its first backward
    trace_steps: int = 0  # the last N steps under torch's profiler: op_trace.json, each rank's operators by class
    # test hook: CPU ranks take CUDA's code paths (pipeflow.device_paths): attention, staging, memory, reads; [all]: each
    cuda_paths: List[str] = field(default_factory=list)
    # test hook: from the second step on, a CUDA rank walks its step under torch.cuda.set_sync_debug_mode("error"),
    # up to the reads at its end: a host synchronisation inside the step fails the run, naming the call
    sync_check: bool = False


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
