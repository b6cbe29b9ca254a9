"""``SaveFills``: the fills of one save within a host budget (``optim_factory.checkpoint``). Each tensor DCP's writer
writes is filled into fresh host memory on one thread of its own, ahead of the writer and in the order it asks for
them, while the bytes filled and not yet given back fit the budget; the writer's previous tensor is given back
when it asks for its next one. A save that fits the budget whole fills buffers of a ``HostBufferPool`` instead,
kept for the next save and pinned once released (the device copies into them directly); nothing is given back
before the save ends, so the writer may ask for them in any order. For a writer process
(``StagerOptions(write_in_process=True)``) the fresh memory is shared memory, which the process maps where it is, and
a tensor given back has its pages removed from it (``give_pages_back``).
See docs/export.md, "Saves within a host budget".

The fills run through the optimizer's exporter (``StateExporter.stream``: on CUDA, through its pinned staging ring
and at most two chunks of GPU memory), several states per call up to :data:`FILL_BATCH_BYTES`, on a side stream
that waits only for the work queued before the save: training's kernels queued meanwhile do not delay them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from optim_factory.checkpoint._budget_rule import BudgetRefused
from optim_factory.optimizers.export import (
    HostBufferPool,
    Pinning,
    Slot,
    StateExporter,
    StreamItem,
    give_pages_back,
    host_empty,
    shared_empty,
)

__all__ = ["Fill", "SaveFills", "FILL_BATCH_BYTES"]

FILL_BATCH_BYTES = 256 << 20
"""The most bytes filled by one call of the exporter: each call pins a staging ring of its own, and the writer waits
for a whole call's states before it writes the first of them."""


@dataclass
class Fill:
    """One tensor to fill: its key in the flattened state dict, its host layout, and how a host tensor of that
    layout is filled (the stream item that copies or exports into it; ``item(host, direct)``: ``direct``, the
    device may copy into ``host`` without staging it); ``cuda``: its source is on a GPU; ``pinning``: how a kept
    buffer for it is pinned."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    item: Callable[[torch.Tensor, bool], StreamItem]
    cuda: bool = False
    pinning: Pinning = Pinning.none
    host: torch.Tensor | None = None  # filled, not yet taken by a writer thread
    ready: bool = False

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


class _Closed(Exception):
    """The save ended before every fill was done."""


class SaveFills:
    """The fills of one save: ``order``: the order they are filled in (of fresh memory: the order the writer, one
    thread, asks for them); ``limit``: the budget in
    bytes; ``kept``: the pool whose buffers a save that fits the budget whole fills (None: fresh memory, given back
    once written; its buffers in shared memory where ``shared``). :meth:`take` is the writer's ``resolve_data``;
    :meth:`close` ends the save's fills and gives back everything still held (a kept buffer to its pool); ``done``
    completes when every fill is done (or failed, or the save ended), never with an exception. One writer thread: a
    thread of several whose write failed would leave its fills holding the budget while the others wait for theirs.
    ``shared``: fresh memory in shared memory (a writer process reads it where it is)."""

    def __init__(
        self,
        order: list[Fill],
        limit: int,
        exporter: StateExporter,
        chunk_bytes: int,
        streams: dict[torch.device, Any],
        kept: HostBufferPool | None = None,
        shared: bool = False,
    ) -> None:
        """``streams``: the side stream per CUDA device that the fills run on (waiting for the save's point)."""
        self.limit, self.held, self.peak = limit, 0, 0
        self._empty = shared_empty if shared else host_empty
        self._kept, self._leased = kept, []  # the kept buffers this save filled, back to the pool at close()
        self.done: Future = Future()
        self._exporter, self._chunk_bytes, self._streams = exporter, chunk_bytes, streams
        self._order = order
        self._where = {f.fqn: pos for pos, f in enumerate(order)}
        self._handed: set[int] = set()  # the positions of the fills handed to the writer
        self._unhanded = 0  # the first position neither handed nor left out of the plan
        self._written = set(self._where)  # the keys the writer asks for
        self._taken: torch.Tensor | None = None  # the tensor the writer was given last
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start filling (once; :meth:`take` starts it too)."""
        with self._cond:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._run, name="optim-factory-fills", daemon=True)
        self._thread.start()

    def take(self, fqn: str) -> torch.Tensor:
        """The filled host tensor of ``fqn``, once filled; the previous one is given back first (the writer asks for
        its next tensor once it has written the previous one). Fresh memory is filled in the writer's order and
        asked for in it; kept buffers, never given back before the save ends, are asked for in any order."""
        taken, self._taken = self._taken, None
        self._give_back(taken)
        with self._cond:
            position = self._where[fqn]
            self._check_order(fqn, position)
            self._handed.add(position)
        fill = self._order[position]
        self.start()
        with self._cond:
            while not fill.ready and self._error is None and not self._closed:
                self._cond.wait()
            if not fill.ready:
                raise RuntimeError(f"the fill of {fqn} failed: {self._error or 'the save ended'}") from self._error
            host, fill.host = fill.host, None
            self._taken = host
        return host

    def take_ready(self, fqn: str) -> dict[str, torch.Tensor]:
        """:meth:`take` of ``fqn``, and where the save fills kept buffers (nothing is given back before its end) every
        other tensor the writer will ask for (:meth:`written`) that is filled already and not yet taken, in the
        order filled, by their keys. A writer process asks for the next tensor it does not have, one message each
        way for all of them."""
        taken = {fqn: self.take(fqn)}
        if self._kept is None:  # each one given back when the writer asks for the next: one at a time
            return taken
        with self._cond:
            for position in range(self._unhanded, len(self._order)):
                fill = self._order[position]
                if not fill.ready:
                    break  # filled in order: none after it is ready either
                if position not in self._handed and fill.fqn in self._written:
                    taken[fill.fqn], fill.host = fill.host, None
                    self._handed.add(position)
            while self._unhanded < len(self._order) and (
                self._unhanded in self._handed or self._order[self._unhanded].fqn not in self._written
            ):
                self._unhanded += 1  # where the next answer's scan starts
        return taken

    def written(self, fqns: list[str]) -> None:
        """The keys of the tensors the writer will ask for (the save's final plan; before it is known, all of them):
        :meth:`take_ready` hands out no other."""
        with self._cond:
            self._written = set(fqns)

    def _check_order(self, fqn: str, position: int) -> None:
        if self._kept is None and position != len(self._handed):
            raise BudgetRefused(
                f"BudgetSavePlanner: DCP's writer asked for {fqn} out of the order the budget fills in (item "
                f"{position}, expected {len(self._handed)}): nothing more is filled"
            )
        if position in self._handed:
            raise BudgetRefused(f"BudgetSavePlanner: DCP's writer asked for {fqn} twice in one save")

    def close(self) -> None:
        """End the fills (a fill in progress is finished first) and give back every tensor still held."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        held = [t for t in (self._taken, *(f.host for f in self._order)) if t is not None]
        self._taken = None
        for f in self._order:
            f.host = None
        for host in held:
            self._give_back(host)
        if self._kept is not None:
            self._kept.release(self._leased)
            self._leased = []
        if not self.done.done():
            self.done.set_result(None)

    # ------------------------------------------------------------------ the fill thread
    def _run(self) -> None:
        try:
            with self._on_side_streams():
                batch: list[Fill] = []
                for fill in self._order:
                    if batch and (not self._fits(fill) or sum(f.nbytes for f in batch) >= FILL_BATCH_BYTES):
                        self._fill(batch)  # never wait for room while holding states the writer may wait for
                        batch = []
                    self._reserve(fill)
                    batch.append(fill)
                if batch:
                    self._fill(batch)
        except _Closed:
            pass
        except BaseException as exc:  # noqa: BLE001  (the writer waiting for a fill raises it)
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self.done.set_result(None)

    @contextlib.contextmanager
    def _on_side_streams(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device, stream in self._streams.items():
                torch.cuda.set_device(device)  # a new thread's device is 0 until set
                stack.enter_context(torch.cuda.stream(stream))
            yield

    def _fits(self, fill: Fill) -> bool:
        with self._cond:
            return self.held + fill.nbytes <= self.limit

    def _reserve(self, fill: Fill) -> None:
        with self._cond:
            while not self._closed and self.held + fill.nbytes > self.limit:
                self._cond.wait()
            if self._closed:
                raise _Closed
            self.held += fill.nbytes
            self.peak = max(self.peak, self.held)

    def _fill(self, batch: list[Fill]) -> None:
        items = [self._item(f) for f in batch]
        # the staging ring of at most two chunks: the bytes a save holds beyond the budget
        self._exporter.stream(items, self._chunk_bytes, ring_bytes=2 * self._chunk_bytes)
        with self._cond:
            for f in batch:
                f.ready = True
            self._cond.notify_all()

    def _item(self, fill: Fill) -> StreamItem:
        """The stream item of ``fill`` into its host tensor: fresh memory, or the pool's buffer (copied into
        directly where pinned, or the state is on the host)."""
        if self._kept is None:
            fill.host = self._empty(fill.shape, fill.dtype)
            return fill.item(fill.host, False)
        fill.host = self._kept.take(Slot(fill.fqn, tuple(fill.shape), fill.dtype, fill.pinning))
        with self._cond:
            self._leased.append(fill.host)
        return fill.item(fill.host, not fill.cuda or self._kept.is_pinned(fill.host))

    def _give_back(self, host: torch.Tensor | None) -> None:
        if host is None or self._kept is not None:  # a kept buffer stays held, for the next save
            return
        give_pages_back(host)
        with self._cond:
            self.held -= host.numel() * host.element_size()
            self._cond.notify_all()
