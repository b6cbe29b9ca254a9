"""Exact loads through DCP: :class:`ExactLoadPlanner` reads every optimizer state in the dtype it was saved in (a
:class:`~optim_factory.checkpoint.SafeLoadPlanner`: items read as data), so that the optimizer's ``load_state_dict``
converts a changed format exactly; :func:`prepare_load` and :func:`finish_load` around a load (docs/export.md,
"Loading another format")."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from optim_factory.checkpoint._safe_read import SafeLoadPlanner, container_at
from optim_factory.optimizers.export import MASTER, OffloadedStateDict, local_tensor, wrap_host_local

STATE_NAMES = ("exp_avg", "exp_avg_sq", MASTER)
"""The state names whose saved dtype :class:`ExactLoadPlanner` keeps (FusedAdam's; torch's Adam and AdamW use the
first two, and convert any dtype on load)."""


def _is_state(fqn: str) -> bool:
    """``<...>.state.<parameter>.<name>``: a state of an optimizer state dict, flattened by DCP."""
    parts = fqn.split(".")
    return parts[-1] in STATE_NAMES and "state" in parts[:-2]


class ExactLoadPlanner(SafeLoadPlanner):
    """:class:`SafeLoadPlanner` (DCP's ``DefaultLoadPlanner`` reading items as data), except that an optimizer
    state saved in another dtype than the template's is
    read as saved, into a new template tensor of the saved dtype put in its place, and a ``master_param`` the
    checkpoint lacks (saved without master weights) is left out of the read. The optimizer's ``load_state_dict``
    then sees what the checkpoint holds and converts it exactly
    (:mod:`optim_factory.optimizers.export.formats`); our classes make the master from the loaded parameter.
    Any other key the checkpoint lacks is refused by DCP as without this planner.

    ``dcp.load({"optim": osd}, checkpoint_id=path, planner=ExactLoadPlanner())`` with ``osd`` from
    ``get_optimizer_state_dict``: ``osd`` then holds the saved dtypes (the same dictionary object: pass it on to
    ``set_optimizer_state_dict``); with ``storage_reader=SafeFileSystemReader(path)`` nothing of the checkpoint
    runs as code. The arguments are ``DefaultLoadPlanner``'s.
    """

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        saved = metadata.state_dict_metadata
        for fqn, value in list(self.state_dict.items()):
            if type(value) not in (torch.Tensor, torch.nn.Parameter, DTensor) or not _is_state(fqn):
                continue  # (a ShardedTensor template is DCP's to read, as without this planner)
            meta = saved.get(fqn)
            if meta is None and fqn.endswith("." + MASTER):
                self._drop(fqn)
            elif isinstance(meta, TensorStorageMetadata) and meta.properties.dtype != value.dtype:
                self._replace(fqn, _empty_as(value, meta.properties.dtype))

    def _replace(self, fqn: str, tensor: torch.Tensor) -> None:
        self.state_dict[fqn] = tensor
        *above, last = self._path(fqn)  # the caller's dictionary holds what DCP reads
        container_at(self.original_state_dict, above)[last] = tensor

    def _drop(self, fqn: str) -> None:
        del self.state_dict[fqn]
        *above, last = self._path(fqn)
        self.mappings.pop(fqn, None)
        del container_at(self.original_state_dict, above)[last]

    def _path(self, fqn: str) -> tuple:
        """Where ``fqn`` is in the caller's dictionary (a flat one's key is the path itself)."""
        return tuple(self.mappings[fqn]) if self.flatten_state_dict else (fqn,)


def _empty_as(template: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor laid out as ``template`` (a DTensor's spec kept, its device kept) with ``dtype``."""
    local = torch.empty(local_tensor(template).shape, dtype=dtype, device=local_tensor(template).device)
    return wrap_host_local(local, template) if isinstance(template, DTensor) else local


def prepare_load(optimizer: torch.optim.Optimizer) -> None:
    """Call before building the template a checkpoint is read into (``get_state_dict`` ...): our classes create
    their states and a ``step`` of 0 without a gradient (``initialize_states()``), so DCP's template skips its
    step on zero gradients, which allocates a gradient for every parameter. Other optimizers: nothing."""
    if isinstance(optimizer, OffloadedStateDict):
        optimizer.initialize_states()


def finish_load(optimizer: torch.optim.Optimizer) -> None:
    """Call once the model is loaded too, to read ``optimizer.state`` directly: our classes convert a load's
    masters that depend on the parameters from the loaded parameters (``settle_masters()``), which they do
    themselves before their next ``step()`` or ``state_dict()`` anyway. Other optimizers: nothing."""
    if isinstance(optimizer, OffloadedStateDict):
        optimizer.settle_masters()
