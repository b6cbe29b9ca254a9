"""An async save of the recipe's between its ``Saver.save`` call and its ``Saver.wait``: the record the saver keeps
of it (its writer, the stager's completions, its report and the time it has held the loop)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.checkpoint.checksums import ChecksumFileSystemWriter
from recipes.checkpoint.report import ExportReport


@dataclass
class InFlight:
    """An async save between its :meth:`Saver.save` call and its :meth:`Saver.wait`."""

    step: int
    path: Path
    writer: ChecksumFileSystemWriter
    export_t0: float  # when the save call started (its export first); a deferred export_s ends when filled
    deferred: bool
    staged: Any = None  # the stager's staging completion (the copies done, the export filled)
    upload: Any = None  # DCP's upload (raises SaveRefused when the stager refused the save on every rank)
    report: ExportReport | None = None
    held_s: float = 0.0  # how long this checkpoint has held the loop so far
    filled_at: float | None = None  # a deferred export: perf_counter() when the staging completed
    export_waited: bool = False  # wait_export() ran (later calls return at once)
