"""The waits of a save through ``AsyncSaveStager`` for its optimizers' background exports
(``state_dict_offload_background``): each failure, or an export that does not fill in time, is this rank's refusal
of the save in one line, so that every rank refuses it (the stager's agreement) instead of one rank raising."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from optim_factory.checkpoint._record import StagedSave
from optim_factory.errors import first_line

__all__ = ["EXPORT_FAILED_LINE", "ExportNotFilled", "ExportWaits"]

EXPORT_FAILED_LINE = "the optimizer's background export failed"
"""The start of a refusal whose cause is an export's failure."""


class ExportNotFilled(RuntimeError):
    """A background export failed or did not fill in time; the message is the save's refusal line."""


class ExportWaits:
    """The background exports of ``optimizers`` (ours), each waited for at most ``timeout_s`` seconds.

    ``background``: (optimizer, whether its export is into pooled buffers) of each with a background export;
    ``filled_at``: ``time.perf_counter()`` when the last save's pending export was filled, None where none was
    pending when it was staged (reset by :meth:`begin`)."""

    def __init__(self, optimizers: list[Any], timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self.background = [(opt, opt.export_options.defers) for opt in optimizers if opt.export_options.background]
        self.filled_at: float | None = None
        self._pending: list[Any] = []  # the optimizers whose export was pending when the last save was staged

    def begin(self, save: StagedSave, fill_fresh: bool) -> None:
        """A save is staged: its pending exports are noted, and (``fill_fresh``) one into fresh memory (deferred by
        the stager's ``exporting()``) is waited for before the save copies it; its failure, or its not filling in
        time (its buffers then stay with it: ``save.stuck``), is raised in one line."""
        self.filled_at, self._pending = None, [opt for opt, _ in self.background if opt.state_dict_pending]
        fresh = [opt for opt, pooled in self.background if fill_fresh and not pooled and opt in self._pending]
        line = self._first_failure(save, fresh)
        if line is not None:
            raise ExportNotFilled(line)

    def failure(self, save: StagedSave) -> str | None:
        """Wait for every background export of ``save``: the first failure in one line, or None. An export that
        did not fill in time marks ``save`` stuck: its pooled buffers stay with its optimizer."""
        return self._first_failure(save, [opt for opt, _ in self.background])

    def _first_failure(self, save: StagedSave, optimizers: list[Any]) -> str | None:
        for opt in optimizers:
            failure = self.wait(opt)
            if failure is not None:
                line, save.stuck = failure
                return line
        return None

    def wait(self, opt: Any) -> tuple[str, bool] | None:
        """None once ``opt``'s export is filled; else (its failure in one line, whether it is still unfilled)."""
        try:
            opt.wait_state_dict(self._timeout_s)
        except concurrent.futures.TimeoutError:
            return f"the optimizer's background export did not fill within {self._timeout_s:g} s", True
        except Exception as exc:  # noqa: BLE001  (any failure of the export thread refuses the save)
            return f"{EXPORT_FAILED_LINE}: {first_line(exc, named=True)}", False
        if opt in self._pending:
            self.filled_at = time.perf_counter()
        return None
