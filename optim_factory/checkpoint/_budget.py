"""A save within a host-memory budget: ``BudgetSavePlanner``, DCP's save planner that exports each optimizer state
(and copies each CUDA tensor) into fresh host memory ahead of DCP's writer and gives that memory back once written,
so that a save holds at most the budget, plus the staging of the fills (a ring of at most 128 MiB). A save that fits
the budget whole fills host buffers kept for the next save instead, pinned once written (``_fill_memory.py``), from the
start of its planning and in any order, as a copy at the save's start would: nothing is given back before it ends.
See docs/export.md, "Saves within a host budget".

An optimizer's chunked export made inside :meth:`BudgetSavePlanner.exporting` returns a meta tensor in place of each
streamed state (``unfilled_state_dict``): no memory; a reader that copies its data out (``.cpu()``, a plain
``dcp.save``) fails loudly, while pickling it (``torch.save``) stores a tensor without data. The planner knows each
placeholder's key in the flattened state dict; once DCP's plan is final it fills every tensor it writes on a thread
of its own, in the order the writer's threads ask for them (``_fills.py``; a save whose every tensor this rank fills
fits the budget whole: from its ``set_up_planner``, in the state dict's order, those the plan gives another rank
too, as a copy at the save's start copies them), and a writer thread's previous
tensor, written once it asks for the next, is given back (``give_pages_back``) although DCP still references it.
That order is that of DCP's ``FileSystemWriter`` without copy-ahead (whose overlapping loader asks ahead), which
:meth:`BudgetSavePlanner.save` builds; a save with the planner that builds no writer of its own is refused.

A save that a writer process plans and writes (``StagerOptions(write_in_process=True)``) is set up here first
(:meth:`BudgetSavePlanner.for_writer_process`: its refusals), and the process is sent the state dict with a meta
tensor in place of each tensor filled here; its planner there (``_remote_fills.RemoteFills``) asks for the fills in
its plan's order (:meth:`BudgetSavePlanner.fill_in_order`) and for each tensor as its writer reaches it that it does
not have yet (:meth:`BudgetSavePlanner.take_ready`), in shared memory.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from optim_factory.checkpoint._budget_rule import (
    BudgetRefused,
    host_budget,
    one_line_refusal,
    refuse_writer,
    start_copies,
)
from optim_factory.checkpoint._fill_memory import FillMemory
from optim_factory.checkpoint._fills import Fill, SaveFills
from optim_factory.checkpoint._remote_fills import sent_to_writer_process
from optim_factory.optimizers.export import give_pages_back, local_tensor, shared_empty
from optim_factory.rules.export import size_text
from optim_factory.tree import leaves, local_tensors

__all__ = ["BudgetSavePlanner"]

_NAME = "BudgetSavePlanner"  # the start of this module's refusals


def _item_bytes(item: Any) -> int:
    """Bytes of a tensor write item (0 for pickled ones)."""
    data = getattr(item, "tensor_data", None)
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


class BudgetSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that fills what a save of ``optimizer``'s export writes item by item, within its
    ``state_dict_offload_host_budget`` bytes of host memory (``_fills.py``).

    ``planner = BudgetSavePlanner(opt)``; ``with planner.exporting(): sd = {"model": ..., "optim":
    get_optimizer_state_dict(model, opt)}``; ``planner.save(sd, path)`` (again for another copy, until the next
    ``step()``). The data files are those of a save without it, byte for byte. ``copy_host_tensors``: fill host
    tensors too (an async save, written while the next ``step()`` changes them; ``AsyncSaveStager``'s); otherwise
    they are written as they are. A checkpointer of its own calls :meth:`begin` before DCP plans and :meth:`end`
    once DCP returned, with a ``FileSystemWriter`` without copy-ahead (:func:`refuse_writer`). ``shared``: the host
    memory it fills and copies into is shared memory, for a save written by a writer process
    (:meth:`for_writer_process`)."""

    def __init__(self, optimizer: Any, *, copy_host_tensors: bool = False, shared: bool = False) -> None:
        budget = host_budget(optimizer)
        if budget is None:
            raise BudgetRefused(f"{_NAME}: the optimizer has no state_dict_offload_host_budget")
        if not sys.platform.startswith("linux"):
            raise BudgetRefused(f"{_NAME}: needs Linux (pages are given back with madvise)")
        super().__init__()
        self.optimizer, self.limit, self.copy_host_tensors = optimizer, budget, copy_host_tensors
        self.shared = shared
        self.peak_bytes = 0  # the most bytes this planner's saves held at once
        self.last_save_bytes: int | None = None  # the most the last save held at once (its fills and early copies)
        self._saving = False
        self._refused: str | None = None  # the last save's refusal at its start (begin), raised by its planning
        self._items: list = []  # the last export's streamed states (their placeholders' stream items)
        self._steps: list[Any] | None = None  # each group's step count after that export
        self._current: list | None = None  # inside exporting(): the streamed states exported so far
        self._sources: dict[str, Any] = {}  # the save's flattened keys filled -> a stream item or a tensor
        self._to_fill: dict[str, Fill] = {}  # the fill of each of those keys, built once a save (set_up_planner)
        self._early: dict[int, torch.Tensor] = {}  # an async save's copies made at its start (_copy_early), by id
        self._early_by_fqn: dict[str, torch.Tensor] = {}  # those copies by the save's flattened keys
        self._fills: SaveFills | None = None
        self._filled: Future | None = None
        self._memory = FillMemory(optimizer, budget, shared)  # what the fills fill, kept buffers included

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """The optimizer's chunked exports started inside hold a meta tensor in place of each streamed state. A save
        is of the last block that exported something (a checkpointer's block around the caller's save of an export
        made before exports nothing)."""
        if self._current is not None:  # a checkpointer's exporting() around the caller's
            yield
            return
        try:
            with self.optimizer.unfilled_state_dict() as items:
                self._current = items
                yield
        finally:
            self._current = None
        if items:
            self._items, self._steps = items, _steps(self.optimizer)

    def save(self, state_dict: dict[str, Any], checkpoint_id: Any, **dcp_kwargs: Any) -> Any:
        """``dcp.save(state_dict, checkpoint_id=...)`` through DCP's ``FileSystemWriter`` (one thread, without
        copy-ahead) and this planner; ``dcp_kwargs``: ``dcp.save``'s others (``process_group``, ``no_dist``). Gives
        back what it filled, however it ends."""
        writer = FileSystemWriter(checkpoint_id, per_thread_copy_ahead=0)
        self.begin(state_dict, writer_checked=True)
        try:
            return dcp.save(state_dict, storage_writer=writer, planner=self, **dcp_kwargs)
        except CheckpointException as exc:  # DCP wraps this planner's refusals: raised here as the one line
            raise one_line_refusal(exc) from exc
        finally:
            self.end()

    def async_save_kwargs(self, dcp_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s arguments of a checkpointer's save through this planner (none of the caller's) and
        its writer (DCP's ``FileSystemWriter`` without copy-ahead for a ``checkpoint_id``; a ``storage_writer`` must
        write in the order the fills follow, :func:`refuse_writer`)."""
        if dcp_kwargs.get("planner") is not None:
            raise BudgetRefused(
                f"{_NAME}: a save within the budget plans with this planner, not {dcp_kwargs['planner']!r}"
            )
        writer = dcp_kwargs.get("storage_writer")
        if writer is None and "://" not in str(dcp_kwargs.get("checkpoint_id")):
            writer = FileSystemWriter(dcp_kwargs["checkpoint_id"], per_thread_copy_ahead=0)
        refuse_writer(writer)
        return {**dcp_kwargs, "storage_writer": writer, "planner": self}

    def begin(self, state_dict: Any, writer_checked: bool) -> Future:
        """A save of ``state_dict`` (exported inside :meth:`exporting`) starts: its fills will wait for the work
        queued so far on the current CUDA streams, and the optimizer's ``step()`` waits for them. Returns the
        Future done once every fill is (or the save has ended). ``writer_checked``: its caller built the writer
        (:meth:`save`) or checked it (:meth:`async_save_kwargs`) for this save; else refused."""
        if self._fills is not None:  # a save that never reached end(): its fills are not this save's
            self.end()
        if self._current:  # saved inside the block that exported it
            self._items, self._steps = list(self._current), None
        self._refused, self.last_save_bytes = None, None  # this save's, once it is over
        try:
            self._check_start(writer_checked)
            self._early = self._copy_early(state_dict) if self.copy_host_tensors else {}
        except BudgetRefused as exc:  # should DCP still plan this save, its planning raises this line
            self._refused = str(exc)
            raise
        devices = {t.device for t in local_tensors(state_dict) if t.is_cuda}
        devices |= {local_tensor(item.source).device for item in self._items if item.source.is_cuda}
        self._memory.begin(devices)
        self._saving, self._filled = True, Future()
        self.optimizer.state_exporter.hold(self._filled)
        return self._filled

    def _check_start(self, writer_checked: bool) -> None:
        """Refuse a save that cannot start: not through a checkpointer's save, or of no export made inside
        :meth:`exporting` (a stager's ``exporting()`` is this), or made before the optimizer stepped again."""
        if not writer_checked:
            raise BudgetRefused(
                f"{_NAME}: a save within state_dict_offload_host_budget starts with its checkpointer's save "
                "(AsyncSaveStager.async_save, planner.save), which builds its writer"
            )
        if not self._items:
            raise BudgetRefused(
                f"{_NAME}: the optimizer's state dict was not exported inside exporting() (with stager.exporting(): "
                "or with planner.exporting(): sd = get_state_dict(...)): export it there, then save"
            )
        if self._steps is not None and _steps(self.optimizer) != self._steps:
            raise BudgetRefused(f"{_NAME}: the optimizer stepped since the export; export again")

    def _copy_early(self, state_dict: Any) -> dict[int, torch.Tensor]:
        """An async save's host copies, made now, of the tensors that the optimizer's ``step()`` does not change
        (:func:`least_host_budget`): refused before any copy when they and the largest tensor the save fills
        exceed the budget."""
        early, least = start_copies(self.optimizer, state_dict)
        if least.early + self.kept_bytes > self.limit:  # the last save's buffers go first
            self.drop_kept()
        refusal = least.refusal(self.limit)
        if refusal is not None:
            raise refusal
        if not self.shared:
            return {key: t.detach().to("cpu", copy=True) for key, t in early.items()}
        return {key: shared_empty(t.shape, t.dtype).copy_(t.detach()) for key, t in early.items()}

    def _early_bytes(self) -> int:
        """Bytes of the copies made at the save's start, held until it ends (counted in the budget)."""
        return sum(t.numel() * t.element_size() for t in self._early.values())

    def end(self) -> None:
        """The save is over: stop its fills and give back everything they hold."""
        early = self._early_bytes()
        for copy in self._early.values() if self.shared else ():  # sent in a dict the stager's record keeps
            give_pages_back(copy)
        self._saving, self._early, self._early_by_fqn, self._to_fill = False, {}, {}, {}
        fills, self._fills = self._fills, None
        if fills is not None:
            fills.close()
            self.last_save_bytes = fills.peak + early
            self.peak_bytes = max(self.peak_bytes, self.last_save_bytes)
        _complete(self._filled)

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self._check_saving()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        placeholders = {id(item.dst): item for item in self._items}
        self._sources, self._early_by_fqn = {}, {}
        for fqn, value in self.state_dict.items():  # flattened by DefaultSavePlanner
            if not isinstance(value, torch.Tensor):
                continue
            local = local_tensor(value)
            item = placeholders.get(id(local))
            if item is not None:
                self._sources[fqn] = item
            elif id(local) in self._early:
                self._early_by_fqn[fqn] = self._early[id(local)]
            elif not local.is_meta and (local.is_cuda or self.copy_host_tensors):
                self._sources[fqn] = local.detach()
        pickled = [
            fqn
            for fqn, value in self.state_dict.items()
            if not isinstance(value, torch.Tensor)
            and any(isinstance(leaf, torch.Tensor) and leaf.is_meta for _, leaf in leaves(value))
        ]
        if pickled:
            raise BudgetRefused(
                f"{_NAME}: {pickled[0]} holds a meta tensor (a placeholder) inside a value DCP pickles: it would be "
                "saved without data"
            )
        saved = {id(s) for s in self._sources.values()}
        missing = sum(id(item) not in saved for item in self._items)
        if missing:
            raise BudgetRefused(
                f"{_NAME}: {missing} of the export's states are not values of the state dict saved (a copy of a "
                "placeholder, or one inside a pickled value, holds no data): save the export itself"
            )
        self._to_fill = {fqn: self._memory.fill(fqn, source) for fqn, source in self._sources.items()}
        whole = list(self._to_fill.values())
        # a save that fits the budget whole: filled from now, in any order, as a copy would be
        if self._fills is None and self._memory.fits_whole(whole, self._early_bytes()):
            self._start_fills(whole)

    def create_local_plan(self) -> Any:
        """DCP's local plan, refused when the writer could hold more than the budget: the tensor it writes (the
        largest at worst) and the copies made at the save's start."""
        self._check_saving()
        plan = super().create_local_plan()
        largest = max((_item_bytes(i) for i in plan.items if i.index.fqn in self._sources), default=0)
        early = self._early_bytes()
        if largest + early > self.limit:
            raise BudgetRefused(
                f"state_dict_offload_host_budget={self.limit}: the save holds the tensor it writes ({largest} bytes, "
                f"the largest) and the copies made at its start ({early}): a budget of at least "
                f"{size_text(largest + early)} ({largest + early} bytes)"
            )
        return plan

    def finish_plan(self, new_plan: Any) -> Any:
        """The final plan: the tensors the writer asks for, in its order (``fill_in_order``)."""
        plan = super().finish_plan(new_plan)
        self.fill_in_order([i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO])
        return plan

    def fill_in_order(self, fqns: list[str]) -> None:
        """What the save writes of ``fqns`` (its final plan's tensors, in the order the writer asks for them; the
        others are written as they are): filled from now, or, for a save that fits the budget whole and is filled
        since its plan began, all the writer will ask for."""
        if self._fills is not None:
            self._fills.written(fqns)
            return
        self._start_fills([self._to_fill[fqn] for fqn in fqns if fqn in self._to_fill])

    def _start_fills(self, order: list[Fill]) -> None:
        """Fill ``order`` from now (``step()`` waits for the fills), into the buffers kept from the last save when
        they fit the budget whole (``FillMemory.fills``)."""
        self._fills = self._memory.fills(order, self._early_bytes())
        self._fills.done.add_done_callback(lambda _: _complete(self._filled))
        self._fills.start()

    def for_writer_process(self, state_dict: Any) -> Any:
        """A save started by :meth:`begin` (whose budget refusal, the copies at its start and the largest tensor it
        fills, is the local plan's too) that a writer process plans and writes: the state dict's keys and what fills
        each are set up here (``set_up_planner``'s refusals, raised here), and the state dict the process is sent is
        returned: a meta tensor in place of each tensor filled here, the copy made at the save's start of each other
        (in shared memory)."""
        self.set_up_planner(state_dict)
        return sent_to_writer_process(state_dict, self._early)

    @property
    def kept_bytes(self) -> int:
        """Bytes of host buffers kept for the next save (those of the last, when it fit the budget whole; during a
        save that fills them, 0)."""
        return self._memory.kept_bytes

    def drop_kept(self) -> None:
        """Free the buffers kept for the next save (``HostBufferPool.clear``: on its thread, on the save's GPU)."""
        self._memory.drop_kept()

    def resolve_data(self, write_item: Any) -> Any:
        fqn = write_item.index.fqn
        if fqn in self._sources and self._fills is not None:
            return self.take(fqn)
        self._check_saving()
        return self._early_by_fqn.get(fqn) if fqn in self._early_by_fqn else super().resolve_data(write_item)

    def take(self, fqn: str) -> torch.Tensor:
        """The filled host tensor of ``fqn`` once filled, the writer's previous one given back (it asks for its next
        tensor once it has written the previous one)."""
        return self._started_fills(fqn).take(fqn)

    def take_ready(self, fqn: str) -> dict[str, torch.Tensor]:
        """:meth:`take` for a writer process: ``fqn``'s tensor and, in a save that fits the budget whole, every other
        one of the plan filled already and not yet handed (``SaveFills.take_ready``), by their keys."""
        return self._started_fills(fqn).take_ready(fqn)

    def _started_fills(self, fqn: str) -> SaveFills:
        self._check_saving()
        if self._fills is None:
            raise BudgetRefused(f"{_NAME}: {fqn} asked for before the save's plan was final")
        return self._fills

    def _check_saving(self) -> None:
        if self._refused is not None:  # the save's start refused it (begin): that line, not a misuse
            raise BudgetRefused(self._refused)
        if not self._saving:
            raise BudgetRefused(f"{_NAME}: save with planner.save(...), which builds the writer it needs")


def _complete(future: Future | None) -> None:
    if future is not None:
        with contextlib.suppress(InvalidStateError):
            future.set_result(None)


def _steps(optimizer: Any) -> list[Any]:
    """Each parameter group's step count (a tensor's value), to tell whether the optimizer stepped."""
    return [
        float(g["step"]) if isinstance(g.get("step"), torch.Tensor) else g.get("step") for g in optimizer.param_groups
    ]
