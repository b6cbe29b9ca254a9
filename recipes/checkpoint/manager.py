"""CheckpointManager: one run's checkpoints in ``checkpoint.dir`` (recipes/checkpoint/layout.py), composed of a
:class:`~recipes.checkpoint.save.Saver` (every save, from its export to its sealed manifest and ``keep_last``) and a
:class:`~recipes.checkpoint.load.Loader` (the resume), each given its inputs; the checkpoint a load verified is
handed to the saver (:meth:`CheckpointManager.load`), which never deletes it and names it in its refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from recipes.checkpoint.checksums import writer_threads
from recipes.checkpoint.host_copies import HostCopies
from recipes.checkpoint.layout import complete
from recipes.checkpoint.load import Loader
from recipes.checkpoint.report import ExportReport
from recipes.checkpoint.save import Saver


class CheckpointManager:
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
        background export is filled (``recipes.checkpoint.export.defers``), since the export's failure must reach
        the save, not a ``step()``."""
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self.rank = rank
        options = StateDictOptions(flatten_optimizer_state_dict=cfg.flatten_optimizer_state_dict)
        self.write_threads = writer_threads(cfg.write_threads)  # DCP's writer threads per rank, for every save
        self.host_copies = HostCopies()  # async saves: the model's host copies, reused from save to save
        # An async save plans and finishes on DCP's background thread with collectives of its own; on the
        # default group they would interleave with training's (gloo: a collective-mismatch abort; NCCL: a
        # hang), so they get a gloo group of their own (created here, on every rank, in the same order).
        save_group = (
            dist.new_group(backend="gloo") if cfg.enabled and cfg.async_save and dist.is_initialized() else None
        )
        self.saver = Saver(
            cfg,
            rank=rank,
            device=device,
            options=options,
            write_threads=self.write_threads,
            save_group=save_group,
            host_copies=self.host_copies,
            run_config=run_config,
            waits_before_step=waits_before_step,
            on_phase=self.on_phase,
            on_report=on_report,
        )
        self.loader = Loader(cfg, rank=rank, options=options, run_config=run_config)

    def on_phase(self, phase: str, step: int, path: Path) -> None:
        """Called at each point of ``SAVE_PHASES`` of the save of ``step`` into ``path``; does nothing here.

        For subclasses that observe saves (``tests/fault/fault_train.py`` kills the process there):
        ``"export"``: the optimizer is exported (deferred: its export started), nothing of ``path`` is written;
        ``"write"``: ``dcp.save`` returned (sync) or ``dcp.async_save`` started writing (the save is in flight:
        :attr:`export_filling`), no completion marker yet; ``"marker"``: the save
        finished (async: inside :meth:`wait`) and the completion marker is about to be written.
        """

    def due(self, step: int, max_steps: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every_steps == 0 or step == max_steps)

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> ExportReport:
        """Export and save a checkpoint for ``step`` (``Saver.save``), once the previous save is finished
        (:meth:`wait`). With a deferred export, call :meth:`wait_export` before the next ``optimizer.step()``."""
        self.wait()  # this object's wait, which a subclass may observe (Saver.save finds nothing in flight then)
        return self.saver.save(step, model, optimizer, trainer_state)

    def wait(self) -> None:
        """Wait for an in-flight async save and mark it complete; a failed save raises (``Saver.wait``)."""
        self.saver.wait()

    def wait_export(self) -> None:
        """Call before ``optimizer.step()``: wait until the in-flight save's deferred export is filled, counted in
        that checkpoint's ``blocking_s`` (``Saver.wait_export``)."""
        self.saver.wait_export()

    @property
    def export_filling(self) -> bool | None:
        """None when no async save with a deferred export is in flight; else whether its export is still being
        filled (the loop runs meanwhile; :meth:`wait_export` waits for it)."""
        return self.saver.export_filling

    @property
    def reports(self) -> list[ExportReport]:
        """This launch's saves, in order (a refused deferred save is removed)."""
        return self.saver.reports

    @property
    def verified(self) -> Path | None:
        """The newest checkpoint known good: the last saved or loaded; never deleted."""
        return self.saver.verified

    def first_save_space_problem(self, estimate: int) -> str | None:
        """Every rank, before the first step: rank 0's line when the run's next save cannot fit (``estimate``: this
        rank's share of a fresh run's first checkpoint), else None (``Saver.first_save_space_problem``)."""
        return self.saver.first_save_space_problem(estimate)

    def resume(self, model, optimizer, trainer_state: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest loadable checkpoint (``Loader.resume``): (path, trainer state), or None."""
        resumed = self.loader.resume(model, optimizer, trainer_state)
        if resumed is not None:
            self.saver.verified = Path(resumed[0])
        return resumed

    def load(self, path: Path, model, optimizer, trainer_state: dict[str, Any]) -> dict[str, Any]:
        """Load ``path`` into model, optimizer and a copy of ``trainer_state`` (``Loader.load``); the loaded
        trainer state."""
        state = self.loader.load(path, model, optimizer, trainer_state)
        self.saver.verified = Path(path)
        return state

    @property
    def resume_changes(self) -> list:
        """resume.Change: how the run's config differs from the loaded checkpoint's."""
        return self.loader.resume_changes

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of the complete checkpoints in ``checkpoint.dir``, by step."""
        return complete(self.root)

    def close(self) -> None:
        self.wait()
        self.host_copies.close()
