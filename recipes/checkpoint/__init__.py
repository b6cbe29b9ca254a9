"""The recipe's checkpoints: DCP checkpoints of model + optimizer + trainer state, with export reports.

Layout of ``checkpoint.dir``::

    step_00000100/            one DCP checkpoint (``.metadata`` + ``__<rank>_<n>.distcp`` files)
        COMPLETE.json         the manifest, written by rank 0 (atomically) only after DCP finished the save (sync
                              or async): the export report, the size and XXH3-64 hash of every file (recorded while it
                              was written, see checksums.py) and the resolved run config
    step_00000200/ ...
    step_00000150.damaged/    a checkpoint that failed verification, set aside (counted by neither resume nor keep_last)

A checkpoint is *complete* when it has both ``.metadata`` and ``COMPLETE.json``. Resume (``auto``) picks the
newest complete one; incomplete directories are never loaded (rank 0 removes them, one line each). ``keep_last``
deletes only older complete checkpoints, and never the newest verified one (the last saved or loaded).

The modules, one job each (none imports a module that imports it):

- ``checksums.py``: the checksumming writer and the file check;
- ``layout.py``: step directories, the manifest, retention, the set-aside of a damaged checkpoint (no collectives);
- ``resume.py``: what a resume does with each config key that differs from the checkpoint's (a pure table);
- ``report.py``: what a save cost;
- ``save.py``: :class:`~recipes.checkpoint.save.Saver`, every save from its export to its sealed manifest and
  ``keep_last`` (an async save in flight is its ``InFlight``; its staging is the library's
  :class:`optim_factory.checkpoint.AsyncSaveStager`);
- ``load.py``: :class:`~recipes.checkpoint.load.Loader`, the resume (candidates, config check, verification, read);
- ``manager.py``: :class:`CheckpointManager`, a saver and a loader given their inputs (the run holds and calls both).
"""

from optim_factory.tree import state_bytes
from recipes.checkpoint.layout import (
    FALLBACK_HINT,
    MARKER,
    METADATA,
    STEP_DIR,
    CheckpointError,
    DamagedCheckpoint,
    checkpoint_key,
    disk_full,
    first_save_bytes,
    is_complete,
    read_checkpoint,
    read_manifest,
    step_dirs,
)
from recipes.checkpoint.load import Loader
from recipes.checkpoint.manager import CheckpointManager
from recipes.checkpoint.report import ExportReport
from recipes.checkpoint.save import SAVE_PHASES, PhaseCallback, Saver

__all__ = [
    "FALLBACK_HINT",
    "MARKER",
    "METADATA",
    "SAVE_PHASES",
    "Loader",
    "PhaseCallback",
    "Saver",
    "STEP_DIR",
    "CheckpointError",
    "CheckpointManager",
    "DamagedCheckpoint",
    "ExportReport",
    "disk_full",
    "first_save_bytes",
    "is_complete",
    "checkpoint_key",
    "read_checkpoint",
    "read_manifest",
    "state_bytes",
    "step_dirs",
]
