"""Real gloo process groups on CPU for tests (no mocks of torch.distributed), and the recipe's ranks without a
launcher.

Every rank is a process of its own, forked from this pytest worker's forkserver: the forkserver (a fresh
interpreter, started at the first use, with no threads) imports torch, the recipe and the test bodies once, so a
rank starts in a fraction of a second instead of the seconds an interpreter takes to import torch. Each child
gets this process's ``sys.path`` and working directory (multiprocessing's spawn preparation), and the
forkserver's environment (this worker's when the forkserver started).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["recipes.train", "tests.distributed.workers"]  # imported once by the forkserver
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what the recipe reads


def _forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts (this worker's first rank)
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    try:
        # a collective that waits longer than this fails the test instead of hanging it
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo/TCPStore threads can abort ("terminate called without an active
    # exception") when the rank hosting the store exits first. Everything this rank had to do is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; re-raise the first failure with its traceback."""
    errors = _forkserver().SimpleQueue()
    try:
        mp.start_processes(
            _entry, args=(world, free_port(), fn, args, errors), nprocs=world, join=True, start_method="forkserver"
        )
    except Exception as exc:
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        raise AssertionError("\n".join(msgs) or str(exc)) from exc


def _run_checks(rank: int, world: int, done: str, checks) -> None:
    for i, (_, fn, args) in enumerate(checks):
        fn(rank, world, *args)
        dist.barrier()  # every rank finished this check before any starts the next
        Path(done, f"{i}.rank{rank}").touch()


def spawn_checks(world: int, checks: list[tuple[str, object, tuple]], done: Path) -> dict[str, str | None]:
    """Run several checks ``(name, fn, args)`` in order on one group of ``world`` gloo ranks, each as
    ``fn(rank, world, *args)``: one spawn (its processes, imports and rendezvous) for all of them.

    Returns, per name, None where every rank finished the check, else why not: the first failure (rank and
    traceback) stops the group, and the checks after it say that they did not run."""
    done.mkdir(parents=True, exist_ok=True)
    try:
        spawn(_run_checks, world, str(done), checks)
        failure = None
    except AssertionError as exc:
        failure = str(exc)
    outcome: dict[str, str | None] = {}
    first_failed = None
    for i, (name, _, _) in enumerate(checks):
        if all((done / f"{i}.rank{r}").exists() for r in range(world)):
            outcome[name] = None
        elif first_failed is None:
            first_failed = name
            outcome[name] = failure or "did not finish"
        else:
            outcome[name] = f"not run: {first_failed} failed before it"
    return outcome


def _entry_point(argv: list[str], env: dict[str, str], out: str) -> None:
    """``recipes/train.py ARGV`` with ``env`` added to the environment; its stdout and stderr go to
    ``out``.stdout/.stderr, its exit code is the entry point's."""
    from recipes.train import main

    for key in TORCHRUN_VARIABLES:  # the forkserver's environment is this worker's when it started
        os.environ.pop(key, None)
    os.environ.update(env)
    for fd, suffix in ((1, "stdout"), (2, "stderr")):
        opened = os.open(f"{out}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)  # as _entry: no interpreter teardown with gloo threads about


def recipe_ranks(argv: list[str], world: int, out: Path, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """The recipe's entry point on ``world`` gloo ranks (processes of their own, as torchrun's workers, without
    torchrun's agent): per rank, its exit code, stdout and stderr (kept under ``out``)."""
    ctx, port = _forkserver(), free_port()
    out.mkdir(parents=True, exist_ok=True)
    stems = [out / f"rank{rank}" for rank in range(world)]
    torchrun = [
        dict(zip(TORCHRUN_VARIABLES, (str(r), str(world), str(r), "127.0.0.1", str(port)))) for r in range(world)
    ]
    procs = [ctx.Process(target=_entry_point, args=(argv, torchrun[r], str(stems[r]))) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    return [
        subprocess.CompletedProcess(
            ["recipes/train.py", *argv],
            proc.exitcode,
            Path(f"{stem}.stdout").read_text(),
            Path(f"{stem}.stderr").read_text(),
        )
        for proc, stem in zip(procs, stems)
    ]


def recipe_process(argv: list[str], out: Path):
    """``recipes/train.py ARGV`` as one process of its own (no launcher), started: the process (signal it by its
    ``pid``, ``join`` it, read its ``exitcode``); its stdout and stderr go to ``out``.stdout/.stderr."""
    proc = _forkserver().Process(target=_entry_point, args=(argv, {}, str(out)))
    proc.start()
    return proc
