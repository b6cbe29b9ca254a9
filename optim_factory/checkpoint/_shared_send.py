"""A save handed to its writer process on the save's own pipe: the pickled save, and the file descriptors of its host
tensors' shared-memory storages beside it, a few messages of up to 250 descriptors each (``SCM_RIGHTS``). Every
message on that pipe, either way, goes so (:func:`send_with_fds` or :func:`send_answer`, :func:`recv_with_fds`), but
the end of the requests (``None``).

torch's pickler (``torch.multiprocessing``'s reductions, the ``file_descriptor`` sharing strategy) sends each
storage's descriptor through multiprocessing's resource sharer instead: the receiver opens one connection per storage,
with its authentication handshake, and a thread of the sending process answers each, holding its interpreter. On the
2-core CPU machine 700 storages took 0.30 s to arrive that way and 0.17 ms of the sender's CPU each; a save of 88
layers holds 352. Here the pickle names each storage by its place among the descriptors sent; torch's own reductions
make everything else (the tensors on those storages, DTensors, meta tensors). The receiver holds at most one
descriptor more than the storages it maps (each received one is closed once its storage maps its own duplicate), and
reads a message whole before it fails (the pipe serves on).
Under the ``file_system`` strategy (a user's choice) no descriptor is sent: torch sends each storage by its name, as
it does, and a pickle that is not received is loaded here by :func:`discard` (torch counts a reference to each
shared file until the pickle is loaded).
"""

from __future__ import annotations

import array
import contextlib
import errno
import io
import os
import pickle
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (its reductions: the tensors, DTensors and meta tensors around storages)

from optim_factory.errors import first_line

__all__ = ["Pickled", "discard", "pickle_with_fds", "recv_with_fds", "send_answer", "send_with_fds"]

_BATCH = 250  # descriptors a message: SCM_RIGHTS carries at most 253 (Linux's SCM_MAX_FD)
_INT = array.array("i").itemsize
_INFLIGHT_WAIT_S = 30.0  # a sender past the limit of descriptors in flight waits this long for the receivers


@dataclass
class Pickled:
    """A pickle and the storages it names by their place (each storage object, held until sent: its descriptor is
    its own, valid while it lives; and its bytes); ``by_name``: pickled under the ``file_system`` strategy."""

    payload: bytes
    by_name: bool = False
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


class _Pickler(ForkingPickler):
    """torch's pickler, but each non-empty CPU storage is named by its place in :attr:`sent` (the same storage,
    under several tensors, once: known by its storage object, whose address moving it into shared memory changes)."""

    def __init__(self, file: io.BytesIO, sent: Pickled | None) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._sent = sent
        self._places: dict[int, int] = {}  # a storage's identity (its StorageImpl) -> its place

    def persistent_id(self, obj: Any) -> Any:
        if self._sent is None or type(obj) is not torch.UntypedStorage or obj.device.type != "cpu":
            return None
        if obj.nbytes() == 0:  # nothing to map: torch sends an empty storage without one
            return None
        place = self._places.get(obj._cdata)
        if place is None:
            fd, size = obj._share_fd_cpu_()  # moved into shared memory first where it is not there
            place = self._places[obj._cdata] = len(self._sent.storages)
            self._sent.storages.append(obj)
            self._sent.descriptors.append(fd)
            self._sent.sizes.append(size)
        return place


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, storages: list[torch.UntypedStorage]) -> None:
        super().__init__(file)
        self._storages = storages

    def persistent_load(self, pid: Any) -> torch.UntypedStorage:
        return self._storages[pid]


def pickle_with_fds(obj: Any) -> Pickled:
    """``obj`` pickled for :func:`send_with_fds`, with the storages it names (none under the ``file_system``
    strategy)."""
    buffer = io.BytesIO()
    sent = Pickled(b"", by_name=torch.multiprocessing.get_sharing_strategy() != "file_descriptor")
    _Pickler(buffer, None if sent.by_name else sent).dump(obj)
    sent.payload = buffer.getvalue()
    return sent


def discard(pickled: Pickled) -> None:
    """Let go of what a pickle that is not received holds: under the ``file_system`` strategy, torch's reference to
    each shared file it names (given back as it is loaded); nothing under ``file_descriptor`` (the storages' own
    descriptors)."""
    if pickled.by_name:
        with contextlib.suppress(Exception):  # what does not load holds what it held: nothing more to give back here
            pickle.loads(pickled.payload)


def send_with_fds(conn: Any, pickled: Pickled) -> None:
    """Send ``pickled`` on ``conn`` (a ``multiprocessing`` duplex pipe: a Unix socket, used by no other thread
    meanwhile), for :func:`recv_with_fds` at its other end; where the send fails (the other end is gone), what the
    pickle holds is let go (:func:`discard`)."""
    try:
        conn.send(pickled.sizes)
        if pickled.descriptors:
            with _socket(conn) as sock:
                for start in range(0, len(pickled.descriptors), _BATCH):
                    _send_batch(sock, array.array("i", pickled.descriptors[start : start + _BATCH]))
        conn.send_bytes(pickled.payload)
    except BaseException:
        discard(pickled)  # not received: a pickle is loaded only once it has all arrived
        raise


def _send_batch(sock: socket.socket, batch: array.array) -> None:
    """One message of descriptors. Linux counts the descriptors sent and not yet received by every process of a user
    against the sender's open-files limit (root excepted): past it, ``ETOOMANYREFS``, retried while the receivers take
    theirs (``_INFLIGHT_WAIT_S``), then one line naming the limit."""
    deadline = time.monotonic() + _INFLIGHT_WAIT_S
    while True:
        try:
            sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, batch)])
            return
        except OSError as exc:
            if exc.errno != errno.ETOOMANYREFS:
                raise
            if time.monotonic() > deadline:
                raise OSError(
                    exc.errno,
                    "a save's shared-memory file descriptors could not all be sent: those not yet received count "
                    f"against the open-files limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]} (raise it with "
                    "ulimit -n)",
                ) from None
            time.sleep(0.001)


def send_answer(conn: Any, answer: Any) -> None:
    """Send ``answer`` on ``conn`` as :func:`send_with_fds` does; where it does not pickle (an exception, a save's
    metadata and storage writer), the line of the failure it is or of the one pickling it raised, as a
    ``RuntimeError``. A send that fails raises (the other end is gone)."""
    try:
        pickled = pickle_with_fds(answer)
    except Exception as exc:  # noqa: BLE001
        failure = answer if isinstance(answer, BaseException) else exc
        pickled = pickle_with_fds(RuntimeError(first_line(failure, named=True)))
    send_with_fds(conn, pickled)


def recv_with_fds(conn: Any) -> Any:
    """What :func:`send_with_fds` sent on ``conn``'s other end, its storages mapped here; None where None was sent (a
    ``conn.send(None)``, the end of the requests). The whole message is read before anything fails (the descriptors
    cut short by this process's open-files limit: one line naming it, every one received closed), so that the pipe
    serves on."""
    sizes = conn.recv()
    if sizes is None:
        return None
    fds, cut_short = _recv_fds(conn, len(sizes))
    try:
        payload = conn.recv_bytes()
        if cut_short:
            raise OSError(
                "a save's shared-memory file descriptors did not all arrive (open-files limit "
                f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}: raise it with ulimit -n)"
            )
        storages = []
        while fds:
            fd = fds.pop(0)
            try:
                storages.append(torch.UntypedStorage._new_shared_fd_cpu(fd, sizes[len(storages)]))  # a duplicate
            finally:
                os.close(fd)  # at most one descriptor more than the storages mapped, at any time
        return _Unpickler(io.BytesIO(payload), storages).load()
    finally:
        for fd in fds:
            os.close(fd)


def _recv_fds(conn: Any, count: int) -> tuple[list[int], bool]:
    """The descriptors sent beside a pickle on ``conn`` (``count`` of them), and whether a message came cut short (none
    of them kept then: every one received is closed, the messages read to the last)."""
    fds: list[int] = []
    cut_short = False
    if not count:
        return fds, cut_short
    try:
        with _socket(conn) as sock:
            for start in range(0, count, _BATCH):
                want = min(_BATCH, count - start)
                msg, ancdata, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(want * _INT))
                for level, kind, data in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds += array.array("i", data[: len(data) - len(data) % _INT]).tolist()
                if not msg:
                    raise EOFError("the pipe ended before its file descriptors")
                cut_short = cut_short or bool(flags & socket.MSG_CTRUNC) or len(fds) != start + want
                if cut_short:
                    while fds:
                        os.close(fds.pop())
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, cut_short


@contextlib.contextmanager
def _socket(conn: Any) -> Iterator[socket.socket]:
    """A socket on ``conn``'s own descriptor, blocking as ``conn`` is, left open when done: no descriptor is opened
    for it, so a process at its open-files limit still reads each message whole (a socket made under
    ``socket.setdefaulttimeout`` would set the descriptor, shared with ``conn``, non-blocking)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=conn.fileno())
    try:
        sock.setblocking(True)
        yield sock
    finally:
        sock.detach()  # the descriptor stays conn's
