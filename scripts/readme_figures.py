"""The README's figures, measured again: its first command's ``done:`` line (steps, losses, accuracy) and how long
that command and the test suite take, with the machine and its load beside them.

    python -m scripts.readme_figures [--suite] [--run-dir DIR]

Runs ``python recipes/train.py`` as the README's first command does (the default job, the default threads: torch's,
one per core) in a fresh run directory, and compares its ``done:`` line, from the loss to the accuracy, with the one
the README quotes. ``--suite`` also runs the README's test command (pytest part) and prints its counts, to compare
with docs/testing.md. Prints the CPUs this process may use, the load average before and after each run, and each
run's wall time; exits 1 when the loss or accuracy differs from the README's (the README's figures then need the
run's line), else 0. The loss depends on the number of threads (docs/reliability.md, "What is deterministic"): the
README's is the 2-core machine's.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the part of the done line that the run decides: losses, accuracy and step (the paths are the run's own)
FIGURES = re.compile(r"done: steps 0-(\d+), loss ([\d.]+) -> ([\d.]+); accuracy ([\d.]+) at step (\d+)")
COUNTS = re.compile(r"(\d+) passed(?:, (\d+) skipped)?.* in ([\d.]+)s")


def figures(text: str) -> tuple[str, ...] | None:
    """(last step, first loss, last loss, accuracy, its step) of the first done line in ``text``, or None."""
    found = FIGURES.search(" ".join(text.split()))  # the README wraps its quote across lines
    return found.groups() if found else None


def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpus} CPUs for this process, load average {os.getloadavg()[0]:.2f}"


def suite_arguments(readme: str) -> list[str]:
    """The README's test command from its ``-m pytest`` on: its pytest part, as the interpreter's arguments."""
    line = next(line for line in readme.splitlines() if "python -m pytest" in line)
    return shlex.split(line[line.index("-m pytest") :])


def timed(command: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="readme_figures.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="store_true", help="also run the README's test command (pytest part)")
    parser.add_argument("--run-dir", type=Path, help="the default job's run directory (default: a fresh temporary)")
    args = parser.parse_args(argv)
    claimed = figures((ROOT / "README.md").read_text())
    if claimed is None:
        print("README.md quotes no done line (done: steps 0-N, loss A -> B; accuracy C at step N)", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = args.run_dir or Path(scratch) / "default"
        print(f"before the default job: {machine()}")
        proc, wall = timed([sys.executable, "recipes/train.py", f"run_dir={run_dir}"], env)
        print(f"after it ({wall:.1f} s wall, exit {proc.returncode}): {machine()}")
    measured = figures(proc.stderr)
    if proc.returncode != 0 or measured is None:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    print(f"README: steps 0-{claimed[0]}, loss {claimed[1]} -> {claimed[2]}; accuracy {claimed[3]}")
    print(f"run:    steps 0-{measured[0]}, loss {measured[1]} -> {measured[2]}; accuracy {measured[3]}")
    if args.suite:
        command = [sys.executable, *suite_arguments((ROOT / "README.md").read_text())]
        print(f"before the suite: {machine()}")
        suite, wall = timed(command, env)
        counts = COUNTS.search(suite.stdout.strip().splitlines()[-1] if suite.stdout.strip() else "")
        print(f"after it ({wall:.1f} s wall, exit {suite.returncode}): {machine()}")
        print("suite: " + (f"{counts[1]} passed, {counts[2] or 0} skipped in {counts[3]} s" if counts else "no counts"))
    same = measured == claimed
    print("the README's figures hold" if same else "the README's figures differ from this run's: update them")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
