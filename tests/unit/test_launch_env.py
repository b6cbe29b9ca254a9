"""Launcher environments: torchrun, srun (one task per GPU), submitit; Slurm nodelists; bad values."""

from __future__ import annotations

import pytest

from recipes.distributed import DistEnv, LaunchError, expand_nodelist, resolve_dist_env


@pytest.mark.parametrize(
    "nodelist,expected",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("node[009-011]", ["node009", "node010", "node011"]),
        ("x[3]", ["x3"]),
    ],
)
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["", "node[01-03", "node01-03]", "node[a-b]", "node[05-01]", "a,,b", "n[1-]"])
def test_bad_nodelists(bad):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(bad)


def test_no_launcher_is_one_process():
    assert resolve_dist_env({}) == DistEnv(0, 1, 0, "127.0.0.1", 0, "single")


def test_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert resolve_dist_env(env) == DistEnv(3, 4, 1, "10.0.0.1", 29400, "torchrun")


def test_torchrun_wins_inside_srun():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "h",
    }
    assert resolve_dist_env(env).launcher == "torchrun"


def test_srun_one_task_per_gpu():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "9",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "node[01-03,07]",
        "SLURM_JOB_ID": "123456",
    }
    got = resolve_dist_env(env)
    assert got == DistEnv(9, 16, 1, "node01", 20000 + 123456 % 12768, "srun")  # below the ephemeral ports
    assert resolve_dist_env({**env, "MASTER_PORT": "4242", "MASTER_ADDR": "10.1.1.1"}).master_port == 4242
    assert resolve_dist_env({**env, "MASTER_ADDR": "10.1.1.1"}).master_addr == "10.1.1.1"


def test_batch_script_without_srun_is_one_process():
    # inside sbatch but outside a job step (no SLURM_STEP_ID): do not wait for tasks that were never started
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n1"}
    assert resolve_dist_env(env).launcher == "single"


def test_submitit_local():
    env = {
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_JOB_ID": "4321",
    }
    assert resolve_dist_env(env) == DistEnv(1, 2, 1, "127.0.0.1", 20000 + 4321, "submitit-local")
    # every job's port lies below Linux's ephemeral ports (32768-60999), which outgoing connections take: one job's
    # listener found its port (34704, from job 14704) in use beside a test's connections
    ports = {resolve_dist_env({**env, "SUBMITIT_LOCAL_JOB_ID": str(job)}).master_port for job in range(0, 60000, 7)}
    assert min(ports) == 20000 and max(ports) <= 32767


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"RANK": "0"}, "half-set launcher environment: RANK set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT missing"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT missing"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x': expected an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "need 0 <= rank < world_size"),
        ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "need 0 <= rank < world_size"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, "half-set srun environment: SLURM_NTASKS, SLURM_LOCALID"),
        (
            {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"},
            "SLURM_JOB_NODELIST missing",
        ),
        (
            {
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_JOB_NODELIST": "n[1-",
            },
            "unbalanced",
        ),
        (
            {
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "two",
                "SLURM_LOCALID": "0",
                "SLURM_JOB_NODELIST": "n1",
            },
            "SLURM_NTASKS='two'",
        ),
        ({"SUBMITIT_LOCAL_NTASKS": "2"}, "half-set submitit environment"),
    ],
)
def test_half_set_or_bad_environments_are_one_clear_error(env, fragment):
    with pytest.raises(LaunchError) as info:
        resolve_dist_env(env)
    assert fragment in str(info.value) and "\n" not in str(info.value)
