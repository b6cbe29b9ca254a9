"""The rules of a save within ``state_dict_offload_host_budget`` (``_budget.py``; an optimizer's budget:
:func:`host_budget`), and its refusals
(:class:`BudgetRefused`): the least host budget, which its planner refuses a save by at the save's start and which a
trainer checks before its first step (the recipe: ``CheckpointManager.check_first_save``), one source for both; the
writer such a save writes through (:func:`refuse_writer`); a refusal that DCP wrapped, as its one line
(:func:`one_line_refusal`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from optim_factory.errors import ConfigError
from optim_factory.optimizers.export import local_tensor
from optim_factory.rules.export import size_text
from optim_factory.tree import leaves

__all__ = [
    "BudgetRefused",
    "LeastBudget",
    "host_budget",
    "least_host_budget",
    "start_copies",
    "refuse_writer",
    "one_line_refusal",
]


class BudgetRefused(ConfigError):
    """A save within ``state_dict_offload_host_budget`` refused, in one line: a budget below what the save needs, a
    writer or a use the budget cannot serve. Its type, not its words, tells a caller (and ``one_line_refusal``, which
    finds it among DCP's gathered failures) that the budget refused; a ``ConfigError`` (a ``ValueError``), keyed
    where one value is refused, so that ``ConfigError.under`` names the config's override."""


def host_budget(optimizer: Any) -> int | None:
    """An optimizer's ``state_dict_offload_host_budget`` in bytes (None: none, or not one of ours)."""
    return getattr(getattr(optimizer, "export_options", None), "host_budget", None)


@dataclasses.dataclass(frozen=True)
class LeastBudget:
    """What a save within a host budget holds at its peak, at the least (:func:`least_host_budget`): ``early``
    bytes of the copies it makes at its start, held until it ends, and the ``largest`` tensor it fills, held while
    it is written."""

    early: int
    largest: int

    @property
    def nbytes(self) -> int:
        """The least ``state_dict_offload_host_budget`` of the save."""
        return self.early + self.largest

    def refusal(self, limit: int) -> BudgetRefused | None:
        """The one-line refusal of a budget of ``limit`` bytes below :attr:`nbytes` (its key
        ``state_dict_offload_host_budget``: ``ConfigError.under`` names the override), or None."""
        if self.nbytes <= limit:
            return None
        return BudgetRefused(
            "state_dict_offload_host_budget",
            limit,
            f"the tensors the optimizer's step() does not change (buffers, other states), copied when the save "
            f"starts, take {self.early} bytes, and the largest tensor it fills {self.largest}: a budget of at least "
            f"{size_text(self.nbytes)} ({self.nbytes} bytes)",
        )


def least_host_budget(optimizer: Any, state_dict: Any) -> LeastBudget:
    """The least host budget of a save of ``state_dict`` within ``optimizer``'s ``state_dict_offload_host_budget``
    through ``AsyncSaveStager`` (sync or async: host tensors filled too), the optimizer's export made inside its
    ``exporting()`` (a placeholder per streamed state, no memory). The rule every such save is refused by at its
    start (``BudgetSavePlanner.begin``), for a caller that checks it before training (the recipe)."""
    return start_copies(optimizer, state_dict)[1]


def start_copies(optimizer: Any, state_dict: Any) -> tuple[dict[int, torch.Tensor], LeastBudget]:
    """(the copies a save of ``state_dict`` makes at its start, by the identity of the local tensor (a DTensor's
    ``_local_tensor``: the object the planner finds again), its :class:`LeastBudget`). Copied at the start: the
    tensors the optimizer's ``step()`` does not change (a buffer, the next forward may change; another optimizer's
    state; a trainer's tensor); every other one (the optimizer's parameters, the placeholders of its states) is
    filled as it is written, and ``step()`` waits for those fills."""
    params = optimizer.param_groups
    stepped = {local_tensor(p).untyped_storage().data_ptr() for g in params for p in g["params"]}
    tensors = {id(t): t for t in (local_tensor(v) for _, v in leaves(state_dict) if isinstance(v, torch.Tensor))}
    early = {key: t for key, t in tensors.items() if not t.is_meta and t.untyped_storage().data_ptr() not in stepped}
    filled = (t.numel() * t.element_size() for key, t in tensors.items() if key not in early)
    least = LeastBudget(sum(t.numel() * t.element_size() for t in early.values()), max(filled, default=0))
    return early, least


def refuse_writer(writer: Any) -> None:
    """A :class:`BudgetRefused` unless ``writer`` asks for the plan's tensors in its order, one after the other: DCP's
    ``FileSystemWriter`` (or a subclass) with one thread, one file and no copy-ahead (whose loader asks ahead)."""
    if not (
        isinstance(writer, FileSystemWriter)
        and writer.per_thread_copy_ahead == 0
        and writer.single_file_per_rank
        and writer.thread_count == 1
    ):
        raise BudgetRefused(
            "BudgetSavePlanner: a save within the budget writes through DCP's "
            f"FileSystemWriter(..., per_thread_copy_ahead=0) with one thread and one file; got {writer!r}"
        )


def one_line_refusal(exc: CheckpointException) -> BaseException:
    """A budget's refusal that DCP wrapped in its multi-line ``CheckpointException``, as the one-line
    :class:`BudgetRefused`; any other failure as it is."""
    causes = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]  # (exception, traceback)
    refusal = next((c for c in causes if isinstance(c, BudgetRefused)), None)
    return exc if refusal is None else BudgetRefused(str(refusal))
