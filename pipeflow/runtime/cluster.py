"""Ranks started by a cluster launcher (torchrun, Slurm's ``srun``, submitit) rather than
by pipeflow-train: :func:`adopt_launcher_env` translates Slurm's variables into
torchrun's. Torch-free: the app decides before importing the runtime."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import MutableMapping

TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# set by srun for each task of a job step: an salloc or sbatch shell has no step of its
# own, so pipeflow-train typed there still launches its own ranks
SLURM = ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[07-09,12],gpu1`` -> ``node07``."""
    entry = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", entry)
    if m is None:
        return entry
    prefix, ranges, suffix = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def adopt_launcher_env(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether this process is one rank of a job a launcher started (torchrun, or Slurm's
    srun, whose variables are then translated into torchrun's in ``env``)."""
    env = os.environ if env is None else env
    if all(k in env for k in TORCHRUN):
        return True
    if not all(k in env for k in SLURM) or int(env["SLURM_STEP_NUM_TASKS"]) < 2:
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_STEP_NUM_TASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
    env.setdefault("MASTER_ADDR", first_host(nodes))
    # every task derives the same port from the job (and step) id unless one is given
    job = int(env.get("SLURM_JOB_ID", "0")) * 16 + int(env["SLURM_STEP_ID"] or 0)
    env.setdefault("MASTER_PORT", str(20000 + job % 20000))
    return True


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): signal 0 reached it
