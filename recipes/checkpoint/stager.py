"""The async save's stager, DCP's ``AsyncStager`` protocol: host copies for DCP of everything but the optimizer's
pooled export buffers (docs/design.md, "Checkpoints")."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.staging import AsyncStager

from optim_factory.checkpoint import export_buffer_test, export_failure
from optim_factory.host_copies import HostCopies

# a deferred export's completion: (the staged dict, the wait for its copies) -> the Future DCP's upload waits for
Finish = Callable[[dict[str, Any], Callable[[], None]], Future]


class ExportBufferStager(AsyncStager):
    """Staging for ``dcp.async_save``: host copies of every tensor (as DCP's default stager makes), except the
    optimizer's leased export buffers, which are passed through: nothing writes them until they are released,
    which the save does only after it has finished (``optim_factory.checkpoint.release_export``).

    Why not DCP's own stager (``DefaultStager`` / ``BlockingAsyncStager``): it copies *every* tensor into its
    own (pinned) host memory, so the pooled export buffers, already on the host and owned by this save, would be
    copied a second time (twice the host memory and a second full memcpy per checkpoint). It has no hook to
    skip some tensors, so this stager does the part of its job that is needed: host copies of the rest (the model
    state and tensors that are not pooled), into the given :class:`HostCopies` (pinned buffers reused across
    saves, filled on a side stream). See docs/design.md, "Checkpoints".

    ``finish`` (a background export into pooled buffers, still being filled): :meth:`stage` starts the copies and
    returns ``finish(staged, copied)``, the Future of the save that owns the export
    (``recipes.checkpoint.save.InFlight.finish``), which completes once the copies and the export are done.
    """

    _synchronize_after_execute = False

    def __init__(self, optimizer: Any, *, host_copies: HostCopies | None = None, finish: Finish | None = None):
        self.optimizer = optimizer
        self.host_copies = host_copies if host_copies is not None else HostCopies()
        self.finish = finish

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """Host copies for DCP. Without ``finish``: once a background export has filled its tensors (a failed export
        raises here and nothing is written). With it: ``finish``'s Future of them, see the class docstring."""
        if self.finish is None:
            failure = export_failure(self.optimizer)
            if failure is not None:
                raise failure
        staged, copied = self.host_copies.copy(state_dict, keep=export_buffer_test(self.optimizer))
        if self.finish is not None:
            return self.finish(staged, copied)
        copied()
        return staged

    def synchronize_staging(self) -> None:
        """Staging is synchronous (or, with ``finish``, a Future that DCP's upload thread waits for)."""

    def close(self) -> None:
        """Nothing to free."""
