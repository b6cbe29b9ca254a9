"""Helpers for the recipe's tests: the quick job's overrides, the command line in-process and as a process, and
readers of a run's outputs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from recipes.checkpoint import is_complete, step_dirs
from recipes.train import main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["experiment=quick", "trainer.threads=1"]
# the recipe's path (c) with the option on; 64-byte chunks make the CPU export slower than a forward and backward
BACKGROUND = [
    "checkpoint.async_save=true",
    "optim.state_dict_cpu_offload=true",
    "optim.state_dict_offload_chunk_bytes=64",
    "optim.state_dict_offload_reuse_buffers=true",
    "optim.state_dict_offload_background=true",
]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def cli(*args: str) -> subprocess.CompletedProcess:
    """``python recipes/train.py ARGS`` in this process, through the entry point's own ``main``: its exit code
    (returned, or the ``SystemExit`` a refusal raises) and what it wrote to stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(["recipes/train.py", *args], code, out.getvalue(), err.getvalue())


def refused(proc: subprocess.CompletedProcess) -> str:
    """The one line of a refused run (exit code 2, nothing else on stderr or stdout)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert not proc.stdout.strip(), proc.stdout
    return lines[0].removeprefix("error: ")


def stopped(proc: subprocess.CompletedProcess) -> str:
    """The line a run stopped with after its log lines (exit code 2, an ``error:`` line last on stderr)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr[-3000:]
    return last.removeprefix("error: ")


def run_cli(args: list[str], *, timeout: int = 300, env: dict | None = None):
    """``recipes/train.py`` as a process of its own, for the tests of what only a process shows: its exit code
    and stderr as a shell sees them."""
    cmd = [sys.executable, "recipes/train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or ENV)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and mtime, but the lock files (``.lock``: each launch notes itself in them while it runs
    its checks, refused or not; recipes/run_lock.py)."""
    files = (p for p in path.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


def complete_steps(run_dir: Path) -> list[int]:
    """The steps of the run's complete checkpoints (``step_NNNNNNNN`` directories; a set-aside one is none)."""
    return [step for step, path in step_dirs(run_dir / "checkpoints") if is_complete(path)]
