"""``GatedWriter``: a DCP storage writer that runs a gate before it writes anything, so that DCP may plan a save
before its data is ready (``AsyncSaveStager.async_save``: while an optimizer's background export fills). See
docs/design.md, "The async-save stager".
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

__all__ = ["GatedWriter"]


class GatedWriter(StorageWriter):
    """``writer`` for one save, whose ``write_data`` first calls ``gate()`` (on DCP's upload thread, on every rank
    between DCP's collectives): a gate that raises ends the save before anything is written, and the local
    directories the writer's planning created are removed again (deepest first, each only while empty). Every
    other call is the writer's; DCP's planning before the gate reads only the tensors' metadata."""

    def __init__(self, writer: StorageWriter, gate: Callable[[], None]) -> None:
        self.writer, self.gate = writer, gate
        self._made: list[Path] = []  # the local directories the writer's planning creates, deepest first

    def reset(self, checkpoint_id: Any = None) -> None:
        self.writer.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if "kwargs" in inspect.signature(self.writer.set_up_storage_writer).parameters:
            self.writer.set_up_storage_writer(is_coordinator, *args, **kwargs)
        else:  # a writer without them (DCP asks the same of the writer it is given)
            self.writer.set_up_storage_writer(is_coordinator)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if isinstance(getattr(self.writer, "fs", None), FileSystem):  # DCP's local file system (not fsspec's)
            path = Path(self.writer.path)
            self._made = [p for p in (path, *path.parents) if not p.exists()]
        return self.writer.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return self.writer.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            self.gate()
        except BaseException:
            with contextlib.suppress(OSError):  # another rank's removal, or not empty: not ours to remove
                for directory in self._made:
                    os.rmdir(directory)
            raise
        return self.writer.write_data(plan, planner)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        self.writer.finish(metadata, results)

    def storage_meta(self) -> Any:
        return self.writer.storage_meta()

    @property
    def checkpoint_id(self) -> Any:  # what DCP's logging names the save by
        return getattr(self.writer, "checkpoint_id", None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """DCP never picks this writer for a checkpoint id: it is built around a writer DCP was given."""
        return False
