"""CheckpointManager: the save (recipes/checkpoint/save.py) and the load (recipes/checkpoint/load.py) of one run's
checkpoints in ``checkpoint.dir`` (recipes/checkpoint/layout.py), with the state they share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from recipes.checkpoint.checksums import writer_threads
from recipes.checkpoint.host_copies import HostCopies
from recipes.checkpoint.layout import complete
from recipes.checkpoint.load import Loads
from recipes.checkpoint.report import ExportReport
from recipes.checkpoint.save import InFlight, Saves


class CheckpointManager(Saves, Loads):
    """Saves, retains and resumes DCP checkpoints (see recipes/checkpoint/__init__.py)."""

    def __init__(
        self,
        cfg,
        *,
        rank: int,
        device: torch.device,
        on_report=None,
        run_config: dict[str, Any] | None = None,
        waits_before_step: bool = False,
    ):
        """``cfg``: the run's ``checkpoint`` config. ``run_config``: the resolved config of the run (a plain
        dict), stored in every checkpoint's manifest. ``waits_before_step``: the caller calls :meth:`wait_export`
        before every ``optimizer.step()`` (the recipe's loop does); only then may an async save return before a
        background export is filled (:meth:`_defers`), since the export's failure must reach the save, not a
        ``step()``."""
        self.cfg = cfg
        self.waits_before_step = waits_before_step
        self.run_config = run_config
        self.root = Path(cfg.dir)
        self.rank = rank
        self.device = device
        self.on_report = on_report
        self.options = StateDictOptions(flatten_optimizer_state_dict=cfg.flatten_optimizer_state_dict)
        self.write_threads = writer_threads(cfg.write_threads)  # DCP's writer threads per rank, for every save
        self._pending: InFlight | None = None
        self._host_copies = HostCopies()  # async saves: the model's host copies, reused from save to save
        # An async save plans and finishes on DCP's background thread with collectives of its own; on the
        # default group they would interleave with training's (gloo: a collective-mismatch abort; NCCL: a
        # hang), so they get a gloo group of their own (created here, on every rank, in the same order).
        self._save_group = (
            dist.new_group(backend="gloo") if cfg.enabled and cfg.async_save and dist.is_initialized() else None
        )
        self.reports: list[ExportReport] = []
        self._in_the_way: set[str] | None = None  # step directories of earlier launches, rank 0's (_clear_in_the_way)
        self.verified: Path | None = None  # the newest checkpoint known good: last saved or loaded; never deleted
        self.resume_changes: list = []  # resume.Change: how the run's config differs from the loaded one's

    @property
    def world(self) -> int:
        """The number of ranks now (a manager may be built before the process group)."""
        return dist.get_world_size() if dist.is_initialized() else 1

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of the complete checkpoints in ``checkpoint.dir``, by step."""
        return complete(self.root)

    def close(self) -> None:
        self.wait()
        self._host_copies.close()
