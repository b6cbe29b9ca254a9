"""The least host budget of a save within ``state_dict_offload_host_budget`` (``_budget.py``): the rule
its planner refuses a save by at the save's start, and that a trainer checks before its first step (the recipe:
``CheckpointManager.check_first_save``). One source for both."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from optim_factory.errors import ConfigError
from optim_factory.optimizers.export import local_tensor
from optim_factory.rules.export import size_text
from optim_factory.tree import leaves

__all__ = ["BudgetRefused", "LeastBudget", "least_host_budget", "start_copies"]


class BudgetRefused(ConfigError):
    """A save within ``state_dict_offload_host_budget`` refused, in one line: a budget below what the save needs, a
    writer or a use the budget cannot serve. Its type, not its words, tells a caller (and ``one_line_refusal``, which
    finds it among DCP's gathered failures) that the budget refused; a ``ConfigError`` (a ``ValueError``), keyed
    where one value is refused, so that ``ConfigError.under`` names the config's override."""


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
