"""Launch styles on one CPU machine, for real: two torchrun "nodes" (c10d), a stop signal, submitit, Slurm."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.train import compose_config, train
from tests.distributed.launch import free_port
from tests.recipe.runs import ENV, QUICK, ROOT, cli, complete_steps, metrics


def two_nodes(run_dir: Path, *overrides: str, timeout: int = 240) -> list[str]:
    """Two torchrun agents (--nnodes=2, node ranks 0 and 1, 2 processes each) meeting at a c10d rendezvous."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc_per_node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=two-nodes-{port}",
            "recipes/train.py",
            *QUICK,
            f"run_dir={run_dir}",
            *overrides,
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


@pytest.mark.slow
def test_two_torchrun_nodes_with_c10d_rendezvous_train_and_resume(tmp_path):
    first = two_nodes(tmp_path, "trainer.stop_at=10")
    assert any("world_size=4" in out for out in first)
    assert complete_steps(tmp_path) == [10]
    summary = train(compose_config([*QUICK, f"run_dir={tmp_path}"]))  # the 4 ranks' checkpoint, on 1 rank
    assert summary["start_step"] == 10 and "saved by 4 rank(s)" in (tmp_path / "train.log").read_text()
    assert complete_steps(tmp_path) == [10, 20]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_finishes_the_step_saves_and_the_next_launch_resumes(sig, tmp_path):
    """SIGINT (Ctrl-C) as SIGTERM: was a KeyboardInterrupt traceback and no checkpoint (the new-user trial). An
    interrupted plain run exits 130 (was 0, so `train && next` went on: the new-user trial of 2026-12-01); a
    stop on SIGTERM (preemption, a requeue) exits 0."""
    cmd = [
        sys.executable,
        "recipes/train.py",
        *QUICK,
        f"run_dir={tmp_path}",
        "trainer.max_steps=100000",
        "trainer.log_every=1",
        "checkpoint.every_steps=50000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "step 3/" in line:
            proc.send_signal(sig)
            break
    rest, _ = proc.communicate(timeout=120)[1], None
    log = "".join(lines) + (rest or "")
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), log[-3000:]
    stopped = [ln for ln in log.splitlines() if "stopping at step" in ln]
    assert stopped and sig.name in stopped[0], log[-3000:]
    step = int(stopped[0].split("stopping at step ")[1].split()[0])
    assert complete_steps(tmp_path) == [step]
    again = train(
        compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=100000", f"trainer.stop_at={step + 2}"])
    )
    assert again["start_step"] == step and again["resumed_from"].endswith(f"step_{step:08d}")
    assert complete_steps(tmp_path) == [step, step + 2]


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_not_only_its_job(tmp_path):
    """Seen (2026-12-01): Ctrl-C in a -m sweep (basic launcher: the jobs run in this process) stopped job 0 with a
    checkpoint, then jobs 1 and 2 started and trained to the end, exit 0. Broken on purpose (a stopped job returns
    to the launcher): job 1 starts."""
    cmd = [
        sys.executable,
        "recipes/train.py",
        "-m",
        *QUICK,
        f"run_dir={tmp_path}/job${{hydra:job.num}}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "trainer.max_steps=100000",
        "trainer.log_every=1",
        "checkpoint.every_steps=50000",
        "optim.lr=1e-3,2e-3",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "step 3/" in line:
                proc.send_signal(signal.SIGINT)
                break
        log = "".join(lines) + proc.communicate(timeout=120)[1]
    finally:
        proc.kill()  # a sweep that went on would train for ever
    assert proc.returncode == 130, log[-3000:]
    assert "-m job 0 stopped at step" in log and "by SIGINT: the sweep stops here" in log, log[-3000:]
    assert len(complete_steps(tmp_path / "job0")) == 1 and not (tmp_path / "job1").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["submitit_local", "laptop"])
def test_hydra_submitit_local_launcher_runs_a_job(launcher, tmp_path):
    """The sweep in this process (``main``); submitit runs its job as a process of its own."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    run_dir = tmp_path / "run"
    proc = cli(
        "-m", f"hydra/launcher={launcher}", *QUICK, f"run_dir={run_dir}", f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert complete_steps(run_dir) == [10, 20]
    assert [r for r in metrics(run_dir) if r["kind"] == "summary"][-1]["end_step"] == 20


# ----------------------------------------------------------------------------------------------- real Slurm
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


@pytest.mark.slow
def test_sbatch_srun_torchrun_trains(slurm, tmp_path):
    """One batch job: srun starts torchrun, 2 ranks train and save (its resume: the requeue test below)."""
    job = sbatch(tmp_path / "run", tmp_path / "first.out", "trainer.stop_at=10")
    info = wait_job(job)
    log = (tmp_path / "first.out").read_text()
    assert "JobState=COMPLETED" in info or "ExitCode=0:0" in info, info + log[-3000:]
    assert "world_size=2" in log and complete_steps(tmp_path / "run") == [10]


@pytest.mark.slow
def test_time_limit_signal_saves_requeues_and_resumes(slurm, tmp_path):
    """--signal=B:USR1@70 with a 90 s limit: the batch script stops the step (checkpoint), requeues, and the
    requeued job (Slurm starts it again after its requeue delay: cred_expire, 10 s in scripts/slurm/local_cluster.sh)
    resumes from that checkpoint."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = sbatch(
        run_dir,
        out,
        "trainer.max_steps=100000",
        "checkpoint.every_steps=50000",
        "trainer.log_every=500",
        extra=("--time=00:01:30", "--signal=B:USR1@70"),
    )
    # slurmctld signals 20-50 s after the start (it checks time limits every 30 s); a first run still starting then
    # (no checkpoint: seen on a loaded 2-core machine) is requeued once more
    deadline = time.time() + 300
    while time.time() < deadline and "resuming from checkpoint" not in (out.read_text() if out.exists() else ""):
        time.sleep(2)
    subprocess.run(["scancel", job])
    wait_job(job, 90)
    log = out.read_text()
    assert "time limit near" in log, log[-4000:]
    stopped = [ln for ln in log.splitlines() if "stopping at step" in ln and "SIGTERM" in ln]
    assert stopped, log[-4000:]
    step = int(stopped[0].split("stopping at step ")[1].split()[0])
    assert "restart 1" in log and f"resuming from checkpoint {run_dir}/checkpoints/step_{step:08d}" in log, log[-4000:]
