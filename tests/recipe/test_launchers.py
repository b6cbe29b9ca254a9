"""Launch styles on one CPU machine, for real: two torchrun "nodes" (c10d), a stop signal, submitit (Slurm:
tests/recipe/test_slurm.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.job import train
from recipes.train import compose_config
from tests import forked
from tests.distributed.launch import free_port, recipe_process
from tests.recipe.runs import ENV, QUICK, ROOT, cli, complete_steps, metrics, run_cli


def two_nodes(run_dir: Path, *overrides: str, timeout: int = 240) -> list[str]:
    """Two torchrun agents (--nnodes=2, node ranks 0 and 1, one process each) meeting at a c10d rendezvous."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc_per_node=1",
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
    assert any("world_size=2" in out for out in first)
    assert complete_steps(tmp_path) == [10]
    summary = train(compose_config([*QUICK, f"run_dir={tmp_path}"]))  # the 2 nodes' checkpoint, on 1 rank
    assert summary["start_step"] == 10 and "saved by 2 rank(s)" in (tmp_path / "train.log").read_text()
    assert complete_steps(tmp_path) == [10, 20]


def signal_at(proc, stderr: Path, text: str, sig: int, timeout: float = 120) -> str:
    """Send ``sig`` to ``proc`` once ``text`` is on its stderr; wait for it to exit (killed after ``timeout``
    seconds: a run that went on would train for ever); its stderr."""
    assert forked.wait_for_text(stderr, text, proc, timeout), stderr.read_text()[-3000:]
    os.kill(proc.pid, sig)
    forked.join([proc], timeout)
    return stderr.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_finishes_the_step_saves_and_the_next_launch_resumes(sig, tmp_path):
    """SIGINT (Ctrl-C) as SIGTERM: a checkpoint, not a KeyboardInterrupt traceback. An interrupted plain run exits
    130 (so `train && next` stops there); a stop on SIGTERM (preemption, a requeue) exits 0."""
    args = [*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=100000", "trainer.log_every=1"]
    proc = recipe_process([*args, "checkpoint.every_steps=50000"], tmp_path / "launch")
    log = signal_at(proc, tmp_path / "launch.stderr", "step 3/", sig)
    assert proc.exitcode == (130 if sig == signal.SIGINT else 0), log[-3000:]
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
def test_a_run_started_as_a_background_job_ignores_ctrl_c_and_stops_cleanly_on_sigterm(tmp_path):
    """Started with SIGINT ignored, as a script's background job or ``nohup ... &`` starts: a SIGINT changes
    nothing, a SIGTERM sent just after it stops the run after the step with a checkpoint, exit 0. Broken on purpose
    (a handler installed over SIG_IGN): the SIGINT, handled first, stops it with exit 130."""
    args = [*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=100000", "trainer.log_every=1"]
    cmd = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable, "recipes/train.py", *args]
    cmd.append("checkpoint.every_steps=50000")  # the only checkpoint: the stop's
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 3/" in line:
            os.kill(proc.pid, signal.SIGINT)
            os.kill(proc.pid, signal.SIGTERM)
            break
    log = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log[-3000:]
    assert "SIGINT is ignored in this process" in log, log[-3000:]
    stopped = [ln for ln in log.splitlines() if "stopping at step" in ln and "SIGTERM (checkpoint saved)" in ln]
    assert stopped, log[-3000:]
    assert complete_steps(tmp_path) == [int(stopped[0].split("stopping at step ")[1].split()[0])]


@pytest.mark.slow
def test_ctrl_c_under_torchrun_saves_and_only_torchrun_prints_a_traceback(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the launch's process group): torchrun's agent passes it to its
    worker, which stops after the step with a checkpoint and exits 0; torchrun itself then ends with its own
    SignalException traceback and exit code 1, as the README says. Nothing of the project's raises."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "recipes/train.py"]
    cmd += [*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=100000", "trainer.log_every=1"]
    cmd.append("checkpoint.every_steps=50000")  # the only checkpoint: the stop's
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 3/" in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
    log = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, log[-3000:]
    stopped = [ln for ln in log.splitlines() if "stopping at step" in ln and "SIGINT (checkpoint saved)" in ln]
    assert stopped, log[-3000:]
    assert complete_steps(tmp_path) == [int(stopped[0].split("stopping at step ")[1].split()[0])]
    assert log.count("Traceback") == 1 and "SignalException" in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert not [ln for ln in log.splitlines() if "File " in ln and f"{os.sep}recipes{os.sep}" in ln], log[-3000:]


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_not_only_its_job(tmp_path):
    """Ctrl-C in a -m sweep (basic launcher: the jobs run in this process) stops job 0 with a checkpoint and the
    sweep with it: jobs 1 and 2 must not start and train to the end, exit 0. Broken on purpose (a stopped job returns
    to the launcher): job 1 starts."""
    args = [
        "-m",
        *QUICK,
        f"run_dir={tmp_path}/job${{hydra:job.num}}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "trainer.max_steps=100000",
        "trainer.log_every=1",
        "checkpoint.every_steps=50000",
        "optim.lr=1e-3,2e-3",
    ]
    proc = recipe_process(args, tmp_path / "launch")
    log = signal_at(proc, tmp_path / "launch.stderr", "step 3/", signal.SIGINT)
    assert proc.exitcode == 130, log[-3000:]
    assert "-m job 0 stopped at step" in log and "by SIGINT: the sweep stops here" in log, log[-3000:]
    assert len(complete_steps(tmp_path / "job0")) == 1 and not (tmp_path / "job1").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["submitit_local", "laptop"])
def test_hydra_submitit_local_launcher_runs_a_job(launcher, tmp_path):
    """submitit runs the job as a process of its own. submitit_local: the sweep as the user starts it (a process:
    its task pickled from ``__main__``, and a finished sweep's exit 0); laptop: the sweep in this process (``main``)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    run_dir = tmp_path / "run"
    args = ["-m", f"hydra/launcher={launcher}", *QUICK, f"run_dir={run_dir}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = run_cli(args) if launcher == "submitit_local" else cli(*args)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert complete_steps(run_dir) == [10, 20]
    assert [r for r in metrics(run_dir) if r["kind"] == "summary"][-1]["end_step"] == 20
    # the terminal: where the job's log is, first; the job's outcome, last
    logs = f"{tmp_path / 'sweep'}/.submitit/<job id>/<job id>_0_log.err"
    lines = proc.stderr.splitlines()
    assert lines[0] == f"-m: each job runs in a process of its own; its log: {logs} (and .out)", proc.stderr
    assert re.fullmatch(r"-m job log .*_0_log\.err: done: steps 0-20, loss .*", lines[-1]), proc.stderr
    if launcher == "laptop":  # the same sweep again: nothing to train, said in one line
        again = cli(*args[:-1], f"hydra.sweep.dir={tmp_path / 'again'}")
        assert again.returncode == 0 and again.stderr.count("\n") == 2, again.stderr
        assert again.stderr.splitlines()[-1].endswith(
            ": nothing to do: checkpoint step 20 >= 20 (to train on, raise trainer.max_steps)"
        ), again.stderr
