"""The top-level ``compile`` of pipeflow-train and pipeflow-simulate: each transformer block
compiled on its own (:func:`pipeflow.models.regional.compile_blocks`), with every schedule,
recomputation, parallelism, family and precision. On CPU ranks it needs the C++ compiler
inductor runs ($CXX, else g++), checked here by building a tiny OpenMP function before
any rank starts."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from ..values import ConfigError


def compiled(cfg: DictConfig) -> bool:
    """``compile`` (a bool by the apps' schemas; an app without the key: false)."""
    return bool(cfg.get("compile", False))


def check_compile(cfg: DictConfig, schedule, on_gpus: bool) -> None:
    """compile=true where inductor can build the ranks' kernels: on CPU ranks its C++
    compiler builds a tiny function here first (:func:`compiler_fault`)."""
    if not compiled(cfg) or on_gpus:
        return
    compiler = cpp_compiler()
    if not compiler:
        named = f"CXX={os.environ['CXX']!r}" if "CXX" in os.environ else DEFAULT_CXX
        raise ConfigError(f"compile=true: compiling for CPU ranks needs a C++ compiler (inductor builds its kernels "
                          f"with $CXX, else {DEFAULT_CXX}) and {named} was not found; install one or set CXX to one, "
                          f"or use compile=false")
    fault = compiler_fault(compiler)
    if fault:
        named = f"{compiler} (CXX)" if "CXX" in os.environ else compiler
        raise ConfigError(f"compile=true: the C++ compiler inductor would build the CPU ranks' kernels with, {named}, "
                          f"could not build a tiny function ({fault}); set CXX to a working g++ or clang++, or use "
                          f"compile=false")


DEFAULT_CXX = "clang++" if sys.platform == "darwin" else "g++"  # torch._inductor.config.cpp.cxx's, where CXX is unset

# a tiny kernel built as inductor builds its own: C++20, OpenMP, a shared library (cpp_builder's flags)
_PROBE = """#include <omp.h>
extern "C" int pipeflow_probe(int n) {
    int sum = 0;
#pragma omp parallel for reduction(+ : sum)
    for (int i = 0; i < n; ++i) sum += i;
    return sum + omp_get_max_threads();
}
"""
_FLAGS = ["-std=c++20", "-shared", "-fPIC", "-O1"] + (["-Xclang", "-fopenmp", "-undefined", "dynamic_lookup"]
                                                      if sys.platform == "darwin" else ["-fopenmp"])


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with ($CXX, else g++; clang++ on
    macOS), as a path, or None where it is not found."""
    name = os.environ.get("CXX", DEFAULT_CXX)  # (as inductor reads it: CXX set empty names no compiler)
    return shutil.which(name) if name else None


@functools.lru_cache(maxsize=None)
def compiler_fault(compiler: str) -> str | None:
    """Why ``compiler`` cannot build a tiny OpenMP function into a shared library as
    inductor builds its kernels (a few words), or None; asked once per compiler a process."""
    try:
        with tempfile.TemporaryDirectory(prefix="pipeflow-cxx-") as tmp:
            src = Path(tmp) / "probe.cpp"
            src.write_text(_PROBE)
            done = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(Path(tmp) / "probe.so")],
                                  capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "it did not finish in 120 s"
    except OSError as err:
        return err.strerror or str(err)
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    said = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
    return f"exit status {done.returncode}" + (f": {said[:200]}" if said else ", no message")


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

