"""Slurm's variables translated into torchrun's (pipeflow.runtime.cluster), without
starting anything."""

from __future__ import annotations

from pipeflow.runtime.cluster import adopt_launcher_env, first_host


def test_the_first_host_of_a_slurm_host_list():
    assert first_host("node[07-09,12],gpu1") == "node07"
    assert first_host("gpu[3,5]-ib") == "gpu3-ib"
    assert first_host("a1,b2") == "a1"
    assert first_host("localhost") == "localhost"


def test_an_srun_task_becomes_a_rank():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_JOB_ID": "77"}
    assert adopt_launcher_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("3", "4", "1", "node01")
    other = {**{k: v for k, v in env.items() if k.startswith("SLURM")}, "SLURM_PROCID": "0"}
    adopt_launcher_env(other)
    assert other["MASTER_PORT"] == env["MASTER_PORT"]  # every task derives the same port


def test_a_shell_inside_an_allocation_is_no_rank():
    """salloc/sbatch shells have SLURM_PROCID but no job step: pipeflow-train launches its
    own ranks there; and a one-task step is a plain run."""
    assert not adopt_launcher_env({"SLURM_PROCID": "0", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "8"})
    assert not adopt_launcher_env({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert adopt_launcher_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_the_slurm_launcher_starts_one_task_per_rank():
    """hydra/launcher=slurm composes submitit's Slurm launcher with a task per rank."""
    import pytest

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    from pipeflow.config import CONF_DIR, check_group_choices, register_configs

    register_configs()
    check_group_choices(["hydra/launcher=slurm", "hydra/help=default"])  # Hydra's groups are Hydra's to check
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", ["hydra/launcher=slurm", "pipeline.stages=4", "runtime.threads_per_rank=2"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.cpus_per_task) == (1, 4, 2)
