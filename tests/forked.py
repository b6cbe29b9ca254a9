"""Processes forked from a forkserver that imported the recipe once: a process starts in a fraction of a second
instead of the seconds an interpreter spends importing torch (tests/fault/fault_injection.py's trainers, the test
suite's ranks).

Each child runs ``target(*args)`` with the caller's environment at start (``os.environ`` then, not the
forkserver's), the caller's ``sys.path`` and working directory, and its stdout/stderr in ``<stem>.stdout`` and
``<stem>.stderr`` (created empty before it starts). A process has one forkserver: the first call's preload is
the one imported.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORKSERVER = multiprocessing.get_context("forkserver")


def start_forkserver(preload: list[str]) -> None:
    """Start this process's forkserver with ``preload`` imported, unless it runs."""
    # CPython imports the preload from the forkserver's working directory (ignoring import errors): the root
    FORKSERVER.set_forkserver_preload(preload)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.chdir(cwd)


def _child(target: Callable, args: tuple, env: dict[str, str], stem: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, suffix in ((1, "stdout"), (2, "stderr")):
        opened = os.open(f"{stem}.{suffix}", os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    target(*args)


def start(target: Callable, args: tuple, stem: Path, preload: list[str], env: dict[str, str] | None = None):
    """``target(*args)`` in a forked process, started; ``env`` is added to the caller's environment."""
    start_forkserver(preload)
    for suffix in ("stdout", "stderr"):
        Path(f"{stem}.{suffix}").write_text("")
    proc = FORKSERVER.Process(target=_child, args=(target, args, {**os.environ, **(env or {})}, str(stem)))
    proc.start()
    return proc


def wait_for_text(path: Path, text: str, proc, timeout: float) -> bool:
    """Whether ``text`` appeared in the file ``path`` (a started process's output) before ``proc`` ended or
    ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if proc.exitcode is not None or time.monotonic() > deadline:
            return text in path.read_text()
        time.sleep(0.01)
    return True


def join(procs: list, timeout: float, grace: float = 30.0) -> list[int | None]:
    """Wait for ``procs`` until ``timeout`` seconds have passed, or ``grace`` seconds after one of them exited
    non-zero (as torchrun's agent stops a group when a worker fails); kill those still running. Their exit codes,
    None for those killed here."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = [p for p in procs if p.exitcode is None]
        if not running:
            break
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        running[0].join(0.05)
    killed = [p.exitcode is None for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    return [None if k else p.exitcode for p, k in zip(procs, killed)]
