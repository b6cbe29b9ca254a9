"""A save within a host-memory budget: ``BudgetSavePlanner``, DCP's save planner that exports each optimizer state
(and copies each CUDA tensor) into host memory just before DCP writes it and gives that memory back once written,
so that a save holds at most the budget (which must hold its writer threads' largest items: each thread holds the
item it writes), plus the staging of the one item being filled (a ring of at most 128 MiB, less for a smaller
state). See docs/export.md, "Saves within a host budget".

An optimizer's chunked export made inside :meth:`BudgetSavePlanner.exporting` returns a meta tensor in place of each
streamed state (``unfilled_state_dict``): no memory; a reader that copies its data out (``.cpu()``, a plain
``dcp.save``) fails loudly, while pickling it (``torch.save``) stores a tensor without data. The planner knows each
placeholder's key in the flattened state dict and, when DCP's writer asks for that key (``resolve_data``), streams
the state into fresh host memory on the writer thread, one fill at a time; a thread's previous item is then written
(DCP's serial loader asks for the next item only after writing the previous one) and its pages are given back
(``MADV_DONTNEED``) although DCP still references the tensor. That holds for the writer
:meth:`BudgetSavePlanner.save` builds (DCP's ``FileSystemWriter`` without copy-ahead, whose overlapping loader asks
ahead): planning anywhere else is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from optim_factory.optimizers.export import local_tensor
from optim_factory.optimizers.export.host_memory import give_pages_back, host_empty
from optim_factory.tree import leaves

__all__ = ["BudgetSavePlanner", "refuse_budgeted"]

_NAME = "BudgetSavePlanner"  # the start of this module's refusals


def refuse_budgeted(optimizers: Any, where: str) -> None:
    """A ``ValueError`` naming the option when an optimizer of ``optimizers`` has a host budget: ``where`` (a
    checkpointer) would export it whole, not within the budget."""
    for opt in optimizers:
        budget = _budget_of(opt)
        if budget is not None:
            raise ValueError(
                f"state_dict_offload_host_budget={budget}: {where} holds a whole export; a save within the budget "
                "goes through optim_factory.budget.BudgetSavePlanner (a synchronous plain DCP save)"
            )


def _budget_of(optimizer: Any) -> int | None:
    """An optimizer's ``state_dict_offload_host_budget`` in bytes (None: none, or not one of ours)."""
    return getattr(getattr(optimizer, "export_options", None), "host_budget", None)


def _item_bytes(item: Any) -> int:
    """Bytes of a tensor write item (0 for pickled ones)."""
    data = getattr(item, "tensor_data", None)
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


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


class BudgetSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that fills what a save of ``optimizer``'s export writes item by item, within its
    ``state_dict_offload_host_budget`` bytes of host memory.

    ``planner = BudgetSavePlanner(opt)``; ``with planner.exporting(): sd = {"model": ..., "optim":
    get_optimizer_state_dict(model, opt)}``; ``planner.save(sd, path)`` (again for another copy, until the next
    ``step()``). The data files are those of a save without it, byte for byte."""

    def __init__(self, optimizer: Any) -> None:
        budget = _budget_of(optimizer)
        if budget is None:
            raise ValueError("BudgetSavePlanner: the optimizer has no state_dict_offload_host_budget")
        if not sys.platform.startswith("linux"):
            raise ValueError("BudgetSavePlanner: needs Linux (pages are given back with madvise)")
        super().__init__()
        self.optimizer = optimizer
        self._budget = _Budget(budget)
        self._threads = 1
        self._exporting = self._saving = False
        self._placeholders: dict[int, Any] = {}  # id of an exported meta tensor -> its stream item
        self._steps: list[Any] = []  # each group's step count at the export
        self._by_fqn: dict[str, Any] = {}  # the save's flattened keys of the placeholders -> their items
        self._held: dict[int, torch.Tensor] = {}  # writer thread -> the tensor it was last given
        self._lock = threading.Lock()
        self._filling = threading.Lock()

    @property
    def peak_bytes(self) -> int:
        """The most bytes this planner's saves held at once."""
        return self._budget.peak

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """The optimizer's chunked exports started inside hold a meta tensor in place of each streamed state."""
        self._exporting, self._placeholders = True, {}
        try:
            with self.optimizer.unfilled_state_dict() as items:
                yield
        finally:
            self._exporting = False
        self._placeholders.update({id(item.dst): item for item in items})
        self._steps = _steps(self.optimizer)

    def save(self, state_dict: dict[str, Any], checkpoint_id: Any, *, thread_count: int = 1, **dcp_kwargs: Any) -> Any:
        """``dcp.save(state_dict, checkpoint_id=...)`` through DCP's ``FileSystemWriter`` with ``thread_count``
        writer threads (without copy-ahead) and this planner; ``dcp_kwargs``: ``dcp.save``'s others
        (``process_group``, ``no_dist``). Gives back what the writer threads held last, however it ends."""
        if self._exporting:
            raise ValueError("BudgetSavePlanner.save: inside exporting(); save once the export is done")
        if not self._placeholders:
            raise ValueError("BudgetSavePlanner.save: nothing was exported inside planner.exporting()")
        if _steps(self.optimizer) != self._steps:
            raise ValueError("BudgetSavePlanner.save: the optimizer stepped since the export; export again")
        writer = FileSystemWriter(checkpoint_id, thread_count=thread_count, per_thread_copy_ahead=0)
        self._threads, self._saving = max(1, thread_count), True
        try:
            return dcp.save(state_dict, storage_writer=writer, planner=self, **dcp_kwargs)
        except CheckpointException as exc:  # DCP wraps this planner's refusals: raised here as the one line
            causes = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]  # (exception, traceback)
            refusal = next((c for c in causes if isinstance(c, ValueError) and str(c).startswith(_NAME)), None)
            if refusal is None:
                raise
            raise ValueError(str(refusal)) from exc
        finally:
            self._saving = False
            self._release()

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        if not self._saving:
            raise ValueError("BudgetSavePlanner: save with planner.save(...), which builds the writer it needs")
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._by_fqn = {}
        for fqn, value in self.state_dict.items():  # flattened by DefaultSavePlanner
            item = self._placeholders.get(id(local_tensor(value))) if isinstance(value, torch.Tensor) else None
            if item is not None:
                self._by_fqn[fqn] = item
        pickled = [
            fqn
            for fqn, value in self.state_dict.items()
            if not isinstance(value, torch.Tensor)
            and any(isinstance(leaf, torch.Tensor) and leaf.is_meta for _, leaf in leaves(value))
        ]
        if pickled:
            raise ValueError(
                f"BudgetSavePlanner: {pickled[0]} holds a meta tensor (a placeholder) inside a value DCP pickles: it "
                "would be saved without data"
            )
        missing = len({id(item) for item in self._placeholders.values()} - {id(i) for i in self._by_fqn.values()})
        if missing:
            raise ValueError(
                f"BudgetSavePlanner: {missing} of the export's states are not values of the state dict saved (a copy "
                "of a placeholder, or one inside a pickled value, holds no data): save the export itself"
            )

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
        item = self._by_fqn.get(write_item.index.fqn)
        obj = None if item is not None else super().resolve_data(write_item)
        if item is None and not (isinstance(obj, torch.Tensor) and local_tensor(obj).is_cuda):
            return obj
        source = item.source if item is not None else local_tensor(obj)
        shape, dtype = (item.dst.shape, item.dst.dtype) if item is not None else (source.shape, source.dtype)
        me = threading.get_ident()
        with self._lock:
            previous = self._held.pop(me, None)
        if previous is not None:  # written: DCP's serial loader asks for the next item only after that
            give_pages_back(previous)
            self._budget.give(previous.numel() * previous.element_size())
        host = host_empty(shape, dtype)
        nbytes = host.numel() * host.element_size()
        self._budget.take(nbytes)
        try:
            if source.is_cuda:
                torch.cuda.set_device(source.device)  # a writer thread's device is 0 until set
            with self._filling:  # one fill at a time: its staging ring is the bytes beyond the budget
                if item is not None:
                    exporter, chunk = self.optimizer.state_exporter, self.optimizer.export_options.chunk_bytes
                    exporter.stream([dataclasses.replace(item, dst=host, result=host)], chunk)
                else:
                    host.copy_(source)
        except BaseException:
            self._budget.give(nbytes)
            raise
        with self._lock:
            self._held[me] = host
        return host

    def _release(self) -> None:
        """Give back what the save's writer threads held last."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for t in held:
            give_pages_back(t)
            self._budget.give(t.numel() * t.element_size())


def _steps(optimizer: Any) -> list[Any]:
    """Each parameter group's step count (a tensor's value), to tell whether the optimizer stepped."""
    return [
        float(g["step"]) if isinstance(g.get("step"), torch.Tensor) else g.get("step") for g in optimizer.param_groups
    ]
