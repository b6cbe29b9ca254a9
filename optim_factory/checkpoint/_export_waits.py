"""The waits of a save through ``AsyncSaveStager`` for its optimizers' background exports
(``state_dict_offload_background``): each failure, or an export that does not fill in time, is this rank's refusal
of the save in one line, so that every rank refuses it (the stager's agreement) instead of one rank raising."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from optim_factory.checkpoint._record import StagedSave
from optim_factory.errors import first_line

__all__ = ["EXPORT_FAILED_LINE", "ExportNotFilled", "ExportWaits"]

EXPORT_FAILED_LINE = "the optimizer's background export failed"
"""The start of a refusal whose cause is an export's failure (the recipe words its own refusals so too)."""


class ExportNotFilled(RuntimeError):
    """A background export failed or did not fill in time; the message is the save's refusal line."""


class ExportWaits:
    """The background exports of ``optimizers`` (ours), each waited for at most ``timeout_s`` seconds."""

    def __init__(self, optimizers: list[Any], timeout_s: float) -> None:
        self._optimizers, self._timeout_s = optimizers, timeout_s
        self._fresh = [opt for opt in optimizers if opt.export_options.background and not opt.export_options.defers]

    def fill_fresh(self) -> None:
        """Wait for a background export into fresh memory (deferred by the stager's ``exporting()``) before the
        save copies it; raise its failure, or its not filling in time, in one line (its buffers are fresh: nothing
        is given back)."""
        for opt in self._fresh:
            if opt.state_dict_pending:
                failure = self._wait(opt)
                if failure is not None:
                    raise ExportNotFilled(failure[0])

    def failure(self, save: StagedSave) -> str | None:
        """Wait for every background export of ``save``: the first failure in one line, or None. An export that
        did not fill in time marks ``save`` stuck: its pooled buffers stay with its optimizer."""
        for opt in self._optimizers:
            failure = self._wait(opt)
            if failure is not None:
                line, save.stuck = failure
                return line
        return None

    def _wait(self, opt: Any) -> tuple[str, bool] | None:
        """None once ``opt``'s export is filled; else (its failure in one line, whether it is still unfilled)."""
        try:
            opt.wait_state_dict(self._timeout_s)
        except concurrent.futures.TimeoutError:
            return f"the optimizer's background export did not fill within {self._timeout_s:g} s", True
        except Exception as exc:  # noqa: BLE001  (any failure of the export thread refuses the save)
            return f"{EXPORT_FAILED_LINE}: {first_line(exc, named=True)}", False
        return None
