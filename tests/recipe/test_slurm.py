"""A real single-node Slurm (scripts/slurm/local_cluster.sh, started for this module): sbatch + srun + torchrun
(scripts/slurm/train.sbatch), and its time-limit requeue."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.recipe.runs import ENV, QUICK, ROOT, complete_steps

pytestmark = pytest.mark.slow  # jobs of a real Slurm


def _slurm_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to start munge, slurmctld and slurmd"
    missing = [
        b
        for b in ("slurmctld", "slurmd", "sbatch", "munged")
        if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()
    ]
    if missing:
        return f"Slurm not installed ({', '.join(missing)} missing): bash scripts/slurm/local_cluster.sh install"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _slurm_reason()
    if reason:
        pytest.skip(reason)
    start = subprocess.run(
        ["bash", "scripts/slurm/local_cluster.sh", "start"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if start.returncode != 0:
        pytest.fail(f"local Slurm did not start: {start.stdout}{start.stderr}")
    yield
    subprocess.run(["bash", "scripts/slurm/local_cluster.sh", "stop"], cwd=ROOT, timeout=60)


def sbatch(run_dir: Path, out: Path, *overrides: str, extra: tuple[str, ...] = ()) -> str:
    env = {**ENV, "NPROC_PER_NODE": "2", "TRAIN_DEVICE": "cpu", "RUN_DIR": str(run_dir), "PYTHON": sys.executable}
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--cpus-per-task=2",
            f"--output={out}",
            *extra,
            "scripts/slurm/train.sbatch",
            *QUICK,
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_job(job: str, timeout: float = 240) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
        if not q.stdout.strip():
            info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
            return info
        time.sleep(1)
    subprocess.run(["scancel", job])
    pytest.fail(f"Slurm job {job} did not finish in {timeout} s")


def wait_for(out: Path, text: str, job: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while text not in (out.read_text() if out.exists() else ""):
        if time.time() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"Slurm job {job}: no {text!r} in its log after {timeout} s")
        time.sleep(0.5)


def test_sbatch_trains_and_the_time_limit_signal_saves_requeues_resumes_and_completes(slurm, tmp_path):
    """One batch job: srun starts torchrun, 2 ranks train. Then the time-limit signal as Slurm sends it for
    ``--signal=B:USR1@<s>`` (USR1 to the batch shell; sent here by ``scancel --signal=USR1 --batch`` once training
    runs, instead of waiting for slurmctld's 30 s time-limit check): the batch script stops the step
    (checkpoint), requeues, and the requeued job (Slurm starts it again after cred_expire, 10 s in
    scripts/slurm/local_cluster.sh) resumes from that checkpoint and finishes: the job completes, exit code 0."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    steps = 100  # the signal stops the first run a few steps after step 2 (measured: at 13); the requeued run ends it
    job = sbatch(run_dir, out, f"trainer.max_steps={steps}", "checkpoint.every_steps=50000", "trainer.log_every=1")
    wait_for(out, "step 2/", job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    info = wait_job(job)
    log = out.read_text()
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + log[-3000:]
    assert "time limit near" in log and "world_size=2" in log, log[-4000:]
    stopped = [ln for ln in log.splitlines() if "stopping at step" in ln and "SIGTERM" in ln]
    assert stopped, log[-4000:]
    step = int(stopped[0].split("stopping at step ")[1].split()[0])
    assert "restart 1" in log and f"resuming from checkpoint {run_dir}/checkpoints/step_{step:08d}" in log, log[-4000:]
    assert complete_steps(run_dir) == [step, steps]
