"""The checkpoint contract for frameworks: exact loads through DCP and the deferred export of async saves
(docs/export.md, "Checkpointing from a framework").

Every function takes any ``torch.optim.Optimizer``: for optim-factory's ``FusedAdam`` and ``PortableFusedAdam`` it
does what the name says, for any other optimizer what DCP does without it (nothing, or ``None``), so a checkpointer
calls them without asking which optimizer it holds.

* :class:`ExactLoadPlanner`: ``dcp.load(..., planner=ExactLoadPlanner())`` reads every optimizer state in the dtype it
  was saved in, so that the optimizer's ``load_state_dict`` converts a changed format exactly (DCP's default
  planner copies a saved tensor into the template's dtype: int16 remainders into an FP32 master become masters of
  about 3e4, an FP32 master into int16 remainders loses its low bits; TE's class trains on both, ours refuses
  them in one line: ``formats.check_not_cast``).
* :class:`SafeFileSystemReader`, :class:`SafeLoadPlanner`: a load that reads a checkpoint as data (``.metadata``
  through an allow-list of DCP's types, items through ``torch.load(weights_only=True)``, storage paths inside the
  folder); anything else is refused by :class:`UnsafeCheckpoint` before it runs (docs/reliability.md, "Trust").
* :func:`prepare_load`: the states before the template a checkpoint is read into, without a step;
  :func:`finish_load`: the masters from the loaded parameters, for a caller that reads ``optimizer.state`` at once.
* :func:`deferred_export`, :func:`defers_export`, :func:`export_failure`, :func:`export_buffer_test`,
  :func:`release_export`: an async save that overlaps the optimizer's background export with training.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from optim_factory.checkpoint._safe_read import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpoint
from optim_factory.optimizers.export.formats import MASTER
from optim_factory.optimizers.export.mixin import OffloadedStateDict
from optim_factory.optimizers.export.staging import cpus_per_rank
from optim_factory.optimizers.export.tensors import local_tensor, wrap_host_local

__all__ = [
    "ExactLoadPlanner",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpoint",
    "STATE_NAMES",
    "prepare_load",
    "finish_load",
    "deferred_export",
    "defers_export",
    "export_failure",
    "export_buffer_test",
    "release_export",
    "cpus_per_rank",
]

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
        _container(self.original_state_dict, above)[last] = tensor

    def _drop(self, fqn: str) -> None:
        del self.state_dict[fqn]
        *above, last = self._path(fqn)
        self.mappings.pop(fqn, None)
        del _container(self.original_state_dict, above)[last]

    def _path(self, fqn: str) -> tuple:
        """Where ``fqn`` is in the caller's dictionary (a flat one's key is the path itself)."""
        return tuple(self.mappings[fqn]) if self.flatten_state_dict else (fqn,)


def _container(tree: Any, path: list) -> Any:
    for key in path:
        tree = tree[key]
    return tree


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


def defers_export(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a ``state_dict()`` inside :func:`deferred_export` returns before its host tensors are filled, into
    pooled buffers that nothing else writes until :func:`release_export` (``state_dict_offload_background`` with
    ``state_dict_offload_reuse_buffers``): a stager may pass those through uncopied once :func:`export_failure`
    has returned. From the options alone, so every rank of a job answers the same."""
    return (
        isinstance(optimizer, OffloadedStateDict)
        and optimizer.state_dict_offload_background
        and optimizer.state_dict_offload_reuse_buffers
    )


@contextlib.contextmanager
def deferred_export(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``with deferred_export(opt): osd = get_optimizer_state_dict(model, opt)``: a background export started
    inside returns unfilled, so that the caller's next forward and backward overlap it. The caller then calls
    :func:`export_failure` before reading the tensors (``step()`` waits too). Anything else: no effect."""
    if not isinstance(optimizer, OffloadedStateDict):
        yield
        return
    with optimizer.deferred_state_dict():
        yield


def export_failure(optimizer: torch.optim.Optimizer, timeout: float | None = None) -> Exception | None:
    """Wait until a background export has filled its host tensors; return its failure, or ``None``. The failure
    is taken: no later wait raises it, and a dictionary whose export failed holds garbage (save nothing of it).
    Safe on a thread beside the training loop: until the export has finished, a ``step()`` waits for it, and a
    ``step()`` that waits meanwhile raises the failure too. ``timeout`` seconds without the export finishing
    raise ``concurrent.futures.TimeoutError``; the export stays pending and its buffers with it."""
    if isinstance(optimizer, OffloadedStateDict):
        try:
            optimizer.wait_state_dict(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001  (any failure of the export thread is the caller's to report)
            return exc
    return None


def export_buffer_test(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], bool] | None:
    """The test of whether a tensor is one of the optimizer's pooled export buffers not yet released (a stager
    passes those through: nothing writes them until :func:`release_export`), or ``None`` for an optimizer
    without any."""
    return optimizer.is_leased_export_buffer if isinstance(optimizer, OffloadedStateDict) else None


def release_export(optimizer: torch.optim.Optimizer, state_dict: Any) -> int:
    """Give the pooled host buffers of an exported state dict (any nesting) back for the next export, once the
    checkpoint that holds them is written; return how many. Other optimizers: 0."""
    return optimizer.release_state_dict(state_dict) if isinstance(optimizer, OffloadedStateDict) else 0
