"""The top-level ``compile`` of pipeflow-train and pipeflow-simulate: each transformer
block compiled on its own (regional compile, :func:`pipeflow.models.recompute.compile_blocks`).

It composes, for now, with the synchronous schedules whose backward is one pass (1F1B,
GPipe, interleaved 1F1B, Chimera, looped BFS, ...), every family but the concurrent-branch
one, at every precision, on CPU and CUDA ranks. Each combination that does not compose
yet is refused in one sentence before any rank starts, never run eagerly in silence.
"""

from __future__ import annotations

import os
import shutil

from omegaconf import DictConfig

from pipeflow.schedules.ir import Kind, WeightPolicy

from ..values import ConfigError


def compiled(cfg: DictConfig) -> bool:
    """``compile`` (a bool by the apps' schemas; an app without the key: false)."""
    return bool(cfg.get("compile", False))


def check_compile(cfg: DictConfig, schedule, on_gpus: bool) -> None:
    """compile=true with what the runtime compiles today (see the module's docstring)."""
    if not compiled(cfg):
        return
    pipe, model = cfg.pipeline, cfg.model
    why = None
    if any(a.kind in (Kind.I, Kind.W) for order in schedule.orders for a in order):
        why = (f"schedule.name={cfg.schedule.name} splits the backward into I and W, which runs autograd's nodes of "
               f"a block one by one, and a compiled block is one node")
    elif schedule.policy != WeightPolicy.SYNC:
        why = f"schedule.name={cfg.schedule.name} swaps weight versions under the blocks (an asynchronous policy)"
    elif schedule.num_segments > 1:
        why = f"schedule.name={cfg.schedule.name} runs sequence segments over a key/value prefix"
    elif (model.get("recompute") or "none") != "none":
        why = f"model.recompute={model.recompute} reruns the blocks' forwards in pipeflow's own regions"
    elif int(pipe.get("tensor_parallel", 1)) > 1:
        why = f"pipeline.tensor_parallel={pipe.tensor_parallel} cuts the blocks across ranks"
    elif schedule.shard != "none":
        why = f"pipeline.shard={schedule.shard} shards the blocks' weights or gradients across the replicas"
    if why:
        raise ConfigError(f"compile=true: not with this run yet: {why}; use compile=false, or a synchronous "
                          f"schedule without the split (1f1b, gpipe, interleaved_1f1b, chimera) and "
                          f"model.recompute=none")
    if not on_gpus and not cpp_compiler():
        raise ConfigError("compile=true: compiling for CPU ranks needs a C++ compiler (inductor builds its kernels "
                          "with one) and none was found ($CXX, g++, c++ or clang++); install one, or use compile=false")


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None."""
    names = [os.environ.get("CXX") or "", "g++", "c++", "clang++"]
    return next((path for name in names if name and (path := shutil.which(name))), None)
