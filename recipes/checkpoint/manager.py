"""CheckpointManager: one run's checkpoints in ``checkpoint.dir`` (recipes/checkpoint/layout.py), composed of a
:class:`~recipes.checkpoint.save.Saver` (``manager.saver``: every save, from its export to its sealed manifest and
``keep_last``) and a :class:`~recipes.checkpoint.load.Loader` (``manager.loader``: the resume), each given its
inputs. The manager builds them, hands the checkpoint a load verified to the saver (:meth:`CheckpointManager.resume`,
:meth:`CheckpointManager.load`; the saver never deletes it and names it in its refusals), checks the run's next save
before its first step (:meth:`CheckpointManager.check_first_save`), says which steps save
(:meth:`CheckpointManager.due`). A run holds the saver and the loader as its own parts (``recipes/job.py``'s
``Run``) and calls them directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from optim_factory.checkpoint import host_budget, least_host_budget, release_export
from recipes.checkpoint.checksums import writer_threads
from recipes.checkpoint.layout import CheckpointError, complete, first_save_bytes
from recipes.checkpoint.load import Loader
from recipes.checkpoint.resume import no_room
from recipes.checkpoint.save import PhaseCallback, Saver
from recipes.distributed import all_ranks


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
        on_phase: PhaseCallback | None = None,
    ):
        """``cfg``: the run's ``checkpoint`` config. ``run_config``: the resolved config of the run (a plain
        dict), stored in every checkpoint's manifest. ``waits_before_step``: the caller calls ``saver.wait_export()``
        before every ``optimizer.step()`` (the recipe's loop does); only then may an async save return before a
        background export is filled (``Saver.defers``), since the export's failure must reach
        the save, not a ``step()``. ``on_phase``: called at each point of every save (``Saver``'s)."""
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self.rank = rank
        options = StateDictOptions(flatten_optimizer_state_dict=cfg.flatten_optimizer_state_dict)
        self.write_threads = writer_threads(cfg.write_threads)  # DCP's writer threads per rank, for every save
        # Every save goes through the library's stager, whose DCP collectives and agreement run on its thread and
        # DCP's (an async save's beside training): on the default group they would interleave with training's
        # (gloo: a collective-mismatch abort; NCCL: a hang), so they get a gloo group of their own (created here,
        # on every rank, in the same order).
        save_group = dist.new_group(backend="gloo") if cfg.enabled and dist.is_initialized() else None
        self.saver = Saver(
            cfg,
            rank=rank,
            device=device,
            options=options,
            write_threads=self.write_threads,
            save_group=save_group,
            run_config=run_config,
            waits_before_step=waits_before_step,
            on_report=on_report,
            on_phase=on_phase,
        )
        self.loader = Loader(cfg, rank=rank, options=options, run_config=run_config)

    def due(self, step: int, max_steps: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every_steps == 0 or step == max_steps)

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

    def check_first_save(self, model, optimizer, trainer_state: dict[str, Any], resumed_from: Path | None) -> None:
        """Every rank, before the first step of a run that saves: a ``CheckpointError`` when its next save cannot
        fit in ``checkpoint.dir`` (``Saver.first_save_space_problem``), and the optimizer's ``ConfigError`` naming
        ``optim.state_dict_offload_host_budget=<bytes>`` and the least budget when that budget is below what its
        saves hold at their start (``optim_factory.checkpoint.least_host_budget`` of the save's own export,
        the largest of every rank's). A fresh optimizer's states are created first (``initialize_states``: those
        of its first ``step()``), which its export needs."""
        space = self.saver.first_save_space_problem(first_save_bytes(model))
        if space is not None:
            raise CheckpointError(no_room(space, resumed_from))
        limit = host_budget(optimizer)
        if limit is None:
            return
        optimizer.initialize_states()
        msd, osd, *_ = self.saver.export(model, optimizer)  # placeholders: no memory
        try:
            least = least_host_budget(optimizer, {"model": msd, "optim": osd, "trainer": trainer_state})
        finally:
            release_export(optimizer, osd)
        refusal = max(all_ranks(least), key=lambda rank: rank.nbytes).refusal(limit)
        if refusal is not None:
            raise refusal.under("optim.")

    def complete(self) -> list[tuple[int, Path]]:
        """(step, path) of the complete checkpoints in ``checkpoint.dir``, by step."""
        return complete(self.root)
