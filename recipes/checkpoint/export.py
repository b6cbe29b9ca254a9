"""The export of a save (recipes/checkpoint/save.py): the optimizer's state dict through
``get_optimizer_state_dict`` (``flatten_optimizer_state_dict`` configurable), timed and, on CUDA, its GPU peak above
the pre-export level, then the model's. A background export (``optim.state_dict_offload_background``) is waited for
within that time, unless the save defers it (:func:`defers`; docs/design.md, "The background export")."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from optim_factory.checkpoint import deferred_export, defers_export, export_failure
from optim_factory.errors import first_line

STAGER_FUTURES = hasattr(dcp.state_dict_saver, "AsyncSaveResponse")  # async_save accepts a stager's Future


def export_failure_line(optimizer: Any) -> str | None:
    """Wait for a background export (``state_dict_offload_background``); its failure in one line, or None."""
    failure = export_failure(optimizer)
    return None if failure is None else first_line(failure, named=True)


def defers(optimizer: Any, *, async_save: bool, waits_before_step: bool) -> bool:
    """Whether the save of the export just started may return before the export is filled: an async save of
    a background export into pooled buffers (``optim.state_dict_offload_background`` with
    ``state_dict_offload_reuse_buffers``), for a caller that calls ``wait_export`` before ``step()``
    (``waits_before_step``). The stager then passes those buffers through uncopied, so nothing
    reads them before the export has filled them; without reuse the export's fresh host tensors would be
    copied at staging, so the save waits for the export as a synchronous one does."""
    # From the options alone, never from this rank's export (a rank with nothing to stream has none pending):
    # every rank must take the same path, whose collectives differ. DCP takes a stager's Future from torch 2.9.
    return waits_before_step and async_save and STAGER_FUTURES and defers_export(optimizer)


def timed_export(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    options: StateDictOptions,
    deferred: bool,
) -> tuple[dict, dict, float, float | None, str | None]:
    """Export model and optimizer: (model sd, optimizer sd, export seconds, GPU peak MiB, the failure of a
    background export in one line or None). A background export is waited for here, so its time and GPU peak
    are counted and the state dicts are final, unless ``deferred`` (:func:`defers`): then the seconds and the
    peak are those of the export call, which returns before the export is filled."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        if not deferred:  # the export's own seconds; a deferred save returns at once and never waits here
            torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    # a background export returns unfilled here: waited for below (its failure recorded, not raised) or, deferred,
    # before the next step() (wait_export) and by the save's completion in the background
    with deferred_export(optimizer):
        osd = get_optimizer_state_dict(model, optimizer, options=options)
    export_error = None if deferred else export_failure_line(optimizer)
    if on_cuda and not deferred:
        torch.cuda.synchronize(device)
    export_s = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if on_cuda else None
    msd = get_model_state_dict(model, options=options)
    return msd, osd, export_s, peak, export_error
