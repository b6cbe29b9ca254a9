"""``WriterProcess``: DCP's write of an ``AsyncSaveStager``'s saves in a process of each rank's own
(``StagerOptions(write_in_process=True)``; docs/design.md, "The writer process").

The training process then holds the interpreter only to stage a save and hand it over: DCP's planning, the
serialization of each item and the storage writer's own work (a checksumming writer's hashing) run in the writer
process. The staged tensors are handed over without a copy: their storages are in shared memory (the stager's host
copies and its optimizers' pooled export buffers are made there; any other host tensor is moved there by torch's
sharing), and a save sends each storage's file descriptor beside its pickle (``_shared_send.py``), not its bytes.

The process is started at the first save, from Python's forkserver (nothing of the training process is inherited: no
CUDA context, no threads), and kept from save to save; on more than one rank the writer processes form a gloo group of
their own, on which DCP's collectives run. Its store is served by rank 0's training process from before the processes
start until its :meth:`WriterProcess.close`, on a port the system gives it as it binds, which every rank is told over
the stager's group once it is bound (a store that did not start is every rank's failure). Every rank pickles its save
before any rank sends one, and the ranks agree on the outcome on the stager's group: a save one rank cannot hand over is
handed over by none. The writer processes run the finite check's host part and agree on it before they write: a refusal
is every rank's, nothing written, and the processes serve on. A save whose write failed, or whose writer process ended,
fails in one line; every rank then starts its writer process again at the next save (DCP's collectives, and the
processes' agreement, fail on every rank when one rank's write fails or its process ends, so every rank sees the
failure). At the interpreter's exit a write in flight is waited for before the process is ended, as DCP's writer thread
is; a training process that ends otherwise (killed) ends its writer process at once (:func:`_end_with`): a save in
flight is never completed after it, as DCP's writer thread dies with its process. A save within a host budget is
filled in the training process as the writer process asks for each tensor, on the pipe its save came on
(``_remote_fills.py``): the hand-over's thread answers each ask until the save's answer comes.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import socket
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from optim_factory.checkpoint._agreement import agree, gathered
from optim_factory.checkpoint._finite_check import host_refusal
from optim_factory.checkpoint._main_guard import unguarded_call
from optim_factory.checkpoint._remote_fills import FillAsk, RemoteFills
from optim_factory.checkpoint._shared_send import discard, pickle_with_fds, recv_with_fds, send_answer, send_with_fds
from optim_factory.errors import SaveRefused, first_line

__all__ = ["TORCH_THREADS", "WriterProcess", "WriterProcessEnded"]

log = logging.getLogger(__name__)
_READY = "ready"
TORCH_THREADS = 1
"""The writer process's torch threads (its torch work on the CPU: the finite check's host part), given to it as it
starts. One, as torch's DataLoader workers run: a background process of the rank uses one core at most, not torch's
default of a thread per core beside the training process's loop; the host check then runs at one core's speed before
the write starts (about 12 GB/s on the project's CPU machine), which the loop does not wait for."""
_START_TIMEOUT_S = 300.0  # the writer processes' group forms within this (DCP's process executor waits 1800 s)
_RUNNING: weakref.WeakSet = weakref.WeakSet()  # every WriterProcess of this process, for the exit's wait


class WriterProcessEnded(RuntimeError):
    """The writer process ended while a save was handed to it (killed, or out of memory)."""


def _serve(conn: Any, alive: Any, rank: int, world: int, store: tuple[str, int] | None, threads: int) -> None:
    """The writer process: its gloo group (more than one rank), then one ``dcp.save`` per request until ``None``,
    once the request's host tensors are found finite on every rank (the processes agree on their group). A save's
    answer is its ``Metadata`` and the storage writer as the save left it, or its exception (:class:`SaveRefused`
    where a rank found NaN or inf; a line when it does not pickle). ``alive``: a pipe the training process never
    writes to; its end of file (the training process ended, even killed) ends this process at once (:func:`_end_with`).
    ``threads``: its torch threads (:data:`TORCH_THREADS`).
    """
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(threads)
    threading.Thread(target=_end_with, args=(alive,), name="optim-factory-writer-watch", daemon=True).start()

    # what this process does on purpose, not news to the person training: one process saves without a group (DCP
    # warns of it at every save), and the staged DTensors' meshes arrive without their groups (planning reads
    # only their layout)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    if store is not None:  # rank 0's training process serves it: never a launcher's, which env:// would reach
        address, port = store
        tcp = dist.TCPStore(address, port, world, is_master=False, timeout=timedelta(seconds=_START_TIMEOUT_S))
        dist.init_process_group("gloo", store=tcp, rank=rank, world_size=world)  # collectives: gloo's default wait
    group = None if store is None else dist.group.WORLD  # the processes' agreement (None: one process)
    send_answer(conn, _READY)
    while True:
        try:
            request = recv_with_fds(conn)
        except EOFError:  # the training process ended without close(): nothing more will come
            break
        except Exception as exc:  # noqa: BLE001  (read whole, the save not received: its answer; the process serves on)
            send_answer(conn, exc)
            continue
        if request is None:
            break
        kwargs, state_dict, host = request
        if isinstance(kwargs.get("planner"), RemoteFills):  # a budget's: it asks the training process for its fills
            kwargs["planner"].connect(conn)
        try:
            if host is not None:  # the stager's option, the same on every rank: every rank's request has it
                _refuse_non_finite(host, state_dict, group)
            answer: Any = (dcp.save(state_dict, **{"no_dist": store is None, **kwargs}), kwargs.get("storage_writer"))
        except BaseException as exc:  # noqa: BLE001  (the save's failure is its answer; the process serves on)
            answer = exc
        del kwargs, state_dict, request, host  # the shared storages (a planner's too) let go before the next request
        send_answer(conn, answer)
    if store is not None:
        dist.destroy_process_group()


def _end_with(alive: Any) -> None:
    """End this process as soon as ``alive`` reaches its end of file: the training process ended (a save it
    started is then never completed, as DCP's writer thread ends with its process; no checkpoint is completed behind
    a relaunched job's back)."""
    alive.poll(None)  # readable only at its end of file: nothing is ever sent on it
    os._exit(1)


def _refuse_non_finite(host: list, state_dict: Any, group: Any) -> None:
    """The finite check's host part: every rank's :class:`SaveRefused` where a rank's ``host`` tensors hold NaN or
    inf (or could not be read). A gathering that fails raises its own error, not a refusal: a rank whose writer
    process ended fails the save on every rank, and every rank starts its writer process again."""
    try:
        line = host_refusal(host, state_dict)
    except Exception as exc:  # noqa: BLE001  (this rank's failure must reach the others' gathering)
        line = f"the finite check failed: {first_line(exc, named=True)}"
    refused = gathered(line, group)
    if refused:
        raise SaveRefused(refused)


class WriterProcess:
    """One rank's writer process, started at its first :meth:`write` and kept across saves; ``group``: the stager's
    gloo group over every rank (None: one process)."""

    def __init__(self, group: Any) -> None:
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError(
                f"AsyncSaveStager(StagerOptions(write_in_process=True)): its group has {dist.get_world_size(group)} "
                f"of the {dist.get_world_size()} ranks; the writer processes' group spans every rank (a DTensor's "
                "shard is placed by its global rank)"
            )
        where = unguarded_call()  # the process would import the script again and run its top level there
        if where is not None:
            raise RuntimeError(
                f"AsyncSaveStager(StagerOptions(write_in_process=True)): the writer process would run this script "
                f'again: {where} is outside `if __name__ == "__main__":`; put the script\'s top level under it'
            )
        self._group = group
        self._process: Any = None
        self._conn: Any = None
        self._alive: Any = None  # the pipe's end the process watches for this process's end (never written to)
        self._store: Any = None  # rank 0's: the writer processes' store, served here while they run
        self._start_again = False  # the last write failed: a new process (every rank's) at the next write
        self._writing: threading.Thread | None = None  # the hand-over in flight (the exit waits for it)
        _RUNNING.add(self)

    @property
    def pid(self) -> int | None:
        """The running writer process's pid (None before the first save and after :meth:`close`)."""
        return None if self._process is None else self._process.pid

    def check(self, dcp_kwargs: dict[str, Any]) -> None:
        """Refuse, before anything is staged, a ``process_group`` other than the stager's (the writer processes'
        group mirrors it)."""
        if dcp_kwargs.get("process_group") not in (None, self._group):
            raise ValueError(
                "AsyncSaveStager(StagerOptions(write_in_process=True)).async_save(process_group=...): the writer "
                "processes' group mirrors the stager's; give the group to the stager (AsyncSaveStager(process_group=))"
            )

    def write(
        self,
        staged: Future,
        dcp_kwargs: dict[str, Any],
        host: list | None = None,
        asks: Callable[[FillAsk], Any] | None = None,
    ) -> Future:
        """A Future of ``dcp.save(staged.result(), **dcp_kwargs)`` run in the writer process once ``staged``
        completes (it fails as ``staged`` does: a refused save is handed nothing), on the writer processes' group in
        place of ``process_group``; ``host``: the staged tensors the process checks for NaN and inf first (the
        finite check's host part; a refusal is every rank's :class:`SaveRefused`, nothing written); ``asks``: what
        answers the process's :class:`FillAsk` during the save (a budget's fills). The ``storage_writer`` goes to
        the process pickled; where it has ``take_written``, it is called with the copy the process saved with
        before the Future completes."""
        written: Future = Future()
        kwargs = {k: v for k, v in dcp_kwargs.items() if k != "process_group"}
        # taken by the callback: ``staged`` keeps its callbacks, and ``written``'s lead back to the save's record, so a
        # callback that kept them would hold the whole save (its tensors, DCP's metadata) in a reference cycle until
        # a garbage collection, a long one, inside some later step
        args = [kwargs, host, asks, written]

        def hand_over(done: Future) -> None:  # the staging's thread, or this one: the writing has its own
            taken = (done, *args)
            args.clear()
            self._writing = threading.Thread(
                target=self._hand_over, args=taken, name="optim-factory-writer", daemon=True
            )
            self._writing.start()

        staged.add_done_callback(hand_over)
        return written

    def close(self) -> None:
        """End the writer process (asked to, then terminated if it does not within 30 s)."""
        process, conn, alive = self._process, self._conn, self._alive
        self._process = self._conn = self._alive = None
        if process is not None:  # else none started (or its start failed after the store was made)
            try:
                conn.send(None)
            except Exception:  # noqa: BLE001  (it ended already)
                pass
            process.join(30)
            if process.is_alive():
                process.terminate()
                process.join()
            conn.close()
            alive.close()
        self._store = None  # once no process uses it: its server ends with the last reference

    def _hand_over(self, staged: Future, kwargs: dict[str, Any], host: list | None, asks: Any, written: Future) -> None:
        """Send the staged save to the writer process (started first if need be), once every rank could pickle its
        own, then answer its asks until its answer comes."""
        failure = staged.exception()
        if failure is not None:  # refused: nothing is handed over
            written.set_exception(failure)
            return
        pickled = line = None
        try:
            conn = self._connection()
            # the storages named by their shared-memory descriptors, sent beside the pickle (_shared_send.py)
            pickled = pickle_with_fds((kwargs, staged.result(), host))
        except BaseException as exc:  # noqa: BLE001  (this rank's failure must reach the others' agreement)
            line = f"not handed to the writer process: {first_line(exc, named=True)}"
        refusals = agree(line, self._group)
        if refusals:  # no rank sends: none waits in DCP's collectives for a rank that never will
            self._start_again = True
            if pickled is not None:
                discard(pickled)
            written.set_exception(SaveRefused(refusals))
            return
        try:
            send_with_fds(conn, pickled)
        except BaseException as exc:  # noqa: BLE001  (a broken pipe: the process ended)
            answer = self._ended(exc)
        else:
            answer = self._answer(conn, asks)
        if isinstance(answer, BaseException):
            self._start_again = not isinstance(answer, SaveRefused)  # refused, nothing written: the process serves on
            written.set_exception(answer)
            return
        metadata, copy = answer
        take = getattr(kwargs.get("storage_writer"), "take_written", None)
        try:
            if take is not None:
                take(copy)  # what the writer learned there (the recipe's checksums), given to the caller's writer
        except BaseException as exc:  # noqa: BLE001  (the save's failure, not the thread's)
            written.set_exception(exc)
            return
        written.set_result(metadata)

    def _answer(self, conn: Any, asks: Any) -> Any:
        """The writer process's answer to the save sent on ``conn``, its asks answered by ``asks`` meanwhile (an ask's
        failure is its answer, in one line where it does not pickle); an exception where the process ended."""
        try:
            answer = recv_with_fds(conn)
            while isinstance(answer, FillAsk):
                try:
                    reply = asks(answer)
                except BaseException as exc:  # noqa: BLE001  (the save's failure, raised by the process's planner)
                    reply = exc
                send_answer(conn, reply)
                answer = recv_with_fds(conn)
        except BaseException as exc:  # noqa: BLE001  (EOF or a broken pipe: the process ended)
            return self._ended(exc)
        return answer

    def _ended(self, exc: BaseException) -> BaseException:
        """A failed hand-over's exception: :class:`WriterProcessEnded` where the process ended."""
        process = self._process
        if process is not None and isinstance(exc, (EOFError, OSError)):
            process.join(5)  # reaped once it ended (the pipe's end of file can come first)
        if process is not None and not process.is_alive():
            return WriterProcessEnded(
                f"the writer process (pid {process.pid}) ended with exit code {process.exitcode} before the save "
                "was written; the next save starts a new one"
            )
        return exc

    def _connection(self) -> Any:
        """The running process's end of the pipe: started (every rank's, together) at the first save and after a
        failed one."""
        if self._start_again:
            self.close()
            self._start_again = False
        if self._process is None:
            self._start()
        return self._conn

    def _start(self) -> None:
        group = self._group
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        store = None
        if world > 1:
            served: list[Any] = [None]
            if rank == 0:
                try:
                    served = [self._serve_store(world)]
                except Exception as exc:  # noqa: BLE001  (every rank waits for the broadcast: it carries the line)
                    served = [f"the writer processes' store did not start: {first_line(exc, named=True)}"]
            dist.broadcast_object_list(served, src=dist.get_global_rank(group, 0), group=group)
            if isinstance(served[0], str):
                raise WriterProcessEnded(served[0])
            store = served[0]
        context = multiprocessing.get_context("forkserver")
        conn, child = context.Pipe()
        watched, alive = context.Pipe(duplex=False)
        process = context.Process(
            target=_serve,
            args=(child, watched, rank, world, store, TORCH_THREADS),
            name="optim-factory-writer",
            daemon=True,
        )
        process.start()
        child.close()  # the child's end is the child's: a recv here sees EOF once it ends
        watched.close()  # its end of file then comes with this process's end
        self._process, self._conn, self._alive = process, conn, alive
        if not conn.poll(_START_TIMEOUT_S):
            raise WriterProcessEnded(f"the writer process did not start within {_START_TIMEOUT_S:.0f} s")
        try:
            recv_with_fds(conn)  # _READY
        except EOFError:
            process.join(5)
            raise WriterProcessEnded(
                f"the writer process (pid {process.pid}) ended with exit code {process.exitcode} as it started (its "
                'stderr says why; a script whose top level is not under `if __name__ == "__main__":` runs again there)'
            ) from None
        log.info("writer process started (pid %d): this rank's async saves are written there", process.pid)

    def _serve_store(self, world: int) -> tuple[str, int]:
        """Rank 0: the writer processes' store, served by this process on every interface, on a port bound as the
        server starts (port 0: the system's choice; the server's own client reaches it on the loopback, with no name
        to resolve); returns the address the processes reach it at (``MASTER_ADDR``, else this host's name) and its
        port."""
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=_START_TIMEOUT_S)
        )
        return os.environ.get("MASTER_ADDR") or socket.getfqdn(), self._store.port


def _wait_at_exit() -> None:
    """At the exit of this process (the interpreter's, or a multiprocessing child's end): every write in flight is
    waited for (the checkpoint is written, as DCP's writer thread writes it), then the processes are ended."""
    for writer in list(_RUNNING):
        if writer._writing is not None:
            writer._writing.join()
        writer.close()


def _forget_in_forked_child() -> None:
    """In a child forked from this process (``os.fork``; a DataLoader's fork-started workers): its copy of each writer
    process's watched pipe is closed, so that the pipe's end of file comes with this process's end alone."""
    for writer in list(_RUNNING):
        if writer._alive is not None:
            writer._alive.close()


os.register_at_fork(after_in_child=_forget_in_forked_child)

# multiprocessing's exit runs its finalizers with a priority before it terminates its daemon processes (ours): at
# the interpreter's exit (its atexit handler) and at a multiprocessing child's end (mp.spawn's ranks; no atexit there)
multiprocessing.util.Finalize(None, _wait_at_exit, exitpriority=100)
