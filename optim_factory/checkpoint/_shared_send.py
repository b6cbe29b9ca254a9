"""A save handed to its writer process on the save's own pipe: the pickled save, and the file descriptors of its host
tensors' shared-memory storages beside it, a few messages of up to 250 descriptors each (``SCM_RIGHTS``).

torch's pickler (``torch.multiprocessing``'s reductions, the ``file_descriptor`` sharing strategy) sends each
storage's descriptor through multiprocessing's resource sharer instead: the receiver opens one connection per storage,
with its authentication handshake, and a thread of the sending process answers each, holding its interpreter. On the
2-core CPU machine 700 storages took 0.30 s to arrive that way and 0.17 ms of the sender's CPU each; a save of 88
layers holds 352. Here the pickle names each storage by its place among the descriptors sent; torch's own reductions
make everything else (the tensors on those storages, DTensors, meta tensors). Under the ``file_system`` strategy (a
user's choice) no descriptor is sent: torch sends each storage by its name, as it does.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
from multiprocessing.reduction import ForkingPickler, recvfds, sendfds
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (its reductions: the tensors, DTensors and meta tensors around storages)

__all__ = ["pickle_with_fds", "recv_with_fds", "send_with_fds"]

_BATCH = 250  # descriptors a message: SCM_RIGHTS carries at most 253 (Linux's SCM_MAX_FD)


class _Pickler(ForkingPickler):
    """torch's pickler, but each non-empty CPU storage is named by its place in :attr:`storages` (the same storage,
    under several tensors, once)."""

    def __init__(self, file: io.BytesIO, by_descriptor: bool) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._by_descriptor = by_descriptor
        self._places: dict[int, int] = {}  # a storage's address -> its place
        self.storages: list[tuple[int, int]] = []  # (descriptor, bytes) of each storage, in shared memory

    def persistent_id(self, obj: Any) -> Any:
        if not (self._by_descriptor and type(obj) is torch.UntypedStorage and obj.device.type == "cpu"):
            return None
        if obj.nbytes() == 0:  # nothing to map: torch sends an empty storage without one
            return None
        place = self._places.get(obj.data_ptr())
        if place is None:
            place = self._places[obj.data_ptr()] = len(self.storages)
            self.storages.append(obj._share_fd_cpu_())  # moved into shared memory first where it is not there
        return place


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, storages: list[torch.UntypedStorage]) -> None:
        super().__init__(file)
        self._storages = storages

    def persistent_load(self, pid: Any) -> torch.UntypedStorage:
        return self._storages[pid]


def pickle_with_fds(obj: Any) -> tuple[bytes, list[tuple[int, int]]]:
    """``obj`` pickled for :func:`send_with_fds`, and (descriptor, bytes) of each storage it names (the descriptors
    are the storages' own: valid while they live, nothing to close)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, torch.multiprocessing.get_sharing_strategy() == "file_descriptor")
    pickler.dump(obj)
    return buffer.getvalue(), pickler.storages


def send_with_fds(conn: Any, payload: bytes, storages: list[tuple[int, int]]) -> None:
    """Send what :func:`pickle_with_fds` made on ``conn`` (a ``multiprocessing`` duplex pipe: a Unix socket), for
    :func:`recv_with_fds` at its other end."""
    conn.send([size for _, size in storages])
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a duplicate of the pipe's end
        for start in range(0, len(storages), _BATCH):
            sendfds(sock, [fd for fd, _ in storages[start : start + _BATCH]])
    conn.send_bytes(payload)


def recv_with_fds(conn: Any) -> Any:
    """What :func:`send_with_fds` sent on ``conn``'s other end, its storages mapped here; None where None was sent (a
    ``conn.send(None)``, the end of the requests)."""
    sizes = conn.recv()
    if sizes is None:
        return None
    fds: list[int] = []
    try:
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            for start in range(0, len(sizes), _BATCH):
                fds += recvfds(sock, len(sizes[start : start + _BATCH]))
        storages = [torch.UntypedStorage._new_shared_fd_cpu(fd, size) for fd, size in zip(fds, sizes, strict=True)]
        return _Unpickler(io.BytesIO(conn.recv_bytes()), storages).load()
    finally:
        for fd in fds:  # each storage maps its own duplicate
            os.close(fd)
