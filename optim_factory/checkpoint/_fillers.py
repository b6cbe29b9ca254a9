"""Where a save through ``AsyncSaveStager`` gets the host tensors DCP's writer reads: the stager's one filler, chosen
once for its optimizers (:func:`filler_for`), behind one interface (docs/design.md, "The async-save stager"):

* :class:`CopyAtStart`: every tensor copied when the save starts, into host buffers kept from save to save
  (``HostCopies``); the export's pooled buffers are passed through uncopied;
* :class:`FillAsWritten`: within the optimizer's ``state_dict_offload_host_budget``, each tensor filled as the
  writer reaches it (``BudgetSavePlanner``, whose planner and writer the save then uses);
* :class:`FillForWriterProcess`: the same for a writer process (``StagerOptions(write_in_process=True)``), which
  asks this process for each tensor (``_remote_fills.py``), filled into shared memory.

A save goes: :meth:`exporting` around its export, :meth:`save_kwargs` on ``dcp.async_save``'s arguments where the
stager starts the save itself, :meth:`begin` when DCP stages it (with :meth:`finite_check`, the NaN/inf check of
what it holds, where the stager refuses non-finite saves), :meth:`for_writer_process` where a writer process writes
it, :meth:`end` once it is written or failed.
``save_bytes`` is what that save held on the host at its peak (within a budget, known at its end).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import torch

from optim_factory.checkpoint._budget import BudgetSavePlanner
from optim_factory.checkpoint._budget_rule import BudgetRefused, host_budget
from optim_factory.checkpoint._finite_check import FiniteCheck
from optim_factory.checkpoint._host_copies import HostCopies
from optim_factory.checkpoint._remote_fills import FillAsk, RemoteFills
from optim_factory.optimizers.export import local_tensor
from optim_factory.tree import host_storages, leaves

__all__ = ["CopyAtStart", "FillAsWritten", "FillForWriterProcess", "filler_for"]

Begun = tuple[Any, Callable[[], None], "Future | None"]  # (the staged dict, wait for its copies, its fills)
ExportedBy = Callable[[torch.Tensor], "torch.optim.Optimizer | None"]  # the optimizer a pooled export buffer is of
Asks = Callable[[FillAsk], Any]  # a writer process's asks answered (FillForWriterProcess.serve)


class CopyAtStart:
    """Every tensor of a save copied when it starts (CUDA ones into pinned buffers kept for the next save), but
    those ``keep`` passes through (the export's pooled buffers, given back once written)."""

    budget_peak_bytes = None  # no budget

    def __init__(self, pinned: bool, optimizers: list[Any], shared: bool = False) -> None:
        self._copies = HostCopies(pinned=pinned, shared=shared)
        self.save_bytes: int | None = None
        # the training's own tensors (not held for a save): the optimizers' parameters and states
        self._live = [[p for g in opt.param_groups for p in g["params"]] + [opt.state] for opt in optimizers]

    def exporting(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def save_kwargs(self, dcp_kwargs: dict[str, Any]) -> dict[str, Any]:
        return dcp_kwargs

    def begin(self, state_dict: Any, keep: Callable[[torch.Tensor], bool], own_save: bool, here: bool = True) -> Begun:
        """``keep``: the tensors passed through (for a writer process, ``here`` false: those it reads where they
        are)."""
        self.save_bytes = None
        staged, copied = self._copies.copy(state_dict, keep=keep)
        # held until written: its copies and the export's buffers (staged; the training's own tensors, passed through
        # to a waited save, are not held for it), and the caller's other host tensors (an export into fresh host
        # memory, copied again, is held too)
        live, copies = host_storages(self._live), host_storages(staged)
        held = sum(n for ptr, n in copies.items() if ptr not in live)
        others = host_storages(state_dict)
        self.save_bytes = held + sum(n for ptr, n in others.items() if ptr not in live and ptr not in copies)
        return staged, copied, None

    def finite_check(
        self, state_dict: Any, staged: Any, exported_by: ExportedBy, streams: dict, host_here: bool = True
    ) -> FiniteCheck:
        """Every tensor the save writes, read where it lives (a pooled export through its optimizer's states); the
        host's tensors by the writer process where not ``host_here``."""
        return FiniteCheck(state_dict, staged, exported_by, streams, host_here)

    def for_writer_process(self, dcp_kwargs: dict[str, Any]) -> tuple[dict[str, Any], Asks | None]:
        """The save's arguments as its writer process gets them, and what answers that process's asks (None: it asks
        nothing; the copies are in shared memory)."""
        return dcp_kwargs, None

    def end(self) -> None:
        """Nothing to give back: the copies' buffers are kept for the next save."""

    @property
    def kept_bytes(self) -> int:
        return self._copies.nbytes()

    def close(self) -> None:
        self._copies.close()


class FillAsWritten:
    """A save within the host budget of the planner's optimizer: nothing is copied when it starts but what
    ``step()`` would not change; each tensor is filled as DCP's writer asks for it."""

    def __init__(self, planner: BudgetSavePlanner) -> None:
        self._planner = planner
        self.save_bytes: int | None = None

    def exporting(self) -> AbstractContextManager[None]:
        return self._planner.exporting()  # the streamed states as placeholders

    def save_kwargs(self, dcp_kwargs: dict[str, Any]) -> dict[str, Any]:
        return self._planner.async_save_kwargs(dcp_kwargs)  # its planner, and a writer in the order it fills

    def begin(self, state_dict: Any, keep: Callable[[torch.Tensor], bool], own_save: bool, here: bool = True) -> Begun:
        """``own_save``: the stager started the save (:meth:`save_kwargs` built or checked its writer)."""
        self.save_bytes = None
        return state_dict, lambda: None, self._planner.begin(state_dict, writer_checked=own_save)

    def finite_check(
        self, state_dict: Any, staged: Any, exported_by: ExportedBy, streams: dict, host_here: bool = True
    ) -> FiniteCheck:
        """What the save is filled from, which ``step()`` does not change before the fills are done: the state
        dict's tensors but the streamed states' placeholders, and the optimizer's live states in their place
        (the export copies them, widened, as ``step()`` reads them: a NaN or inf in one is one in the other)."""
        sources = {
            ".".join(map(str, path)): t
            for path, t in leaves(state_dict)
            if isinstance(t, torch.Tensor) and not local_tensor(t).is_meta
        }
        for i, states in enumerate(self._planner.optimizer.state.values()):  # named as a refusal names them
            sources.update({f"optimizer.state[{i}].{k}": t for k, t in states.items() if isinstance(t, torch.Tensor)})
        return FiniteCheck(sources, sources, lambda _: None, streams, host_here)

    def end(self) -> None:
        self._planner.end()
        self.save_bytes = self._planner.last_save_bytes

    @property
    def budget_peak_bytes(self) -> int:
        return self._planner.peak_bytes  # the most a save held at once

    @property
    def kept_bytes(self) -> int:
        return self._planner.kept_bytes

    def close(self) -> None:
        self._planner.drop_kept()


class FillForWriterProcess(FillAsWritten):
    """:class:`FillAsWritten` for a stager whose saves a writer process writes: a save handed to it is planned here
    (its refusals), then sent with a meta tensor in place of each tensor filled here; the process asks for them
    (:meth:`serve`), filled into shared memory. The finite check reads what the save is filled from here, in the
    training process (only it has the live states). A waited save, written here, is filled as on a writer thread,
    into the same shared memory."""

    def begin(self, state_dict: Any, keep: Callable[[torch.Tensor], bool], own_save: bool, here: bool = True) -> Begun:
        staging = super().begin(state_dict, keep, own_save)
        return staging if here else (self._planner.for_writer_process(state_dict), *staging[1:])

    def for_writer_process(self, dcp_kwargs: dict[str, Any]) -> tuple[dict[str, Any], Asks | None]:
        """The writer process plans with :class:`RemoteFills`, which asks :meth:`serve` for the fills."""
        return {**dcp_kwargs, "planner": RemoteFills()}, self.serve

    def serve(self, ask: FillAsk) -> Any:
        """The answer to the writer process's ask: its plan's tensors, in its order (``fill_in_order``: the fills
        start in it, or, filled since the save's start, the writer is handed only these), or the filled tensor asked
        for with the others of the plan that are ready (``BudgetSavePlanner.take_ready``)."""
        if ask.kind == "order":
            return self._planner.fill_in_order(ask.arg)
        return self._planner.take_ready(ask.arg)

    def finite_check(
        self, state_dict: Any, staged: Any, exported_by: ExportedBy, streams: dict, host_here: bool = True
    ) -> FiniteCheck:
        return super().finite_check(state_dict, staged, exported_by, streams, host_here=True)


def filler_for(optimizers: Iterable[Any], pinned: bool, shared: bool = False) -> CopyAtStart | FillAsWritten:
    """:class:`FillAsWritten` for the one optimizer with a host budget (several are refused in one line;
    :class:`FillForWriterProcess` where ``shared``), else :class:`CopyAtStart` (``shared``: its copies in shared
    memory, for a writer process)."""
    optimizers = list(optimizers)
    budgeted = [opt for opt in optimizers if host_budget(opt) is not None]
    if len(budgeted) > 1:
        raise BudgetRefused(
            f"state_dict_offload_host_budget: AsyncSaveStager saves one optimizer within a budget, not {len(budgeted)}"
        )
    if not budgeted:
        return CopyAtStart(pinned, optimizers, shared)
    planner = BudgetSavePlanner(budgeted[0], copy_host_tensors=True, shared=shared)  # host tensors filled too
    return FillForWriterProcess(planner) if shared else FillAsWritten(planner)
