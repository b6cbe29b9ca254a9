"""A save within a host budget written by a writer process (``StagerOptions(write_in_process=True)``; docs/design.md,
"The writer process"): the fills stay in the training process, which has the optimizer, its exporter and the GPU;
the writer process plans the save and asks for each tensor as its writer reaches it.

The training process sets the save up first (``BudgetSavePlanner.for_writer_process``: its refusals before anything
is handed over) and sends :func:`sent_to_writer_process`'s state dict: a meta tensor in place of each tensor it fills.
In the writer process :class:`RemoteFills`, DCP's default planner, asks over the pipe the process was handed its save
on (a :class:`FillAsk`, answered before the process reads on): for the fills in its final plan's order (a save that
fits the budget whole is filled from the training process's ``set_up_planner`` on: the order names what the writer
will ask for), then for each meta tensor as DCP's writer resolves it that it was not given yet. The answer is the
filled tensor in shared memory, its storage sent by its descriptor (``_shared_send.py``), with, in a save that fits
the budget whole, every other one of the plan filled by then and not yet handed (one message each way for all of
them; kept here until the writer reaches each, in whatever order); otherwise the training process gives each
back once the writer asks for the next one, as on a writer thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from optim_factory.checkpoint._shared_send import recv_with_fds, send_answer
from optim_factory.optimizers.export import local_tensor, wrap_host_local
from optim_factory.tree import map_leaves

__all__ = ["FillAsk", "RemoteFills", "sent_to_writer_process"]


@dataclass(frozen=True)
class FillAsk:
    """The writer process's question to the training process during a save: ``kind`` ``"order"`` (``arg``: the final
    plan's tensor keys, in the order the writer asks for them) or ``"take"`` (``arg``: the key of the tensor the
    writer writes next). The answer: None, the filled host tensors by their keys (the one asked for first), or the
    exception that refuses the save."""

    kind: str
    arg: Any


def sent_to_writer_process(state_dict: Any, early: dict[int, torch.Tensor]) -> Any:
    """``state_dict`` as a writer process is sent it: each tensor a meta tensor of its layout (a DTensor's local one;
    filled as the process asks), but those copied at the save's start (``early``: by the id of their local tensor),
    which are sent as those copies (in shared memory)."""

    def one(path: tuple, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        local = local_tensor(leaf)
        sent = early.get(id(local))
        if sent is None:
            if local.is_meta:
                return leaf  # a placeholder already
            sent = torch.empty_like(local.detach(), device="meta")
        return wrap_host_local(sent, leaf) if isinstance(leaf, DTensor) else sent

    return map_leaves(one, state_dict)


class RemoteFills(DefaultSavePlanner):
    """The writer process's planner of a save within a host budget: DCP's default planner whose meta tensors are
    asked of the training process (:class:`FillAsk`) over ``connection`` (:meth:`connect`, by the writer process)."""

    def __init__(self) -> None:
        super().__init__()
        self._connection: Any = None
        self._given: dict[str, torch.Tensor] = {}  # filled tensors answered ahead of the writer's asks

    def connect(self, connection: Any) -> None:
        """The pipe to the training process (the one the save came on)."""
        self._connection = connection

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        self._ask("order", [i.index.fqn for i in plan.items if self._filled(i)])
        return plan

    def resolve_data(self, write_item: Any) -> Any:
        if self._filled(write_item):
            fqn = write_item.index.fqn
            if fqn not in self._given:  # kept buffers handed ahead are taken in any order
                self._given.update(self._ask("take", fqn))
            return self._given.pop(fqn)
        return super().resolve_data(write_item)

    def _filled(self, write_item: Any) -> bool:
        if write_item.type == WriteItemType.BYTE_IO:
            return False
        value = self.state_dict[write_item.index.fqn]
        return isinstance(value, torch.Tensor) and local_tensor(value).is_meta

    def _ask(self, kind: str, arg: Any) -> Any:
        if self._connection is None:
            raise RuntimeError("RemoteFills: plans a save within a host budget in a writer process only")
        send_answer(self._connection, FillAsk(kind, arg))
        answer = recv_with_fds(self._connection)  # a filled tensor's storage by its descriptor
        if isinstance(answer, BaseException):
            raise answer
        return answer
