"""The deferred export of async saves, for any ``torch.optim.Optimizer``: for optim-factory's classes each function
does what its name says, for another optimizer what DCP does without it (nothing, or ``None``), so a checkpointer
calls them without asking which optimizer it holds (docs/export.md, "Checkpointing from a framework")."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from optim_factory.optimizers.export import OffloadedStateDict


def defers_export(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a ``state_dict()`` inside :func:`deferred_export` returns before its host tensors are filled, into
    pooled buffers that nothing else writes until :func:`release_export` (``state_dict_offload_background`` with
    ``state_dict_offload_reuse_buffers``): a stager may pass those through uncopied once :func:`export_failure`
    has returned. From the options alone, so every rank of a job answers the same."""
    return isinstance(optimizer, OffloadedStateDict) and optimizer.export_options.defers


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
