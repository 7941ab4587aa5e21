"""The top-level ``compile`` of pipeflow-train and pipeflow-simulate: each transformer
block compiled on its own (regional compile, :func:`pipeflow.models.regional.compile_blocks`).

It composes with every schedule (the zero-bubble split's I and W through compiled blocks
whose weight products stay eager, the asynchronous policies' weight versions, Seq1F1B's
segments over their key/value prefix), recomputation (compiled inside its regions),
tensor and sequence parallelism, each sharding level, every family, at every precision,
on CPU and CUDA ranks. What it needs: a C++ compiler where the ranks are CPUs.
"""

from __future__ import annotations

import os
import shutil

from omegaconf import DictConfig

from ..values import ConfigError


def compiled(cfg: DictConfig) -> bool:
    """``compile`` (a bool by the apps' schemas; an app without the key: false)."""
    return bool(cfg.get("compile", False))


def check_compile(cfg: DictConfig, schedule, on_gpus: bool) -> None:
    """compile=true where inductor can build the ranks' kernels (see the module's docstring)."""
    if not compiled(cfg):
        return
    if not on_gpus and not cpp_compiler():
        raise ConfigError("compile=true: compiling for CPU ranks needs a C++ compiler (inductor builds its kernels "
                          "with one) and none was found ($CXX, g++, c++ or clang++); install one, or use compile=false")


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None."""
    names = [os.environ.get("CXX") or "", "g++", "c++", "clang++"]
    return next((path for name in names if name and (path := shutil.which(name))), None)


def check_compile_cost(cfg: DictConfig, schedule, cost) -> None:
    """A calibration's times are of blocks run as this simulation's would run them
    (:meth:`pipeflow.schedules.ir.Schedule.compile_mode`: eager, compiled whole, or compiled but
    for the weight products under the zero-bubble split)."""
    data = getattr(cost, "data", None)
    if not isinstance(data, dict) or "config" not in data:
        return
    made = data["config"].get("compile", "none")  # (a calibration from before compile=true: eager)
    want = schedule.compile_mode(compiled(cfg))
    if made != want:
        raise ConfigError(f"compile={str(compiled(cfg)).lower()}: cost.calibration={cfg.cost.calibration} timed blocks "
                          f"run as '{made}' and this {schedule.name} run's would run as '{want}' (none: eager; "
                          f"blocks: compiled whole; eager_products: compiled but for their weight products, under the "
                          f"zero-bubble split); calibrate with the same compile and schedule")

