"""The export's thread pools: :func:`worker_threads` (threads that make the rank's CUDA device current first) and
:class:`ProcessThreads` (such a pool started at its first use, and again in a forked child)."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["ProcessThreads", "worker_threads"]


def worker_threads(workers: int, name: str, device: torch.device | None = None) -> ThreadPoolExecutor:
    """A thread pool whose threads make CUDA ``device`` current first (a new thread's current device is 0: a
    rank on another GPU would create a CUDA context on GPU 0 at its threads' first CUDA call). ``device``
    ``None`` or not CUDA: plain threads."""
    on_device = {}
    if device is not None and device.type == "cuda":
        on_device = dict(initializer=torch.cuda.set_device, initargs=(device,))
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, **on_device)


class ProcessThreads:
    """A :func:`worker_threads` pool started by its first :meth:`submit`, and again by the first submit in a
    forked child: a fork copies this object but not the threads, so the child's work would wait in a queue
    that no thread empties. The threads make the ``device`` of the submit that starts them current."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = workers, name
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0

    def submit(self, device: torch.device | None, fn: Any, *args: Any) -> Future:
        if self._executor is None or self._pid != os.getpid():
            self._executor, self._pid = worker_threads(self._workers, self._name, device), os.getpid()
        return self._executor.submit(fn, *args)

    @property
    def started(self) -> bool:
        """Whether this process has started the threads (and not shut them down)."""
        return self._executor is not None and self._pid == os.getpid()

    def shutdown(self) -> None:
        """Wait for the submitted work, end the threads (started again by the next submit). Idempotent."""
        if self.started:
            self._executor.shutdown(wait=True)
        self._executor = None
