"""One save of the recipe's, from its ``Saver.save`` call to its sealed manifest in ``Saver.wait``: the record the
saver keeps of it (its writer, its report, the stager's response for an async save, the time it has held the loop).
A sync save is written when its call returns and sealed at once; an async one when the next save or the end waits
for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse  # torch >= 2.9

from recipes.checkpoint.checksums import ChecksumFileSystemWriter
from recipes.checkpoint.report import ExportReport


@dataclass
class InFlight:
    """A save between its :meth:`Saver.save` call and its :meth:`Saver.wait`."""

    step: int
    path: Path
    writer: ChecksumFileSystemWriter
    report: ExportReport
    export_t0: float  # when the save call started (its export first); a background export_s ends when filled
    deferred: bool  # an async save that returns before its export is filled (Saver.defers)
    # the stager's response to an async save: staging_completion (the copies done, the export filled),
    # upload_completion (written, or SaveRefused on every rank); None for a sync save, written by its call
    response: AsyncSaveResponse | None = None
    held_s: float = 0.0  # how long this checkpoint has held the loop so far
    export_waited: bool = False  # wait_export() ran (later calls return at once)
