"""Real gloo process groups on CPU for tests (no mocks of torch.distributed), and the recipe's ranks without a
launcher. Every rank is a process of its own, forked from this pytest worker's forkserver (tests/forked.py),
which imports torch, the recipe and the test bodies once.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import forked

# imported once by the forkserver (a module that is not installed is skipped): the recipe, the workers, and, on a
# machine without CUDA, the frameworks' checkpoint code the integration tests' ranks import (transformers through
# Automodel's: seconds a rank). With CUDA they are not: importing them initialises CUDA, and a forked child of a
# process that did cannot use it ("Cannot re-initialize CUDA in forked subprocess").
PRELOAD = ["recipes.train", "tests.distributed.workers"]
if not torch.cuda.is_available():
    PRELOAD += ["optim_factory.integrations.torchtitan", "optim_factory.integrations.automodel"]
# what torchrun gives its workers and the recipe reads (LOCAL_WORLD_SIZE: the host's CPUs shared between the ranks)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# the ranks' rendezvous store is the spawning process's (ranks_store), at MASTER_ADDR:MASTER_PORT
AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_store() -> dist.TCPStore:
    """A store for the ranks' rendezvous, served by this process on a port it binds itself (port 0), which the ranks
    are told to use (:data:`AGENT_STORE`, as torchrun's agent tells its workers): no port is found free first and bound
    later, which another process (an outgoing connection's port, another test's ranks) could take in between
    (``EADDRINUSE``). Keep it until the ranks have ended."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _entry(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ.update(AGENT_STORE)
    # a writer process (StagerOptions.write_in_process) forks from the rank's own forkserver: torch imported there
    # once, not again by every writer process a test starts
    multiprocessing.set_forkserver_preload(["optim_factory.checkpoint"])
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
    forked.start_forkserver(PRELOAD)
    errors = mp.get_context("forkserver").SimpleQueue()
    store = ranks_store()
    try:
        mp.start_processes(
            _entry, args=(world, store.port, fn, args, errors), nprocs=world, join=True, start_method="forkserver"
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


def _exit_with(call) -> None:
    """``call()``, then this process ends with its exit code (a ``SystemExit``'s, 1 after an exception, printed)."""
    try:
        code = call()
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):  # SystemExit("message"): printed, exit code 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # as _entry: no interpreter teardown with gloo threads about


def _entry_point(argv: list[str]) -> None:
    """``recipes/train.py ARGV`` in this process: its exit code is the entry point's. SIGINT as a process started
    from a terminal or by torchrun finds it (Python's handler): the forkserver passes on the disposition the test
    process inherited, which ignores SIGINT where pytest runs as a script's background job or under nohup."""
    from recipes.train import main

    signal.signal(signal.SIGINT, signal.default_int_handler)
    _exit_with(lambda: main(argv))


def _script(path: str) -> None:
    """``python PATH`` in this process, from the script's folder (also first on ``sys.path``), as ``__main__``."""
    script = Path(path).resolve()
    os.chdir(script.parent)
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))

    def run() -> None:
        runpy.run_path(str(script), run_name="__main__")

    _exit_with(run)


def _ranks(target, args: tuple, world: int, out: Path, timeout: float, shown: list[str]):
    """``target(*args)`` on ``world`` ranks: processes of their own with the variables torchrun gives its workers
    (without torchrun's agent), on the CPU as in CI, CUDA hidden (on a machine with fewer GPUs than ranks, two
    ranks would share one GPU, which NCCL refuses): per rank, its exit code (None: killed after ``timeout`` s),
    stdout and stderr (kept under ``out``), as ``subprocess.run`` gives them for the command ``shown``."""
    store = ranks_store()
    out.mkdir(parents=True, exist_ok=True)
    stems = [out / f"rank{rank}" for rank in range(world)]
    procs = [
        forked.start(
            target,
            args,
            stems[r],
            PRELOAD,
            {
                **dict(zip(TORCHRUN_VARIABLES, (str(r), str(world), str(r), str(world), "127.0.0.1", str(store.port)))),
                **AGENT_STORE,
                "CUDA_VISIBLE_DEVICES": "",
            },
        )
        for r in range(world)
    ]
    codes = forked.join(procs, timeout)
    return [
        subprocess.CompletedProcess(shown, code, Path(f"{stem}.stdout").read_text(), Path(f"{stem}.stderr").read_text())
        for code, stem in zip(codes, stems)
    ]


def recipe_ranks(argv: list[str], world: int, out: Path, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """The recipe's entry point on ``world`` gloo ranks, as torchrun starts them (:func:`_ranks`)."""
    return _ranks(_entry_point, (argv,), world, out, timeout, ["recipes/train.py", *argv])


def script_ranks(script: Path, world: int, out: Path, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """``torchrun --nproc_per_node=WORLD SCRIPT`` without torchrun's agent (:func:`_ranks`): each rank runs the
    script as ``__main__`` from its folder, with the variables torchrun gives its workers."""
    return _ranks(_script, (str(script),), world, out, timeout, ["torchrun", f"--nproc_per_node={world}", str(script)])


def recipe_process(argv: list[str], out: Path):
    """``recipes/train.py ARGV`` as one process of its own (no launcher), started: the process (signal it by its
    ``pid``, wait with ``tests.forked.join``); its stdout and stderr go to ``out``.stdout/.stderr."""
    return forked.start(_entry_point, (argv,), out, PRELOAD)
