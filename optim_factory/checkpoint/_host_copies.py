"""The one host copy of a nested state dict: what an async checkpoint saves besides the optimizer's export buffers
(the model state: ``AsyncSaveStager``'s, CUDA tensors into pinned buffers kept from one save to the next), and the
pageable template the recipe's load reads into (a fresh instance per load). See docs/design.md, "The async-save
stager".

CUDA tensors are copied into pinned buffers on a side stream: the copy runs at the link's bandwidth, neither
blocks the caller nor queues behind or ahead of the caller's kernels, and a fresh pageable copy (page faults,
the driver's staging, far below the link's bandwidth) is avoided after the first save. Other tensors are
copied as they are, at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.export import local_tensor, register_host, shared_empty, unregister_host, wrap_host_local
from optim_factory.tree import map_leaves

__all__ = ["HostCopies"]


class HostCopies:
    """Reusable host buffers for nested state dicts; one per stager.

    A buffer is keyed by the tensor's place in the dict, shape and dtype; only CUDA tensors with ``pinned`` get one
    (others are copied fresh each time). :meth:`copy` overwrites the buffers of the previous copy, so the caller
    must not copy again before what it staged last is written (``AsyncSaveStager`` waits for the previous save
    first). :meth:`close` drops every buffer.
    """

    def __init__(self, pinned: bool = True, shared: bool = False) -> None:
        """``pinned=False``: CUDA tensors are copied into fresh pageable memory at once, as other tensors are (the
        load's template, read once: pinning it would lock a whole state copy per rank, kept by torch's caching
        host allocator). ``shared``: every tensor gets a buffer kept from copy to copy, in shared memory (another
        process reads it where it is: ``StagerOptions.write_in_process``), a CUDA tensor's pinned in place
        (``cudaHostRegister``) with ``pinned``."""
        self.pinned, self.shared = pinned, shared
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}

    def copy(self, obj: Any, keep: Callable[[torch.Tensor], bool] | None = None) -> tuple[Any, Callable[[], None]]:
        """(the same nested dict with host copies, a function that returns once every copy is complete).

        Tensors for which ``keep(tensor)`` is true are passed through uncopied. DTensors stay DTensors with a host
        local tensor. The copies are only guaranteed complete once the returned function has returned."""
        events: dict[torch.device, Any] = {}
        sources: list[torch.Tensor] = []

        def one(path: tuple, leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or (keep is not None and keep(leaf)):
                return leaf
            return self._tensor(leaf, path, events, sources)

        staged = map_leaves(one, obj)
        done = [self._streams[device].record_event() for device in events]

        def wait() -> None:
            for event in done:
                event.synchronize()
            sources.clear()  # the sources stay referenced (never freed and reused) until their copies are done

        return staged, wait

    def _tensor(self, tensor: torch.Tensor, path: tuple, events: dict, sources: list) -> torch.Tensor:
        local = local_tensor(tensor).detach()
        on_cuda = local.device.type == "cuda"
        if not (self.shared or (on_cuda and self.pinned)):
            return tensor.detach().to("cpu", copy=True)
        key = (path, tuple(local.shape), local.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = self._buffer(local)
        if not on_cuda:
            buf.copy_(local)
            return wrap_host_local(buf, tensor) if isinstance(tensor, DTensor) else buf
        stream = self._streams.get(local.device)
        if stream is None:
            stream = self._streams[local.device] = torch.cuda.Stream(local.device)
        if local.device not in events:  # once per copy: after the caller's work on the tensors so far
            stream.wait_stream(torch.cuda.current_stream(local.device))
            events[local.device] = None
        with torch.cuda.stream(stream):
            buf.copy_(local, non_blocking=True)
        sources.append(local)
        return wrap_host_local(buf, tensor) if isinstance(tensor, DTensor) else buf

    def _buffer(self, local: torch.Tensor) -> torch.Tensor:
        """A kept buffer for ``local``: in shared memory (``shared``; a CUDA tensor's pinned in place with
        ``pinned``), else pinned (a CUDA tensor's)."""
        if not self.shared:
            return torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
        buf = shared_empty(local.shape, local.dtype)
        if local.device.type == "cuda" and self.pinned and register_host(buf):
            # unpinned when the buffer is freed, before its memory is unmapped, whether or not close() ran: freed
            # while still registered, its address would refuse the next registration there (another buffer's)
            weakref.finalize(buf, unregister_host, buf.data_ptr(), local.device).atexit = False
        return buf

    def nbytes(self) -> int:
        """Bytes of host buffers kept for the next copy."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def close(self) -> None:
        self._buffers.clear()
        self._streams.clear()
