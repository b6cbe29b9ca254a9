"""Spawn real gloo process groups on CPU for tests (no mocks of torch.distributed)."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


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
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _entry, args=(world, free_port(), fn, args, errors), nprocs=world, join=True, start_method="spawn"
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
