"""The streamed (chunked) export: planning states into chunks, and the pipeline that converts them on the
accelerator and copies them to host memory. See docs/design.md, "Streaming".
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from optim_factory.optimizers.export.host_memory import HostBufferPool
from optim_factory.optimizers.export.staging import (
    SLOT_BYTES,
    STAGING_SLOTS,
    Stager,
    UnstageWorkers,
    unstage_threads,
)
from optim_factory.optimizers.export.threads import ProcessThreads

__all__ = ["StreamItem", "Piece", "plan_chunks", "StateExporter"]

_ALIGN = 64  # byte offset alignment of the pieces packed into one chunk


@dataclass
class StreamItem:
    """One state streamed to the host: ``source`` (flat, raw storage dtype) times ``scale`` into ``dst``."""

    source: torch.Tensor
    scale: torch.Tensor | None
    dst: torch.Tensor  # host, local shape, contiguous
    result: torch.Tensor  # ``dst``, or ``dst`` wrapped as a DTensor like the parameter
    staged: bool  # ``dst`` is filled through a staging buffer (pageable memory), not copied into directly

    @property
    def converts(self) -> bool:
        """Needs converting (BF16/FP16/FP8); FP32 states and int16 remainders are copied as they are."""
        return self.scale is not None or self.source.dtype != self.dst.dtype


@dataclass
class Piece:
    """An element range of one item, placed at a byte offset of a chunk."""

    item: StreamItem
    start: int  # element range of the item
    stop: int
    offset: int  # byte offset in the chunk buffers

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This piece's slot in a chunk buffer (uint8), typed like the destination."""
        nbytes = (self.stop - self.start) * self.item.dst.element_size()
        return buffer[self.offset : self.offset + nbytes].view(self.item.dst.dtype)

    def source(self) -> torch.Tensor:
        return self.item.source[self.start : self.stop]

    def dst(self) -> torch.Tensor:
        return self.item.dst.view(-1)[self.start : self.stop]


def plan_chunks(items: list[StreamItem], chunk_bytes: int) -> list[list[Piece]]:
    """Cut the items into pieces and pack them, in order, into chunks of at most ``chunk_bytes`` bytes."""
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for item in items:
        esize = item.dst.element_size()
        start, n = 0, item.dst.numel()
        while start < n:
            room = (chunk_bytes - used) // esize
            if room <= 0:
                chunks.append(current)
                current, used = [], 0
                continue
            stop = min(n, start + room)
            current.append(Piece(item, start, stop, used))
            used = -(-(used + (stop - start) * esize) // _ALIGN) * _ALIGN
            start = stop
    if current:
        chunks.append(current)
    return chunks


def _chunk_bytes(chunk: list[Piece]) -> int:
    last = chunk[-1]
    return last.offset + (last.stop - last.start) * last.item.dst.element_size()


def _convert(piece: Piece, out: torch.Tensor) -> None:
    """Exactly what ``get_unscaled_state`` computes, for one piece: widen to FP32, then times the scale."""
    out.copy_(piece.source())
    if piece.item.scale is not None:
        out.mul_(piece.item.scale)


class StateExporter:
    """Streams converted optimizer states into host tensors (the ``chunk_bytes`` mode of the export), with the
    resources that outlive one export: the pool of reusable host buffers, the unstaging threads, the background
    thread. What streams, and into which destination, is the export's plan (``plan.ExportPlan``).

    Per chunk: the pieces that need converting (BF16/FP16/FP8 states) are converted into one of two device
    buffers on the current stream; a side stream copies every piece (converted, or straight from FP32/int16
    states) to the host. The current stream waits for the copy of chunk ``i - 2`` before it overwrites that
    chunk's buffer, so chunk ``i + 1`` is converted while chunk ``i`` is being copied. Pinned destinations
    (pool buffers) are copied into directly; pageable ones (fresh, or pool buffers not pinned yet) through a
    :class:`~optim_factory.optimizers.export.staging.Stager`: a ring of staging buffers pinned for this export
    only, emptied by :func:`~optim_factory.optimizers.export.staging.unstage_threads` host threads while the
    device fills the next one. On CPU the same steps run, the device copies synchronously. Those threads
    (:meth:`unstage_workers`, one set per device) are started once and kept between exports; the optimizer
    starts them when it is built for a chunked export (``ExportPlan.start_threads``), so that no export waits for
    them.

    :meth:`stream_background` runs the same pipeline on a background thread, with the conversions on a side
    stream that first waits for the caller's stream; at most one such export is pending (:meth:`wait`).

    Each FusedAdam of this package creates one in ``__init__`` and owns it (with its :attr:`pool`); the export of
    an optimizer without one (TE's own class, in tests) uses a temporary one.
    """

    def __init__(self) -> None:
        self.pool = HostBufferPool()
        self._copy_streams: dict[torch.device, Any] = {}
        self._convert_streams: dict[torch.device, Any] = {}
        self._thread = ProcessThreads(1, "export-stream")
        self._pending: Future | None = None
        self._taking = threading.Lock()  # a finished export stops being pending once, never a later one
        self._pending_pid = 0  # the process whose thread runs the pending export
        self._unstagers: dict[torch.device, UnstageWorkers] = {}

    def unstage_workers(self, device: torch.device) -> UnstageWorkers:
        """The threads that empty the staging ring for states on ``device``: :func:`unstage_threads` of them,
        started by the first call (in a forked child: again) and kept until :meth:`close`."""
        workers = self._unstagers.get(device)
        if workers is None or not workers.alive:
            workers = self._unstagers[device] = UnstageWorkers(unstage_threads(), device)
        return workers

    def close(self) -> None:
        """End this exporter's threads, after a pending export (whose failure stays for :meth:`wait`). The
        exporter still works afterwards: threads are started again when an export needs them."""
        self.join()
        for workers in self._unstagers.values():
            workers.close()
        self._unstagers.clear()
        self._thread.shutdown()

    def __enter__(self) -> StateExporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stream(self, items: list[StreamItem], chunk_bytes: int, ring_bytes: int | None = None) -> None:
        """Fill every item's destination; returns when all host tensors hold their final values. ``ring_bytes``:
        the most host bytes of the staging ring (default: ``STAGING_SLOTS`` buffers of ``SLOT_BYTES``)."""
        by_device: dict[torch.device, list[StreamItem]] = {}
        for item in items:
            by_device.setdefault(item.source.device, []).append(item)
        slot = (
            SLOT_BYTES
            if ring_bytes is None
            else min(SLOT_BYTES, max(_ALIGN, ring_bytes // STAGING_SLOTS // _ALIGN * _ALIGN))
        )
        for device, group in by_device.items():
            self._stream_device(device, plan_chunks(group, chunk_bytes), slot)

    def stream_background(self, items: list[StreamItem], chunk_bytes: int) -> Future:
        """Fill every item's destination on the background thread; return at once. On CUDA the conversions
        run on a side stream that waits for the caller's current stream (the states are final there), so they
        overlap the caller's next kernels. Waits for a pending export first (one at a time)."""
        self.wait()
        ready = {}
        for item in items:
            device = item.source.device
            if device.type == "cuda" and device not in ready:
                ready[device] = torch.cuda.current_stream(device).record_event()
        # the states' GPU current on the thread: leaving ``torch.cuda.stream(...)`` restores the thread's
        # device, and restoring a new thread's device 0 (cudaSetDevice) creates a context on GPU 0
        self._pending = self._thread.submit(next(iter(ready), None), self._stream_after, items, chunk_bytes, ready)
        self._pending_pid = os.getpid()
        return self._pending

    def _stream_after(self, items: list[StreamItem], chunk_bytes: int, ready: dict[torch.device, Any]) -> None:
        with contextlib.ExitStack() as stack:
            for device, event in ready.items():
                convert = self._convert_streams.get(device)
                if convert is None:
                    convert = self._convert_streams[device] = torch.cuda.Stream(device)
                convert.wait_event(event)
                stack.enter_context(torch.cuda.stream(convert))  # this thread's current stream on ``device``
            self.stream(items, chunk_bytes)

    def hold(self, job: Future) -> None:
        """Make ``job`` (work that reads the states beside training: a budgeted save's fills) pending as a
        background export is, so that ``step()``, ``state_dict()`` and ``load_state_dict()`` wait for it first
        (after waiting for a pending export). ``job`` should not fail: its failure would be raised by that wait."""
        self.wait()
        self._pending, self._pending_pid = job, os.getpid()

    @property
    def pending(self) -> bool:
        """Whether a background export has not been waited for (it may have finished)."""
        return self._pending is not None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the pending background export (if any) has finished; re-raise its failure (once: the
        export is no longer pending afterwards). It stays pending until it has finished, so that a ``step()`` on
        another thread that waits meanwhile waits for it too; every waiter that waited for it meanwhile gets its
        failure, a wait that starts once it has been taken does not. ``timeout`` seconds without the export
        finishing raise ``concurrent.futures.TimeoutError`` and leave it pending."""
        pending = self._pending
        if pending is None:
            return
        if self._orphaned(pending):
            self._pending = None
            raise RuntimeError(
                "a background export was running when this process was forked: its thread and the rest of "
                "its dictionary stayed in the parent"
            )
        pending.exception(timeout)  # finished, still pending for any other waiter
        with self._taking:
            if self._pending is pending:
                self._pending = None
        pending.result()

    def join(self) -> None:
        """Block until the pending background export has finished, without raising or clearing its failure."""
        if self._pending is not None and not self._orphaned(self._pending):
            self._pending.exception()

    def _orphaned(self, pending: Future) -> bool:
        """Whether ``pending`` never finishes here: started in the parent of this forked process, not done then."""
        return self._pending_pid != os.getpid() and not pending.done()

    def _stream_device(self, device: torch.device, chunks: list[list[Piece]], slot_bytes: int = SLOT_BYTES) -> None:
        cuda = device.type == "cuda"
        compute = torch.cuda.current_stream(device) if cuda else None
        copy = self._copy_stream(device) if cuda else None
        if cuda:
            copy.wait_stream(compute)  # the states are final (the last step's kernels have run)
        need = max((_chunk_bytes(c) for c in chunks if any(p.item.converts for p in c)), default=0)
        buffers = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(2)] if need else []
        staged_bytes = sum((p.stop - p.start) * p.item.dst.element_size() for c in chunks for p in c if p.item.staged)
        freed: list[Any] = [None, None]  # copy-stream events after which buffers[i] may be reused
        staging = (
            Stager(staged_bytes, copy, self.unstage_workers(device), slot_bytes=slot_bytes) if staged_bytes else None
        )
        with staging or contextlib.nullcontext() as stager:
            for i, chunk in enumerate(chunks):
                slot = i % 2
                converts = [p for p in chunk if p.item.converts]
                if converts:
                    if freed[slot] is not None:
                        compute.wait_event(freed[slot])
                    for piece in converts:
                        _convert(piece, piece.view(buffers[slot]))
                    if cuda:
                        copy.wait_stream(compute)
                with torch.cuda.stream(copy) if cuda else contextlib.nullcontext():
                    for piece in chunk:
                        src = piece.view(buffers[slot]) if piece.item.converts else piece.source()
                        if piece.item.staged:
                            stager.put(src, piece.dst())
                        else:
                            piece.dst().copy_(src, non_blocking=cuda)
                    freed[slot] = copy.record_event() if cuda else None
            if stager is not None:
                stager.flush()  # every staged destination holds its bytes
        if cuda:
            copy.synchronize()  # every host tensor is final; the device buffers can go back to the allocator

    def _copy_stream(self, device: torch.device) -> Any:
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device)
        return stream
