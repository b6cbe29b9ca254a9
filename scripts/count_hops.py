"""Count the module hops of one async save, from the loop's call to the bytes on disk: the recipe's (its ``Saver``,
a background export into pooled buffers, ``checkpoint.async_save=true``) and torchtitan's
(``optim_factory.integrations.torchtitan.CheckpointManager``, ``async_mode="async_with_pinned_mem"``), one process on
CPU, the save's calls traced on the caller's thread and every thread started during the save (``sys.setprofile``,
``threading.setprofile``; threads kept from the first save, the export's workers, are not followed).

A hop is a call from one module into another, or its return: each distinct cross-module call edge (caller's module
and function -> callee's module and function) counts twice, once however many items the save holds; the count is
given whole and for the edges into or out of the project's own modules. Only the
modules a save's journey is made of are followed: ``optim_factory``, ``recipes``, ``torchtitan`` and DCP
(``torch.distributed.checkpoint``); a call from anywhere else is the call of the nearest such frame below it. The
second save is counted (the first also builds what later saves keep). docs/design.md ("How far a save travels")
records the counts.

    python -m scripts.count_hops [--show]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

FOLLOWED = ("optim_factory", "recipes", "torchtitan", "torch.distributed.checkpoint")
OURS = ("optim_factory", "recipes")
BACKGROUND = dict(
    state_dict_cpu_offload=True,
    state_dict_offload_chunk_bytes=4096,
    state_dict_offload_reuse_buffers=True,
    state_dict_offload_background=True,
)


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith(FOLLOWED) else None


class Hops:
    """The distinct cross-module call edges seen while :meth:`traced` runs."""

    def __init__(self) -> None:
        self.edges: set[tuple[str, str]] = set()
        self.modules: set[str] = set()

    def _profile(self, frame, event: str, arg) -> None:
        if event != "call":
            return
        callee = _module(frame)
        if callee is None:
            return
        self.modules.add(callee)
        caller = frame.f_back
        while caller is not None and _module(caller) is None:
            caller = caller.f_back
        if caller is not None and _module(caller) != callee:
            self.edges.add((f"{_module(caller)}.{caller.f_code.co_name}", f"{callee}.{frame.f_code.co_name}"))

    def traced(self, run: Callable[[], None]) -> None:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        try:
            run()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    @property
    def count(self) -> int:
        return 2 * len(self.edges)  # each call and its return

    @property
    def module_edges(self) -> set[tuple[str, str]]:
        """The distinct (caller module, callee module) pairs."""
        return {tuple(end.rsplit(".", 1)[0] for end in edge) for edge in self.edges}

    @property
    def ours(self) -> int:
        """The hops into or out of the project's own modules (``optim_factory``, ``recipes``)."""
        return 2 * sum(1 for edge in self.edges if any(end.startswith(OURS) for end in edge))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _second_save_traced(step: Callable[[], None], save: Callable[[int], None]) -> Hops:
    """Two training steps, each followed by ``save(step)``; the second save traced (the first builds what later
    saves keep)."""
    hops = Hops()
    step()
    save(1)
    step()
    hops.traced(lambda: save(2))
    return hops


def recipe_save(folder: Path) -> Hops:
    """The recipe's async save of a deferred export: ``save``, ``wait_export`` before the next step, ``wait``."""
    from optim_factory import PortableFusedAdam
    from recipes.checkpoint import CheckpointManager
    from recipes.config import CheckpointConfig

    model = _model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **BACKGROUND)
    cfg = CheckpointConfig(dir=str(folder), async_save=True, keep_last=0)
    manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"), waits_before_step=True)
    saver = manager.saver

    def step() -> None:
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def save(n: int) -> None:
        saver.save(n, model, opt, {"step": n})
        saver.wait_export()
        saver.wait()

    hops = _second_save_traced(step, save)
    saver.close()
    return hops


def torchtitan_save(folder: Path) -> Hops:
    """torchtitan's save in ``async_with_pinned_mem`` through our CheckpointManager: ``save``, the Trainer's
    ``maybe_wait_for_staging`` before the step, ``maybe_wait_for_saving``."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    from optim_factory.integrations import torchtitan as integration

    model = _model()
    optimizers = integration.fused_adam(lr=1e-3, name="PortableFusedAdam", **BACKGROUND).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    config = integration.CheckpointManager.Config(
        enable=True, folder=str(folder), interval=1, keep_latest_k=0, async_mode="async_with_pinned_mem"
    )
    checkpointer = config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={},
        sd_adapter=None,
    )  # fmt: skip

    def step() -> None:
        model(torch.randn(4, 64)).square().mean().backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()

    def save(n: int) -> None:
        checkpointer.save(curr_step=n)
        checkpointer.maybe_wait_for_staging()
        checkpointer.maybe_wait_for_saving()

    hops = _second_save_traced(step, save)
    checkpointer.close()
    return hops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--show", action="store_true", help="print every edge counted")
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)  # torchtitan's checkpointer asks the process group
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, count in (("recipe", recipe_save), ("torchtitan", torchtitan_save)):
                hops = count(Path(tmp) / name)
                print(
                    f"{name}: {hops.count} hops, {hops.ours} of them into or out of optim_factory and recipes "
                    f"({len(hops.edges)} cross-module calls, {len(hops.modules)} modules, "
                    f"{len(hops.module_edges)} module pairs)"
                )
                for caller, callee in sorted(hops.edges) if args.show else ():
                    print(f"    {caller} -> {callee}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
