"""A save within a host-memory budget: ``BudgetSavePlanner``, DCP's save planner that fills each tensor's host
bytes just before DCP writes it and gives them back once written, so that a save holds at most the budget, plus
the staging of the one item being filled (at most 128 MiB: two default chunks), whatever the state's size. See
docs/export.md, "Saves within a host budget".

An optimizer's chunked export made inside :meth:`BudgetSavePlanner.exporting` returns host tensors whose memory
is untouched (``unfilled_state_dict``); a CUDA tensor of the state dict (the model's) is copied into fresh host
memory. Either is filled when DCP's writer asks for it (``resolve_data``), on its writer thread, one fill at a
time; a thread's previous item is then written (DCP's serial loader asks for the next item only after writing
the previous one), and its pages are given back to the system (``MADV_DONTNEED``) although DCP still references
the tensor. DCP's overlapping loader (one writer thread, CUDA, ``per_thread_copy_ahead > 0``) asks ahead of its
writes, and would have an item's pages given back before they are written: the planner takes the writer and
refuses one that copies ahead (:func:`writer_for` builds one that does not).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from optim_factory.optimizers.export import local_tensor
from optim_factory.optimizers.export.host_memory import host_empty

__all__ = ["BudgetSavePlanner", "writer_for", "refuse_budgeted"]


def refuse_budgeted(optimizers: Any, where: str) -> None:
    """A ``ValueError`` naming the option when an optimizer of ``optimizers`` has a host budget: ``where`` (a
    checkpointer) would export it whole, not within the budget."""
    for opt in optimizers:
        budget = getattr(getattr(opt, "export_options", None), "host_budget", None)
        if budget is not None:
            raise ValueError(
                f"state_dict_offload_host_budget={budget}: {where} holds a whole export; a save within the budget "
                "goes through optim_factory.budget.BudgetSavePlanner (a synchronous plain DCP save)"
            )


def _item_bytes(item: Any) -> int:
    """Bytes of a tensor write item (0 for pickled ones)."""
    data = getattr(item, "tensor_data", None)
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * torch.empty(0, dtype=data.properties.dtype).element_size()


def writer_for(checkpoint_id: Any, **kwargs: Any) -> FileSystemWriter:
    """DCP's ``FileSystemWriter`` as :class:`BudgetSavePlanner` needs it: without copy-ahead."""
    return FileSystemWriter(checkpoint_id, per_thread_copy_ahead=0, **kwargs)


class _Budget:
    """Bytes held by a save's writer threads (each holds one item at a time), and the most held at once."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self.peak = limit, 0, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise  # a CDLL call releases the GIL
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _give_pages_back(t: torch.Tensor) -> None:
    """The whole pages of host tensor ``t`` back to the system (reads afterwards see zeros)."""
    madvise = _madvise()
    if madvise is None:
        return
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start:
        madvise(start, end - start, 4)  # MADV_DONTNEED


class BudgetSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that fills what a save writes item by item within ``budget`` bytes of host memory
    (``optimizer.export_options.host_budget`` for :meth:`exporting`'s optimizer when not given).

    ``writer = writer_for(path)``, ``planner = BudgetSavePlanner(writer)``, ``with planner.exporting(opt): sd =
    {"model": ..., "optim": get_optimizer_state_dict(model, opt)}``, then ``dcp.save(sd, storage_writer=writer,
    planner=planner)``, then :meth:`release`. The data files are those of a save without it, byte for byte."""

    def __init__(self, writer: Any, budget: int | None = None, **kwargs: Any) -> None:
        """``writer``: the storage writer of the save (DCP's ``FileSystemWriter`` or a subclass, without copy-ahead);
        ``budget``: bytes (default: the optimizer's ``state_dict_offload_host_budget``); ``kwargs``: DCP's
        ``DefaultSavePlanner``'s."""
        ahead = getattr(writer, "per_thread_copy_ahead", None)
        if ahead != 0:
            raise ValueError(
                f"BudgetSavePlanner: the writer's per_thread_copy_ahead is {ahead}: DCP would ask for an item before "
                "the previous one is written; build it with per_thread_copy_ahead=0 (optim_factory.budget.writer_for)"
            )
        form = getattr(writer, "serialization_format", None)
        if form is not None and getattr(form, "name", form) != "TORCH_SAVE":
            raise ValueError(
                f"BudgetSavePlanner: the writer's serialization_format is {form}: DCP writes such a file from every "
                "tensor again at its end, after their pages were given back; write with the default (TORCH_SAVE)"
            )
        if _madvise() is None:
            raise ValueError("BudgetSavePlanner: needs Linux (pages are given back with madvise)")
        super().__init__(**kwargs)
        self._threads = max(1, getattr(writer, "thread_count", 1))
        self._budget: _Budget | None = None if budget is None else _Budget(budget)
        self._fills: dict[int, tuple[Any, Any, int]] = {}  # placeholder data_ptr -> (exporter, item, chunk bytes)
        self._held: dict[int, torch.Tensor] = {}  # writer thread -> the tensor it was last given
        self._lock = threading.Lock()
        self._filling = threading.Lock()

    @property
    def peak_bytes(self) -> int:
        """The most bytes this planner's save held at once."""
        return 0 if self._budget is None else self._budget.peak

    @contextlib.contextmanager
    def exporting(self, optimizer: Any) -> Iterator[None]:
        """``optimizer``'s chunked exports started inside return unfilled host tensors this planner fills."""
        if self._budget is None:
            budget = optimizer.export_options.host_budget
            if budget is None:
                raise ValueError(
                    "BudgetSavePlanner: give budget=, or an optimizer built with state_dict_offload_host_budget"
                )
            self._budget = _Budget(budget)
        with optimizer.unfilled_state_dict() as items:
            yield
        chunk = optimizer.export_options.chunk_bytes
        for item in items:
            self._fills[item.dst.data_ptr()] = (optimizer.state_exporter, item, chunk)

    def create_local_plan(self) -> Any:
        """DCP's local plan, refused when its writer threads could hold more than the budget: each holds the item
        it writes (the largest ones at worst)."""
        plan = super().create_local_plan()
        if self._budget is None:
            raise ValueError("BudgetSavePlanner: no budget (give budget=, or export inside planner.exporting(opt))")
        sizes = sorted((_item_bytes(item) for item in plan.items), reverse=True)
        worst = sum(sizes[: self._threads])
        if worst > self._budget.limit:
            raise ValueError(
                f"BudgetSavePlanner: {self._threads} writer thread(s) may hold {worst} bytes at once (the largest "
                f"items), more than the budget of {self._budget.limit}: fewer writer threads or a larger budget"
            )
        return plan

    def resolve_data(self, write_item: Any) -> Any:
        obj = super().resolve_data(write_item)
        if not isinstance(obj, torch.Tensor):
            return obj
        local = local_tensor(obj)
        fill = self._fills.get(local.data_ptr())
        if fill is None and not local.is_cuda:
            return obj
        me = threading.get_ident()
        with self._lock:
            previous = self._held.pop(me, None)
        if previous is not None:  # written: DCP's serial loader asks for the next item only after that
            _give_pages_back(previous)
            self._budget.give(previous.numel() * previous.element_size())
        nbytes = local.numel() * local.element_size()
        self._budget.take(nbytes)
        with self._filling:  # one fill at a time: its staging ring (at most 128 MiB) is the bytes beyond the budget
            if fill is not None:
                exporter, item, chunk = fill
                exporter.stream([item], chunk)
                host = local
            else:
                host = host_empty(local.shape, local.dtype)
                host.copy_(local)
        with self._lock:
            self._held[me] = host
        return host

    def release(self) -> None:
        """Give back what the save's writer threads held last (call after ``dcp.save``)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        self._fills.clear()
        for t in held:
            _give_pages_back(t)
            self._budget.give(t.numel() * t.element_size())
