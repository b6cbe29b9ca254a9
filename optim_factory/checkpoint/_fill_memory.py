"""The host memory that a save within a host budget fills (``BudgetSavePlanner``'s part, ``_budget.py``):
:class:`FillMemory` builds each tensor's fill (a ``Fill`` of ``_fills.py``: an export's streamed state or a tensor,
copied from where it lives), and starts a save's fills into fresh memory or, when the save fits the budget whole,
into the buffers kept from the last such save (a ``HostBufferPool``, pinned once released on the save's GPU; in
shared memory for a writer process). The kept buffers are reused while the next save fits whole with the same
layout (each tensor's key, shape, dtype and pinning), else freed. The fills copy from a GPU on a side stream per
device, kept from save to save, which waits for the work queued on the device when the save starts.
See docs/export.md, "Saves within a host budget".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from optim_factory.checkpoint._fills import Fill, SaveFills
from optim_factory.optimizers.export import HostBufferPool, StreamItem

__all__ = ["FillMemory"]


class FillMemory:
    """The fills of ``optimizer``'s budgeted saves, within ``limit`` bytes; ``shared``: in shared memory."""

    def __init__(self, optimizer: Any, limit: int, shared: bool) -> None:
        self.optimizer, self.limit, self.shared = optimizer, limit, shared
        self._streams: dict[torch.device, Any] = {}  # the fills' side stream per device, kept from save to save
        self._device: torch.device | None = None  # the last save's GPU: where the kept buffers' thread pins them
        self._kept = self._pool()  # the buffers of the last save, when it fit the budget whole
        self._kept_layout: list | None = None  # that save's (key, shape, dtype, pinning) of each tensor it filled

    def begin(self, devices: set[torch.device]) -> None:
        """A save of tensors on ``devices`` starts: its fills wait for the work queued so far on their current CUDA
        streams, and the buffers kept for the next save are pinned on the caller's GPU (else the first one's)."""
        current = torch.device("cuda", torch.cuda.current_device()) if devices else None  # the caller's
        self._device = current if current in devices else min(devices, key=lambda d: d.index, default=None)
        for device in devices:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the states are final here

    def fill(self, fqn: str, source: Any) -> Fill:
        """The fill of the save's key ``fqn`` from ``source``: an export's streamed state (``StreamItem``) or a
        tensor."""
        exported = isinstance(source, StreamItem)
        cuda = (source.source if exported else source).is_cuda
        pinning = self.optimizer.export_options.pinning_on("cuda" if cuda else "cpu")

        def item(host: torch.Tensor, direct: bool) -> StreamItem:
            if exported:  # a fresh destination is staged, on the host too (as a fresh export's: plan.py)
                return dataclasses.replace(source, dst=host, result=host, staged=not direct)
            return StreamItem(source.reshape(-1), None, host, host, staged=cuda and not direct)

        layout = source.dst if exported else source
        return Fill(fqn, layout.shape, layout.dtype, item, cuda, pinning)

    def fits_whole(self, order: list[Fill], early_bytes: int) -> bool:
        """Whether ``order`` and the ``early_bytes`` copied at the save's start fit the budget at once."""
        return sum(f.nbytes for f in order) + early_bytes <= self.limit

    def fills(self, order: list[Fill], early_bytes: int) -> SaveFills:
        """The fills of ``order`` (not started), within the budget less ``early_bytes``: into the kept buffers when
        they fit it whole (the kept ones of another layout freed first, and unpinned), else into fresh memory."""
        fits = self.fits_whole(order, early_bytes)
        layout = [(f.fqn, f.shape, f.dtype, f.pinning) for f in order] if fits else None
        if layout != self._kept_layout:
            self.drop_kept()
            self._kept_layout = layout
        exporter, chunk = self.optimizer.state_exporter, self.optimizer.export_options.chunk_bytes
        kept = self._kept if fits else None
        return SaveFills(order, self.limit - early_bytes, exporter, chunk, self._streams, kept, shared=self.shared)

    @property
    def kept_bytes(self) -> int:
        """Bytes of host buffers kept for the next save (during a save that fills them, 0)."""
        return self._kept.free_bytes()

    def drop_kept(self) -> None:
        """Free the buffers kept for the next save (``HostBufferPool.clear``: on its thread, on the save's GPU)."""
        self._kept.clear()
        self._kept, self._kept_layout = self._pool(), None

    def _pool(self) -> HostBufferPool:
        """A pool for the kept buffers (pinned on the last save's GPU; in shared memory where :attr:`shared`)."""
        pool = HostBufferPool(self._device)
        if self.shared:
            pool.use_shared_memory()
        return pool
