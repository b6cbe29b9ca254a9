"""A save within a host-memory budget: ``BudgetSavePlanner``, DCP's save planner that fills each tensor's host
bytes just before DCP writes it and gives them back once written, so that a save holds at most the budget (which
must hold its writer threads' largest items: each thread holds the item it writes), plus the staging of the one
item being filled (at most two chunks). See docs/export.md, "Saves within a host budget".

An optimizer's chunked export made inside :meth:`BudgetSavePlanner.exporting` returns host tensors whose memory
is untouched (``unfilled_state_dict``); a CUDA tensor of the state dict (the model's) is copied into fresh host
memory. Either is filled when DCP's writer asks for it (``resolve_data``), on its writer thread, one fill at a
time; a thread's previous item is then written (DCP's serial loader asks for the next item only after writing
the previous one), and its pages are given back to the system (``MADV_DONTNEED``) although DCP still references
the tensor. That holds only for the writer :meth:`BudgetSavePlanner.save` builds (DCP's ``FileSystemWriter``
without copy-ahead, whose overlapping loader asks ahead, and with torch's own serialization, not safetensors,
which writes every tensor again at a file's end) and for the very tensors the export returned: the planner fills
nothing for any other save, and refuses a state dict that holds copies of its placeholders.
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

from optim_factory.optimizers.export import local_tensor
from optim_factory.optimizers.export.host_memory import host_empty
from optim_factory.tree import local_tensors

__all__ = ["BudgetSavePlanner", "refuse_budgeted"]


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
    """DCP's default save planner that fills what a save of ``optimizer``'s export writes item by item, within its
    ``state_dict_offload_host_budget`` bytes of host memory.

    ``planner = BudgetSavePlanner(opt)``; ``with planner.exporting(): sd = {"model": ..., "optim":
    get_optimizer_state_dict(model, opt)}``; ``planner.save(sd, path)``. The data files are those of a save without
    it, byte for byte. One planner per save."""

    def __init__(self, optimizer: Any, **kwargs: Any) -> None:
        """``kwargs``: DCP's ``DefaultSavePlanner``'s."""
        budget = getattr(getattr(optimizer, "export_options", None), "host_budget", None)
        if budget is None:
            raise ValueError("BudgetSavePlanner: the optimizer has no state_dict_offload_host_budget")
        if _madvise() is None:
            raise ValueError("BudgetSavePlanner: needs Linux (pages are given back with madvise)")
        super().__init__(**kwargs)
        self.optimizer = optimizer
        self._budget = _Budget(budget)
        self._threads = 1
        self._saving = False  # inside save(): the writer is the one save() built
        self._fills: dict[int, tuple[Any, Any, int]] = {}  # placeholder data_ptr -> (exporter, item, chunk bytes)
        self._held: dict[int, torch.Tensor] = {}  # writer thread -> the tensor it was last given
        self._lock = threading.Lock()
        self._filling = threading.Lock()

    @property
    def peak_bytes(self) -> int:
        """The most bytes this planner's save held at once."""
        return self._budget.peak

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """The optimizer's chunked exports started inside return unfilled host tensors this planner fills."""
        with self.optimizer.unfilled_state_dict() as items:
            yield
        chunk = self.optimizer.export_options.chunk_bytes
        for item in items:
            if item.dst.numel():
                self._fills[item.dst.data_ptr()] = (self.optimizer.state_exporter, item, chunk)

    def save(self, state_dict: dict[str, Any], checkpoint_id: Any, *, thread_count: int = 1, **dcp_kwargs: Any) -> Any:
        """``dcp.save(state_dict, checkpoint_id=...)`` through DCP's ``FileSystemWriter`` with ``thread_count``
        writer threads (without copy-ahead) and this planner; ``dcp_kwargs``: ``dcp.save``'s others
        (``process_group``, ``no_dist``). Gives back what the writer threads held last, however it ends."""
        writer = FileSystemWriter(checkpoint_id, thread_count=thread_count, per_thread_copy_ahead=0)
        self._threads, self._saving = max(1, thread_count), True
        try:
            return dcp.save(state_dict, storage_writer=writer, planner=self, **dcp_kwargs)
        finally:
            self._saving = False
            self._release()

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        present = {t.data_ptr() for t in local_tensors(state_dict)}
        copied = [ptr for ptr in self._fills if ptr not in present]
        if copied:
            raise ValueError(
                f"BudgetSavePlanner: the state dict saved does not hold {len(copied)} of the export's tensors (a "
                "copy of them, e.g. a full_state_dict or a staged copy, would be written unfilled): save the export "
                "made inside exporting() itself"
            )
        super().set_up_planner(state_dict, *args, **kwargs)

    def create_local_plan(self) -> Any:
        """DCP's local plan, refused when its writer threads could hold more than the budget: each holds the item
        it writes (the largest ones at worst)."""
        if not self._saving:
            raise ValueError("BudgetSavePlanner: save with planner.save(...), which builds the writer it needs")
        plan = super().create_local_plan()
        sizes = sorted((_item_bytes(item) for item in plan.items), reverse=True)
        worst = sum(sizes[: self._threads])
        if worst > self._budget.limit:
            raise ValueError(
                f"BudgetSavePlanner: {self._threads} writer thread(s) may hold {worst} bytes at once (the largest "
                f"items), more than the budget of {self._budget.limit}: fewer writer threads or a larger budget"
            )
        return plan

    def resolve_data(self, write_item: Any) -> Any:
        if not self._saving:
            raise ValueError("BudgetSavePlanner: save with planner.save(...), which builds the writer it needs")
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
        try:
            with self._filling:  # one fill at a time: its staging (at most two chunks) is the bytes beyond the budget
                if fill is not None:
                    exporter, item, chunk = fill
                    exporter.stream([item], chunk)
                    host = local
                else:
                    host = host_empty(local.shape, local.dtype)
                    host.copy_(local)
        except BaseException:
            if fill is not None:
                _give_pages_back(local)
            self._budget.give(nbytes)
            raise
        with self._lock:
            self._held[me] = host
        return host

    def _release(self) -> None:
        """Give back what the save's writer threads held last."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        self._fills.clear()
        for t in held:
            _give_pages_back(t)
            self._budget.give(t.numel() * t.element_size())
