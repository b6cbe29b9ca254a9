"""``StagerOptions``: what an ``AsyncSaveStager`` does besides staging, given to it whole (as ``ExportOptions`` is to
the export, and DCP's ``StagingOptions`` to its stager), checked when it is made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["DEFAULT_EXPORT_TIMEOUT_S", "FIELD_NAMES", "Check", "StagerOptions"]

DEFAULT_EXPORT_TIMEOUT_S = 600.0
"""How long a save waits for a background export to fill before refusing it (``StagerOptions.export_timeout_s``)."""

Check = Callable[[dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class StagerOptions:
    """Attributes:
    refuse_non_finite: refuse a save whose state holds NaN or inf (``NON_FINITE_LINE``), each value read where it
        lives (``_finite_check.py``); within a host budget, what the save is filled from (the optimizer's live
        states in place of the streamed ones; ``step()`` waits for the fills), in this process. With
        ``write_in_process`` (and no budget) the host's tensors are read by the writer process before it writes: the
        staging completes (and ``check`` runs) before that part, and its refusal comes with ``upload_completion``.
    check: called on the staging's completion thread with the staged state dict before DCP writes it (filled;
        within a host budget its streamed states are still meta tensors of their shape and dtype, filled as they
        are written, and with ``write_in_process`` every tensor filled for the writer process is); a returned line
        refuses the save on every rank.
    pinned: the model's host copies of CUDA tensors in pinned memory kept from save to save.
    export_timeout_s: how long a save waits for a background export to fill before refusing it.
    write_in_process: :meth:`~AsyncSaveStager.async_save` hands each staged save to a writer process of this
        rank's own (``_writer_process.py``), started at the first save and kept until ``close()``: DCP's planning
        and writing run outside the training process's interpreter, reading the staged tensors in shared memory.
        A waited save (:meth:`~AsyncSaveStager.save`) is written in this process. Within a host budget the process
        asks this one for each tensor as it writes it (filled into shared memory, within the budget). The
        ``storage_writer`` is pickled to the process; one with ``take_written(copy)`` is given the copy the process
        saved with once it is written (what it learned there: the recipe's checksums).
    """

    refuse_non_finite: bool = False
    check: Check | None = None
    pinned: bool = True
    export_timeout_s: float = DEFAULT_EXPORT_TIMEOUT_S
    write_in_process: bool = False

    def __post_init__(self) -> None:
        for name in ("refuse_non_finite", "pinned", "write_in_process"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"StagerOptions({name}=...): expected True or False, got {getattr(self, name)!r}")
        if self.check is not None and not callable(self.check):
            raise TypeError(f"StagerOptions(check=...): expected a function of the staged dict, got {self.check!r}")
        timeout = self.export_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise TypeError(f"StagerOptions(export_timeout_s=...): expected seconds > 0, got {timeout!r}")


FIELD_NAMES = frozenset(f.name for f in fields(StagerOptions))
"""The options' names: the stager's, never DCP's (``AsyncSaveStager.async_save`` refuses them)."""
