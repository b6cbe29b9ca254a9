"""``GatedPlanner``: DCP's default save planner, whose last planning step waits for the save's verdict and every
rank's agreement on it, so that DCP may plan a save before its data is ready (``AsyncSaveStager.async_save``: while
an optimizer's background export fills). See docs/design.md, "The async-save stager".
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan

from optim_factory.checkpoint._agreement import agree
from optim_factory.checkpoint._record import StagedSave
from optim_factory.errors import SaveRefused

__all__ = ["GatedPlanner"]


class GatedPlanner(DefaultSavePlanner):
    """DCP's default save planner for one save, whose ``finish_plan`` first waits for the gate: this rank's verdict
    of :attr:`save` (set by the stager when it stages the save), then every rank's, gathered on ``group``. DCP calls
    it on every rank right before the writer's ``write_data``, between its collectives, on its upload thread: a
    refusal (:class:`SaveRefused` on every rank, kept in ``save.refused``) ends the save before anything is
    written, and where the writer writes to the local file system (``local``: DCP's file system, not fsspec's), the
    directories its planning made are removed again (deepest first, each on its own and only while empty). The
    planning before the gate reads only the tensors' metadata."""

    def __init__(self, group: Any, *, local: bool) -> None:
        super().__init__()
        self.group, self.local = group, local
        self.save: StagedSave | None = None  # the save it plans, once staged
        self._made: list[Path] = []  # the directories the writer's planning creates, deepest first

    @classmethod
    def for_save(cls, group: Any, dcp_kwargs: dict[str, Any]) -> GatedPlanner | None:
        """The planner of a save with ``dcp.async_save``'s arguments ``dcp_kwargs``, from them alone (the same on
        every rank), or None where it is not gated: a planner of the caller's, no collectives (each rank's planning
        alone could leave the others at the gate), or a ``checkpoint_id`` with ``://`` and no writer (DCP picks
        fsspec's writer, whose directories a refusal would leave behind)."""
        writer, checkpoint_id = dcp_kwargs.get("storage_writer"), dcp_kwargs.get("checkpoint_id")
        if (
            dcp_kwargs.get("planner") is not None
            or dcp_kwargs.get("no_dist", False)
            or dcp_kwargs.get("use_collectives", True) is False
            or (writer is None and "://" in str(checkpoint_id))
        ):
            return None
        return cls(group, local=writer is None or isinstance(getattr(writer, "fs", None), FileSystem))

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        """Called before the writer's planning (which creates the checkpoint directory), with the writer's
        ``storage_meta()``: its ``checkpoint_id`` is the directory (after DCP's ``reset`` of the writer). The save's
        staging has waited for the previous save by then (whose refusal removes directories of its own)."""
        where = getattr(storage_meta, "checkpoint_id", None)
        if self.local and where is not None:
            self._made = [p for p in (Path(where), *Path(where).parents) if not p.exists()]
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        try:
            self.gate()
        except BaseException:
            for directory in self._made:  # each on its own: one another rank removed first still has its parents
                with contextlib.suppress(OSError):  # gone (another rank's removal), or not empty: not ours to remove
                    os.rmdir(directory)
            raise
        return super().finish_plan(new_plan)

    def gate(self) -> None:
        """The ranks' verdict on :attr:`save`: returns when none refused it, else raises :class:`SaveRefused`."""
        refusals = agree(self.save.verdict.result(), self.group)
        if refusals:
            self.save.refused = SaveRefused(refusals)
            raise self.save.refused
