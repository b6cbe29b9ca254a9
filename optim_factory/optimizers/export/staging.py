"""The host side of the streamed export's pageable destinations: a ring of staging buffers (pinned for CUDA,
for this export only) that the device copies into, emptied into the destinations by a pool of host threads.
See docs/design.md, "Streaming" and "Host memory".
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import warnings
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, ThreadPoolExecutor, wait
from concurrent.futures.thread import BrokenThreadPool
from typing import Any

import torch

from optim_factory.optimizers.export.host_memory import fault_in, host_empty, register_host, unregister_host
from optim_factory.optimizers.export.threads import worker_threads
from optim_factory.rules.host import local_ranks as host_ranks

__all__ = [
    *("STAGING_SLOTS", "SLOT_BYTES", "MIN_SLICE_BYTES", "MAX_UNSTAGE_THREADS"),
    *("cpus_per_rank", "unstage_threads", "split_bytes", "fault_pieces", "UnstageWorkers", "Stager"),
]

STAGING_SLOTS = 4  # staging buffers in the ring
# bytes of one staging buffer (less when the export stages less), and the most unstaging threads: the pair that
# copied fastest into fresh memory, on one GPU and on two ranks (docs/design.md, "Measured figures behind the
# defaults")
SLOT_BYTES = 32 << 20
MIN_SLICE_BYTES = 1 << 20  # a thread copies at least this many bytes of a slot (fewer threads for less)
MAX_UNSTAGE_THREADS = 12
_FAULT_GRAIN = 2 << 20  # staging is faulted in by the pool in pieces of whole transparent huge pages
_ALIGN = 64  # byte offset alignment of the segments in a slot
_PAGE = mmap.PAGESIZE


def cpus_per_rank(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """``cpus // local_ranks``, at least 1: ``cpus`` the CPUs this process may run on (its affinity), ``local_ranks``
    the processes of the job on this host (:func:`optim_factory.rules.host.local_ranks`)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // (host_ranks() if local_ranks is None else local_ranks))


def unstage_threads(cpus: int | None = None, local_ranks: int | None = None) -> int:
    """Host threads that empty the staging buffers: ``min(MAX_UNSTAGE_THREADS, cpus_per_rank(cpus, local_ranks))``."""
    return min(MAX_UNSTAGE_THREADS, cpus_per_rank(cpus, local_ranks))


def split_bytes(jobs: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut ``(dst address, src address, nbytes)`` copies into at most ``parts`` lists of about equal bytes, each
    of at least :data:`MIN_SLICE_BYTES` (except a lone one); every byte is in exactly one list, in order."""
    total = sum(n for _, _, n in jobs)
    parts = max(1, min(parts, total // MIN_SLICE_BYTES))
    share = -(-total // parts)
    out: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for dst, src, n in jobs:
        done = 0
        while done < n:
            if room == 0:
                out.append([])
                room = share
            take = min(room, n - done)
            out[-1].append((dst + done, src + done, take))
            done += take
            room -= take
    return [part for part in out if part]


def fault_pieces(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` byte ranges that cover ``[0, nbytes)`` in order, at most ``parts`` of them, each a whole
    number of huge pages (:data:`_FAULT_GRAIN`) except the last: the pieces in which the pool faults a staging
    buffer in."""
    grains = -(-nbytes // _FAULT_GRAIN)
    piece = max(1, -(-grains // max(1, parts))) * _FAULT_GRAIN
    return [(a, min(a + piece, nbytes)) for a in range(0, nbytes, piece)]


def _copy(event: Any, part: list[tuple[int, int, int]]) -> None:
    """Worker: wait until the device has filled the slot, then copy its bytes (ctypes releases the GIL)."""
    if event is not None:
        event.synchronize()
    for dst, src, n in part:
        ctypes.memmove(dst, src, n)


_CLOSED_DURING_EXPORT = "UnstageWorkers were closed during an export: its staging jobs were cancelled"


def _outcome(job: Future) -> BaseException | None:
    """``job``'s exception (``None``: it succeeded), once it is done; a job cancelled because its workers were
    closed gives a ``RuntimeError`` saying so."""
    try:
        return job.exception()
    except CancelledError:
        return RuntimeError(_CLOSED_DURING_EXPORT)


def _result(job: Future) -> Any:
    error = _outcome(job)
    if error is not None:
        raise error
    return job.result()


def _pin_after(pieces: list[Future], slot: torch.Tensor) -> bool:
    """Pool thread: pin ``slot`` once its fault-in ``pieces`` are done; whether it was pinned."""
    for piece in pieces:
        _result(piece)
    return register_host(slot)


class UnstageWorkers:
    """The host threads that empty a :class:`Stager`'s buffers into the destinations (and fault in and pin them).

    ``threads`` threads that make CUDA ``device`` current first (``None`` or not CUDA: plain threads), all started
    here, before any export, and kept idle between exports until :meth:`close`: started by the export itself, their
    start would be part of the first export's time. Several stagers may use one set of workers, one after the other
    or at once. In a forked child the threads do not exist: :attr:`alive` is false there, make new ones.
    """

    def __init__(self, threads: int, device: torch.device | None = None) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"UnstageWorkers threads={threads!r}: expected an int >= 1")
        self.threads = threads
        self.device = device if device is not None and device.type == "cuda" else None
        self._pid = os.getpid()
        self._executor: ThreadPoolExecutor | None = worker_threads(threads, "export-unstage", self.device)
        gate = threading.Barrier(threads)  # every thread holds one gate job: each submit starts a new thread
        try:
            started = [self._executor.submit(gate.wait) for _ in range(threads)]
            done, _ = wait(started, return_when=FIRST_EXCEPTION)
            for job in done:
                job.result()
        except BaseException as e:  # e.g. no thread could be started, or one could not make the device current
            gate.abort()  # the threads that did start leave the gate
            self.close()
            if isinstance(e, BrokenThreadPool):  # a thread's initializer (set_device) raised
                raise RuntimeError(
                    f"UnstageWorkers device={self.device}: a thread could not make the device current ({e})"
                ) from e
            raise

    @property
    def alive(self) -> bool:
        """Whether work submitted now runs: not closed, and this is the process that started the threads."""
        return self._executor is not None and os.getpid() == self._pid

    def submit(self, fn: Any, *args: Any) -> Future:
        executor = self._executor  # close() on another thread may clear it
        closed = "UnstageWorkers: closed, or started by another process (a fork): make new ones"
        if executor is None or os.getpid() != self._pid:
            raise RuntimeError(closed)
        try:
            return executor.submit(fn, *args)
        except RuntimeError as e:  # shut down meanwhile ("cannot schedule new futures after shutdown")
            raise RuntimeError(closed) from e

    def close(self) -> None:
        """Cancel the work not started yet, wait for the rest, end the threads. Idempotent."""
        if self.alive:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor = None  # a forked child's copy: its threads never existed here

    def __enter__(self) -> UnstageWorkers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Stager:
    """Copies device (or, on CPU, host) bytes into pageable host destinations through a ring of staging buffers.

    :meth:`put` enqueues the copy of a source into the current staging buffer on ``stream`` (the caller's side
    stream; ``None`` on CPU: synchronous), cutting it across buffers where it does not fit. A full buffer is
    *sealed*: an event is recorded after its copies and its bytes are split into slices that the thread pool
    copies into the destinations once the event has completed. Before a buffer is filled again, the caller
    waits until its slices are done. The staging memory is allocated for one export and released by
    :meth:`close`, so no memory stays allocated between exports. Used as a context manager.

    Preparing the staging memory is fresh memory's cost: faulting it in (the kernel zeroes every page) and, for
    CUDA, pinning it (``cudaHostRegister``, one call per buffer). The pool's threads fault the buffers in, in
    pieces of whole huge pages, the first buffer's pieces first, while the caller starts, and pin each buffer
    once its pieces are in; the caller waits for a buffer only before its first use, so the device waits for
    the first buffer, not for the whole ring: pinning the whole ring in one call on the caller's thread would hold
    the export for a sizeable part of its time, and buffers pinned by the pool let the caller fill the first one
    while the others are pinned (docs/design.md, "Measured figures behind the defaults").

    ``workers`` is the pool: live :class:`UnstageWorkers` for the stream's device (``None`` on CPU), kept
    running by :meth:`close`; each of its threads waits for its slot's event itself. ``slot_bytes`` is the size
    of one staging buffer.
    """

    def __init__(
        self,
        total_bytes: int,
        stream: Any,
        workers: UnstageWorkers,
        *,
        slot_bytes: int = SLOT_BYTES,
    ) -> None:
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0 or slot_bytes % _ALIGN:
            raise ValueError(f"Stager slot_bytes={slot_bytes!r}: expected a positive multiple of {_ALIGN}")
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes < 1:
            raise ValueError(f"Stager total_bytes={total_bytes!r}: expected an int >= 1")
        # the pool's threads wait on events and pin (the stream's device current)
        device = None if stream is None else stream.device
        if not workers.alive or workers.device != device:
            raise ValueError(
                f"Stager: UnstageWorkers for device {workers.device} (alive={workers.alive}); this stager needs "
                f"live workers for device {device}"
            )
        # whole pages per buffer (slot_bytes rounded up): each is pinned on its own, and two registrations may not
        # share a page; the ring is at least _FAULT_GRAIN bytes, which host_empty maps on their own, page-aligned
        # (a small ring from the heap could share a page with a pinned pool buffer); untouched pages cost nothing
        slot = -(-min(slot_bytes, total_bytes) // _PAGE) * _PAGE
        slots = min(STAGING_SLOTS, max(1, -(-total_bytes // slot)))
        self._stream = stream
        self._memory = host_empty(torch.Size([max(slot * slots, _FAULT_GRAIN)]), torch.uint8)
        self._slots = list(self._memory[: slot * slots].split(slot))
        self._jobs: list[list[tuple[int, int, int]]] = [[] for _ in self._slots]
        self._busy: list[list[Future]] = [[] for _ in self._slots]
        self._current, self._used = 0, 0
        self._workers = workers
        self._threads = workers.threads
        # per buffer: the pool's fault-in pieces (None once the buffer was prepared), its pinning by the pool
        # (CUDA; None on CPU), whether it is pinned
        self._faulting: list[list[Future] | None] = []
        self._pinning: list[Future | None] = []
        self._pinned = [False] * len(self._slots)
        self._refused = False  # cudaHostRegister refused a buffer (warned once)
        try:
            for s in self._slots:
                self._fault_in(s)
        except BaseException:  # e.g. the workers were closed meanwhile: what was queued goes, what was pinned too
            self._stop_ring_jobs()
            self._unpin()
            raise

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def put(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy contiguous ``src`` into contiguous host ``dst`` (same dtype and size) through the staging ring."""
        if dst.device.type != "cpu" or not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype:
            raise ValueError("Stager.put copies a contiguous tensor into a contiguous host tensor of its dtype")
        if src.numel() != dst.numel():
            raise ValueError(f"Stager.put: {src.numel()} source elements for {dst.numel()} destination elements")
        src_bytes, dst_bytes = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
        done, n = 0, src_bytes.numel()
        while done < n:
            slot = self._slots[self._current]
            if self._used >= slot.numel():
                self._seal()
                continue
            if not self._jobs[self._current] and self._busy[self._current]:
                self._wait(self._current)  # its previous contents must be in their destinations
            if self._faulting[self._current] is not None:
                self._prepare(self._current)
            take = min(slot.numel() - self._used, n - done)
            staging = slot[self._used : self._used + take]
            staging.copy_(src_bytes[done : done + take], non_blocking=self._stream is not None)
            self._jobs[self._current].append((dst_bytes[done:].data_ptr(), staging.data_ptr(), take))
            self._used = -(-(self._used + take) // _ALIGN) * _ALIGN
            done += take

    def flush(self) -> None:
        """Seal the current buffer and wait until every destination holds its bytes."""
        if self._jobs[self._current]:
            self._seal()
        for i in range(len(self._slots)):
            self._wait(i)

    def close(self) -> None:
        """Wait for every copy (also after an error), then unpin and free the staging memory."""
        try:
            if self._stream is not None:
                self._stream.synchronize()  # no device copy may still write into the staging memory
            for i in range(len(self._slots)):
                self._wait(i, raise_errors=False)
        finally:
            self._stop_ring_jobs()  # fault-ins and pins of buffers never used (every copy was waited for above)
            self._unpin()
            self._slots, self._memory = [], torch.empty(0, dtype=torch.uint8)

    def _stop_ring_jobs(self) -> None:
        """Cancel the ring's fault-in and pin jobs that have not started, wait for the others."""
        jobs = [job for pieces in self._faulting if pieces for job in pieces]
        jobs += [job for job in self._pinning if job is not None]
        # a job cancelled here, or by closed workers, never completes: wait() would not return for it
        wait([job for job in jobs if not job.cancel()])

    def _unpin(self) -> None:
        """Once the pool has stopped: unregister every pinned buffer, also those the pool pinned that were never
        prepared (unused, or the export failed first)."""
        for i, pinning in enumerate(self._pinning):  # also a buffer whose _prepare was interrupted
            if not self._pinned[i] and pinning is not None and pinning.done() and not pinning.cancelled():
                self._pinned[i] = pinning.exception() is None and pinning.result()
        for slot, pinned in zip(self._slots, self._pinned):
            if pinned:
                unregister_host(slot.data_ptr())
        self._pinned, self._pinning, self._faulting = [], [], []

    def _fault_in(self, slot: torch.Tensor) -> None:
        """Have the pool fault ``slot`` in (:func:`fault_pieces`), then (CUDA) pin it."""
        pieces = [self._workers.submit(fault_in, slot[a:b]) for a, b in fault_pieces(slot.numel(), self._threads)]
        cuda = self._stream is not None  # the pool's threads have the device current
        self._faulting.append(pieces)
        self._pinning.append(self._workers.submit(_pin_after, list(pieces), slot) if cuda else None)

    def _prepare(self, i: int) -> None:
        """Before buffer ``i``'s first use: wait until it is faulted in and (CUDA) pinned."""
        pieces, self._faulting[i] = self._faulting[i], None
        for piece in pieces:
            _result(piece)
        if self._stream is None:
            return
        self._pinned[i] = _result(self._pinning[i])
        if not self._pinned[i] and not self._refused:
            self._refused = True
            warnings.warn("cudaHostRegister refused a staging buffer: this export copies pageable", stacklevel=3)

    def _seal(self) -> None:
        i = self._current
        event = None
        if self._stream is not None:
            event = torch.cuda.Event(blocking=True)  # waiting threads sleep instead of spinning
            event.record(self._stream)
        self._busy[i] = [self._workers.submit(_copy, event, part) for part in split_bytes(self._jobs[i], self._threads)]
        self._jobs[i] = []
        self._current, self._used = (i + 1) % len(self._slots), 0

    def _wait(self, i: int, raise_errors: bool = True) -> None:
        busy, self._busy[i] = self._busy[i], []
        for future in busy:
            error = _outcome(future)
            if error is not None and raise_errors:
                raise error
