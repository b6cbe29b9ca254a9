"""The async save's stager: host copies for DCP of everything but the optimizer's pooled export buffers, and a
deferred export's completion in the background (docs/design.md, "Checkpoints")."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from optim_factory.checkpoint import export_buffer_test, export_failure
from optim_factory.optimizers.export import all_finite
from recipes.checkpoint.host_copies import HostCopies
from recipes.checkpoint.layout import one_line
from recipes.checkpoint.tree import local_tensors

FINITE, NO_SPACE, NON_FINITE, EXPORT_FAILED = 0, 1, 2, 3  # a save's verdict before writing, agreed by all ranks
# (the worst wins)


class ExportBufferStager(AsyncStager):
    """Staging for ``dcp.async_save``: host copies of every tensor (as DCP's default stager makes), except the
    optimizer's leased export buffers, which are passed through: nothing writes them until they are released,
    which :class:`CheckpointManager` does only after this save has finished.

    Why not DCP's own stager (``DefaultStager`` / ``BlockingAsyncStager``): it copies *every* tensor into its
    own (pinned) host memory, so the pooled export buffers, already on the host and owned by this save, would be
    copied a second time (twice the host memory and a second full memcpy per checkpoint). It has no hook to
    skip some tensors, so this stager does the part of its job that is needed: host copies of the rest (the model
    state and tensors that are not pooled), into the manager's :class:`HostCopies` (pinned buffers reused across
    saves, filled on a side stream). See docs/design.md, "Checkpoints".

    ``deferred=True`` (a background export into pooled buffers, still being filled): :meth:`stage` starts the
    copies and returns a Future that completes on a thread of its own once the copies are complete, the export is
    filled (the next ``step()`` changes the model and the optimizer: the loop waits for :attr:`filled` before it)
    and the staged state checked for non-finite values. The
    Future never raises (a failure on one rank would leave the others in DCP's collectives): it records the
    outcome in :attr:`verdict` and :attr:`failure`, for the manager to agree on across ranks.
    """

    _synchronize_after_execute = False

    def __init__(self, optimizer: Any, *, deferred: bool = False, host_copies: HostCopies | None = None):
        self.optimizer = optimizer
        self.deferred = deferred
        self.host_copies = host_copies if host_copies is not None else HostCopies()
        self.filled: Future | None = None  # deferred: perf_counter() when the export was filled (never raises)
        self.verdict = FINITE  # deferred: FINITE, NON_FINITE or EXPORT_FAILED, set before the staging completes
        self.failure: str | None = None  # deferred: the export's failure in one line

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """Host copies for DCP. Not deferred: once a background export has filled its tensors (a failed export
        raises here and nothing is written). Deferred: a Future of them, see the class docstring."""
        if not self.deferred:
            failure = export_failure(self.optimizer)
            if failure is not None:
                raise failure
        staged, copied = self.host_copies.copy(state_dict, keep=export_buffer_test(self.optimizer))
        if not self.deferred:
            copied()
            return staged
        self.filled, done = Future(), Future()
        # the caller's GPU current on the thread: a new thread's is 0, and its first CUDA call (the copies'
        # event) would create a context on GPU 0 for a rank on another GPU
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        threading.Thread(
            target=self._finish, args=(staged, copied, done, device), name="checkpoint-stager", daemon=True
        ).start()
        return done

    def _finish(self, staged: dict[str, Any], copied, done: Future, device: int | None) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            copied()  # the model's copies (a side stream): the next step() changes the model too
            failure = export_failure_line(self.optimizer)  # a step() that waits meanwhile waits for the export too
            if failure is not None:
                self.failure, self.verdict = failure, EXPORT_FAILED
            self.filled.set_result(time.perf_counter())  # the loop's next step() may run from here
            if self.verdict == FINITE and not all_finite(local_tensors(staged)):
                self.verdict = NON_FINITE
        except BaseException as exc:  # noqa: BLE001  (never raise into DCP's upload thread on one rank)
            self.failure, self.verdict = one_line(exc), EXPORT_FAILED
        finally:
            if not self.filled.done():
                self.filled.set_result(time.perf_counter())
            done.set_result(staged)

    def synchronize_staging(self) -> None:
        """Staging is synchronous (or, deferred, a Future that DCP's upload thread waits for)."""

    def close(self) -> None:
        """Nothing to free."""


def export_failure_line(optimizer: Any) -> str | None:
    """Wait for a background export (``state_dict_offload_background``); its failure in one line, or None."""
    failure = export_failure(optimizer)
    return None if failure is None else one_line(failure)
