"""``scripts.bench_save``'s framework modes: the save as torchtitan's and NeMo Automodel's users run it, with TE's
class in the framework's own async mode (``-te``) and with ours through our integration (``-ours``).

* ``f-titan-*``: a ``CheckpointManager`` (torchtitan 0.3's own, or ``optim_factory.integrations.torchtitan``'s)
  with ``async_mode="async_with_pinned_mem"`` around the bench's FSDP2 model, torchtitan's ``OptimizersContainer``
  of the mode's optimizer and an LR scheduler container; the loop calls what torchtitan's Trainer calls:
  ``save(curr_step)`` after the step, ``maybe_wait_for_staging()`` before the next ``optimizer.step()``, and
  ``maybe_wait_for_saving()`` (here after the steps that follow the save). torchtitan keeps one DCP
  ``DefaultStager`` across saves (pinned, shared memory, async staging, non-blocking copies), built at its first
  save. Where torchtitan would build it and this torch's stager serves one save (torch 2.11), the manager's
  ``stager`` slot is filled before the first save with ``scripts.dcp_stagers.KeptStager`` (2.13's staging, the same
  options), and without an accelerator (where torchtitan's options are refused) with CPU options (no pinning,
  blocking copies); each row names the stager in ``stager``.
* ``g-automodel-*``: a ``Checkpointer`` (Automodel 0.7's own, or ``optim_factory.integrations.automodel``'s) with
  ``is_async=True`` and the model in DCP's format (``model_save_format="torch_save"``, no consolidated HF export),
  as Automodel's recipes save: ``save_model`` then ``save_optimizer`` into the step's folder,
  ``maybe_wait_for_staging()`` before the next ``optimizer.step()``, ``async_wait()`` to finish. Automodel builds a
  new ``DefaultStager`` (torch's defaults: pinned, shared memory, async staging, non-blocking copies) for every
  save. Its constructor builds one too, which needs an accelerator: without one the mode is skipped, in one line.
  ``g-automodel-ours-process``: the integration's ``write_in_process=True``.
* ``h-checkpointing-te``: Meta's ``torch_checkpointing`` 0.1.1 (what torchtitan's main branch saves through) around
  TE's class: one ``CheckpointManager`` with its default async saver (a pooled staging of the whole payload, pinned
  where CUDA is, in shared memory, and a background-process writer), kept across saves;
  ``save(path, {"model": ..., "optim": ...})`` of DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict``,
  ``with manager.lock():`` (its guard of the step against a capture in progress) before the next
  ``optimizer.step()``, the returned future awaited to finish. Its local storage writes through the page cache
  (``use_direct_io=False``, as DCP's and ours do): its default ``O_DIRECT`` refuses the unaligned records that
  ``torch.save`` writes on ext4 (``OSError: [Errno 22]`` at the first save, seen on CPU).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from optim_factory.errors import first_line
from optim_factory.tree import state_bytes
from scripts.bench_export import PoolBuffers, wait_pinning
from scripts.bench_save import proc_status  # (bench_save imports this module inside its functions only)
from scripts.dcp_stagers import EMULATION, KeptStager

IMPORTS = {  # mode prefix -> what its modes import (the framework's and our integration's)
    "f-": ("torchtitan.components.checkpointer", "optim_factory.integrations.torchtitan"),
    "g-": ("nemo_automodel.components.checkpoint.checkpointing", "optim_factory.integrations.automodel"),
    "h-": ("torch_checkpointing",),
}


def import_error(modes: list[str]) -> str | None:
    """Why the framework modes among ``modes`` cannot run here (a module they need does not import: its first
    line), or None: found before any measurement."""
    for prefix, modules in IMPORTS.items():
        for module in modules if any(m.startswith(prefix) for m in modes) else ():
            try:
                importlib.import_module(module)
            except ImportError as exc:
                return f"{module} does not import ({first_line(exc)})"
    return None


class ModeSkipped(Exception):
    """A mode this machine cannot run, with its one-line reason."""


class ExportBytes:
    """The bytes of the optimizer's last export (the local shards of its state tensors), seen by a state-dict
    post-hook (our classes run it on the exported dictionary): what the framework's save exported."""

    def __init__(self, opt) -> None:
        self.nbytes: int | None = None
        opt.register_state_dict_post_hook(self._record)

    def _record(self, opt, exported: dict) -> None:
        self.nbytes = state_bytes(exported["state"])


class FrameworkMode:
    """What ``bench_save.measure_mode`` calls: ``save``, ``hook``, ``finish``, ``close``, ``checkpoint_path``."""

    def __init__(self, name: str, ctx: dict) -> None:
        self.name, self.ctx = name, ctx
        self.ours = "-ours" in name
        self.budget = ctx["opt"].export_options.host_budget if self.ours else None
        self.rss_base = self.last = None  # a budget's: the resident bytes at the save, and the save's row
        self.exported = ExportBytes(ctx["opt"])
        self.pool_buffers = PoolBuffers(ctx["opt"])  # what of the pinned host memory is our pool's
        self.stager = ""  # the stager's name, for the rows

    def checkpoint_path(self, root: Path, step: int) -> Path:
        return root / f"step_{step:08d}"

    def info(self) -> dict:
        self.last = {"optim_bytes": self.exported.nbytes, "stager": self.stager, "budget_bytes": self.budget}
        return self.last

    def reset_peak(self) -> None:
        """With a budget: the process's resident high-water mark reset at the save (Linux), read by :meth:`peak`."""
        if self.budget is not None:
            Path("/proc/self/clear_refs").write_text("5")
            self.rss_base = proc_status("VmRSS")

    def peak(self) -> None:
        """With a budget: the row gets the resident bytes the save added at its peak, and the fills' own peak."""
        if self.budget is not None and self.last is not None:
            self.last["rss_peak_added_bytes"] = proc_status("VmHWM") - self.rss_base
            self.last["fill_peak_bytes"] = self.checkpointer.stager.budget_peak_bytes

    def hook(self) -> None:
        """Before the optimizer step: the framework's wait for staging (torchtitan's Trainer and Automodel's recipes
        call it there)."""
        self.checkpointer.maybe_wait_for_staging()

    def close(self) -> None:
        self.checkpointer.close()


class TitanMode(FrameworkMode):
    def __init__(self, name: str, ctx: dict, optimizers) -> None:
        super().__init__(name, ctx)
        from torchtitan.components.optimizer import LRSchedulersContainer

        if self.ours:
            from optim_factory.integrations.torchtitan import CheckpointManager
        else:
            from torchtitan.components.checkpointer import CheckpointManager
        schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10**6)
        process = {"write_in_process": True} if "-process" in name else {}  # the integration's option
        config = CheckpointManager.Config(
            enable=True,
            folder=str(ctx["root"]),
            interval=1,
            keep_latest_k=0,
            async_mode="async_with_pinned_mem",
            **process,
        )
        self.checkpointer = config.build(
            dataloader=None,
            model_parts=[ctx["model"]],
            optimizers=optimizers,
            lr_schedulers=schedulers,
            states={},
            sd_adapter=None,
        )
        self.how = self.keep_stager(ctx["stager_reusable"]) + (" (write_in_process)" if process else "")

    def keep_stager(self, reusable: bool) -> str:
        """Where torchtitan builds its own ``DefaultStager`` at the first save (its slot still empty) and that
        stager could not serve here (a torch whose stager serves one save, or no accelerator for its options),
        fill the slot with one that can, before the first save; returns how the slot's stager was built."""
        accelerator = torch.accelerator.is_available()
        if self.checkpointer.stager is not None:  # the integration's own, built with the manager
            return ""
        if accelerator and reusable:
            return " (torchtitan's)"
        options = StagingOptions(
            use_pinned_memory=accelerator,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=accelerator,
        )
        stager = self.checkpointer.stager = (DefaultStager if reusable else KeptStager)(options)
        how = EMULATION if isinstance(stager, KeptStager) else "torchtitan's"
        return f" ({how}{'' if accelerator else ', CPU options: no pinning, blocking copies'})"

    def checkpoint_path(self, root: Path, step: int) -> Path:
        return root / f"step-{step}"  # torchtitan's name for it

    def save(self, step: int, path: Path) -> dict:
        self.reset_peak()
        self.checkpointer.save(curr_step=step)
        self.stager = type(self.checkpointer.stager).__name__ + self.how  # the stager that staged this save
        return self.info()

    def finish(self) -> None:
        self.checkpointer.maybe_wait_for_saving()
        self.peak()
        wait_pinning(self.ctx["opt"])


class AutomodelMode(FrameworkMode):
    def __init__(self, name: str, ctx: dict) -> None:
        super().__init__(name, ctx)
        from nemo_automodel.components.checkpoint.config import CheckpointingConfig

        if self.ours:
            from optim_factory.integrations.automodel import Checkpointer
        else:
            from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
        config = CheckpointingConfig(
            checkpoint_dir=str(ctx["root"]), model_save_format="torch_save", save_consolidated=False, is_async=True
        )
        process = {"write_in_process": True} if "-process" in name else {}  # the integration's option
        try:
            self.checkpointer = Checkpointer(config, dp_rank=ctx["rank"], tp_rank=0, pp_rank=0, **process)
        except AssertionError as exc:  # torch's DefaultStager refuses non-blocking copies without an accelerator
            if torch.accelerator.is_available():
                raise
            where = f"{Checkpointer.__module__}.Checkpointer"
            raise ModeSkipped(f"{where}(is_async=True) needs an accelerator here: {exc}") from None
        self.stager = "the integration's" if self.ours else "a new DefaultStager per save (Automodel's)"
        self.stager += " (write_in_process)" if process else ""

    def save(self, step: int, path: Path) -> dict:
        model = self.ctx["model"]
        self.checkpointer.save_model(model, str(path))
        self.checkpointer.save_optimizer(self.ctx["opt"], model, str(path))
        return self.info()

    def finish(self) -> None:
        self.checkpointer.async_wait()
        wait_pinning(self.ctx["opt"])


class CheckpointingMode(FrameworkMode):
    def __init__(self, name: str, ctx: dict) -> None:
        super().__init__(name, ctx)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        self.checkpointer = CheckpointManager(CheckpointManager.Config(storage_config=storage))
        self.written = None  # the last save's future
        self.stager = "torch_checkpointing's DefaultStager (kept), background-process writer"

    def save(self, step: int, path: Path) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model, opt = self.ctx["model"], self.ctx["opt"]
        payload = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        self.written = self.checkpointer.save(str(path), payload)
        return self.info()

    def hook(self) -> None:
        with self.checkpointer.lock():  # waits while its capture of the payload is in progress
            pass

    def finish(self) -> None:
        self.written.result()
        wait_pinning(self.ctx["opt"])

    def close(self) -> None:
        self.checkpointer.close()


def build_mode(name: str, ctx: dict, stepper) -> FrameworkMode:
    """The framework mode ``name`` around the run's model and the mode's optimizer (``ctx["opt"]``); ``stepper``
    is what the trainer steps (torchtitan's ``OptimizersContainer`` for the ``f-`` modes). Raises
    :class:`ModeSkipped` where this machine cannot run it."""
    if name.startswith("f-titan-"):
        return TitanMode(name, ctx, stepper)
    if name.startswith("h-"):
        return CheckpointingMode(name, ctx)
    return AutomodelMode(name, ctx)
