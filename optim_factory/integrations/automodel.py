"""NeMo Automodel 0.7 integration: its ``Checkpointer``, loading the optimizer through
:class:`optim_factory.checkpoint.ExactLoadPlanner` and saving asynchronously through
:class:`optim_factory.checkpoint.AsyncSaveStager`.

Automodel's ``Checkpointer.load_optimizer`` reads ``<weights_path>/optim`` with DCP's default planner, which copies
each saved tensor into the template's dtype: a checkpoint saved with int16 remainders and resumed with an FP32
master (or the reverse) hands the optimizer cast bytes, which its load refuses. This ``Checkpointer`` is
Automodel's with that read made exact::

    from optim_factory.integrations.automodel import Checkpointer

    checkpointer = Checkpointer(config, dp_rank, tp_rank, pp_rank)  # Automodel's arguments, unchanged
    checkpointer.load_optimizer(optimizer, model, weights_path)

With ``checkpoint.is_async: true`` it saves the model and the optimizer through two ``AsyncSaveStager`` (one per
kind, as Automodel keeps a stager and a gloo group per kind; the groups are made in the constructor), kept across
saves and closed by ``close()``: Automodel 0.7 makes a fresh ``DefaultStager`` for every save, which allocates and
pins its host memory each time, and copies our optimizer's export a second time. Here the optimizer's pooled export
buffers (``state_dict_offload_reuse_buffers``) go to DCP's writer uncopied and back to the optimizer once written,
and a background export (``state_dict_offload_background``) is deferred: it fills beside the next forward and
backward, as Automodel's recipes call ``maybe_wait_for_staging()`` before the optimizer step, which waits for it.
A refused save (a failed or stuck export) raises from ``async_wait()`` in one line, nothing written. It needs no
accelerator (Automodel's stager refuses a machine without one). Its async saves write local paths (DCP's file
writer, DCP's default save planner); an ``msc://`` checkpoint directory with ``is_async`` is refused in one line.

``Checkpointer(..., write_in_process=True)`` writes the async saves in a writer process of each rank's own, one
per stager (``StagerOptions(write_in_process=True)``). An optimizer with ``state_dict_offload_host_budget`` saves
within it, async or not (a sync save through the stager, waited for): the stager fills each state as DCP's writer
reaches it (``optim_factory.checkpoint``). Everything else (other sync saves, the model's HF and PEFT formats) is
Automodel's. Importing this module imports Automodel's checkpoint package (and transformers); the rest of
optim_factory never does.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from optim_factory.checkpoint import (
    AsyncSaveStager,
    ExactLoadPlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    StagerOptions,
    host_budget,
)
from optim_factory.integrations import framework_import_error

try:
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer as AutomodelCheckpointer
    from nemo_automodel.components.checkpoint.lifecycle import CheckpointLifecycle
except ImportError as exc:
    raise framework_import_error("nemo-automodel", exc) from exc

__all__ = ["Checkpointer"]

OPTIM_DIR = "optim"
"""The folder of a checkpoint step that ``Checkpointer.load_optimizer`` reads (Automodel's layout)."""
MODEL_DIR = "model"
"""The key of the model's stager (Automodel saves the model into ``<weights_path>/model``)."""


def _gloo_group(process_group: Any) -> Any:
    """A gloo group of the ranks of ``process_group`` (all ranks for ``None``), as Automodel makes its async ones."""
    if process_group is None:
        return dist.new_group(backend="gloo")
    ranks = dist.get_process_group_ranks(process_group)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


def _refuse_remote(path: Any) -> None:
    if "://" in str(path):
        raise ValueError(
            f"checkpoint.is_async=true with {path}: optim_factory's Checkpointer saves asynchronously to local "
            "paths only; set checkpoint.is_async=false for remote storage"
        )


class Checkpointer(AutomodelCheckpointer):
    """Automodel's ``Checkpointer``; the optimizer's states are read in their saved dtypes (through the caller's
    storage reader where ``_do_load`` is given one), so that our classes convert a changed master format exactly
    (any other optimizer loads as with Automodel's), and async saves go
    through ``stagers`` (``{"model": ..., "optim": ...}``, each made at its first save; the module docstring)."""

    def __init__(self, config: Any, *args: Any, write_in_process: bool = False, **kwargs: Any) -> None:
        """Automodel's arguments; ``write_in_process=True``: the async saves written by a writer process of each
        rank's own (``StagerOptions(write_in_process=True)``, docs/export.md), with ``is_async`` only."""
        if write_in_process and not config.is_async:
            raise ValueError("Checkpointer(write_in_process=True): writes async saves; set checkpoint.is_async: true")
        self.write_in_process = write_in_process
        if config.is_async:
            _refuse_remote(config.checkpoint_dir)
        # Automodel's constructor makes its DefaultStagers for is_async: it gets a copy of the config without it
        sync = copy.copy(config)
        sync.is_async = False
        super().__init__(sync, *args, **kwargs)
        self.config = config
        self.lifecycle = CheckpointLifecycle(config=config, process_group=self.process_group)  # the one config
        self.stagers: dict[str, AsyncSaveStager] = {}
        self._budgeted = False  # the optimizers of the last save_optimizer: one has a host budget
        # the ranks of a save agree on a refusal and DCP plans on a gloo group of the kind's (made by every rank)
        self._async_groups = (
            {kind: _gloo_group(self.process_group) for kind in (MODEL_DIR, OPTIM_DIR)}
            if (config.is_async and dist.is_initialized())
            else {}
        )

    def save_optimizer(self, optimizer: Any, model: Any, weights_path: str, *args: Any, **kwargs: Any) -> None:
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self._budgeted = any(host_budget(opt) is not None for opt in optimizers)
        if not (self.config.is_async or self._budgeted):
            return super().save_optimizer(optimizer, model, weights_path, *args, **kwargs)
        stager = self._stager(OPTIM_DIR, optimizers)
        with stager.exporting():  # deferred: waited for by maybe_wait_for_staging() (and by step())
            super().save_optimizer(optimizer, model, weights_path, *args, **kwargs)

    def _do_save(self, state_dict: dict[str, Any], path: str, storage_writer=None):
        # Automodel's one DCP write, of the model and of the optimizer; its async one is replaced on local paths
        kind = OPTIM_DIR if os.path.basename(os.path.normpath(path)) == OPTIM_DIR else MODEL_DIR
        peft_model = self.config.is_peft and kind == MODEL_DIR  # rank 0 writes the adapter's safetensors
        budgeted = self._budgeted and kind == OPTIM_DIR  # a sync save within the budget: the stager's, waited for
        if not (self.config.is_async or budgeted) or peft_model:
            return super()._do_save(state_dict, path, storage_writer)
        _refuse_remote(path)
        stager, group = self._stager(kind), self._async_groups.get(kind)
        where = dict(checkpoint_id=path, storage_writer=storage_writer, process_group=group)
        if not self.config.is_async:  # as Automodel's sync save: written when it returns, nothing copied
            stager.save(state_dict, **where)
            return None
        return stager.async_save(state_dict, **where)

    def maybe_wait_for_staging(self) -> None:
        super().maybe_wait_for_staging()
        for stager in self.stagers.values():
            stager.wait_staged()

    def close(self) -> None:
        try:
            super().close()  # waits for the staging and for the saves (raising a save's failure)
        finally:
            for stager in self.stagers.values():
                stager.close()
            for group in self._async_groups.values():
                if dist.is_initialized():
                    dist.destroy_process_group(group)
            self._async_groups = {}

    def _stager(self, kind: str, optimizers: list[torch.optim.Optimizer] | None = None) -> AsyncSaveStager:
        """The kind's stager, made at its first save (or when the optimizers saved are other objects)."""
        stager = self.stagers.get(kind)
        if stager is None or (optimizers is not None and stager.optimizers != optimizers):
            if stager is not None:
                stager.close()
            options = StagerOptions(write_in_process=self.write_in_process)
            group = self._async_groups.get(kind)
            stager = self.stagers[kind] = AsyncSaveStager(optimizers or (), options, process_group=group)
        return stager

    def _get_storage_reader(self, model_path: str, *args: Any, **kwargs: Any):
        # the reader of a model's load: Automodel's for safetensors and HF bases, and for a local DCP folder, where
        # it gives None (DCP's FileSystemReader, which unpickles .metadata: also its own metadata read,
        # _get_checkpoint_metadata), ours, which reads it as data
        reader = super()._get_storage_reader(model_path, *args, **kwargs)
        return SafeFileSystemReader(model_path) if reader is None and "://" not in str(model_path) else reader

    def _do_load(self, state_dict: dict[str, Any], path: str, storage_reader=None, is_init_step: bool = False):
        # Automodel's one DCP read, for the model and the optimizer. A local DCP folder is read as data
        # (SafeFileSystemReader, SafeLoadPlanner: nothing in it runs); the optimizer's states in their saved dtypes
        # (ExactLoadPlanner), through the caller's storage reader where one is given (any path: the caller's
        # reader reads its metadata). The model's safetensors (a caller's HF reader, PEFT adapters: data already)
        # and remote folders are Automodel's.
        if storage_reader is None and "://" not in str(path):
            storage_reader = SafeFileSystemReader(path)
        optimizer = os.path.basename(os.path.normpath(path)) == OPTIM_DIR
        peft = self.config.is_peft and not is_init_step
        ours = isinstance(storage_reader, SafeFileSystemReader)
        if storage_reader is None or (not optimizer and (peft or not ours)):
            return super()._do_load(state_dict, path, storage_reader, is_init_step)
        group = getattr(self, "process_group", None)
        dcp.load(
            state_dict,
            storage_reader=storage_reader,
            planner=ExactLoadPlanner() if optimizer else SafeLoadPlanner(),
            **({"process_group": group} if group is not None else {}),
        )
        return state_dict
