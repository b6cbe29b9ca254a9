"""A loop written by hand around a ``CheckpointManager``'s saver that times its public calls from outside (``save``,
``wait_export`` before every ``step()``, ``wait``): the most each checkpoint can have held the loop, which its
``blocking_s`` must not exceed."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from optim_factory import PortableFusedAdam
from recipes.checkpoint import CheckpointManager, PhaseCallback
from recipes.config import CheckpointConfig
from tests.helpers import set_grads

# the options of the recipe's background export (tests/recipe/runs.py BACKGROUND), for a hand-built optimizer
BACKGROUND_OPTIONS = dict(
    state_dict_cpu_offload=True,
    state_dict_offload_chunk_bytes=64,
    state_dict_offload_reuse_buffers=True,
    state_dict_offload_background=True,
)


class TimedSaves:
    """``steps`` optimizer steps of a small model, a save every ``every``; ``calls``: (save|wait|wait_export, start,
    end) of every call, in order. The loop waits for the previous save itself (timed) before the next save call."""

    def __init__(self, tmp_path: Path, *, async_save: bool, background: bool, on_phase: PhaseCallback | None = None):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        self.opt = PortableFusedAdam(self.model.parameters(), lr=1e-3, **(BACKGROUND_OPTIONS if background else {}))
        cfg = CheckpointConfig(dir=str(tmp_path / "ck"), async_save=async_save, keep_last=0)
        self.manager = CheckpointManager(
            cfg, rank=0, device=torch.device("cpu"), waits_before_step=True, on_phase=on_phase
        )
        self.calls: list[tuple[str, float, float]] = []

    def _timed(self, kind: str, call, *args) -> None:
        t0 = time.perf_counter()
        try:
            call(*args)
        finally:
            self.calls.append((kind, t0, time.perf_counter()))

    def run(self, steps: int, every: int, before_save=lambda: None) -> list:
        """The reports of the saves, once the last is waited for and the manager closed; ``before_save`` is called
        before each save call."""
        saver, params = self.manager.saver, list(self.model.parameters())
        for step in range(1, steps + 1):
            set_grads(params, step)
            self._timed("wait_export", saver.wait_export)
            self.opt.step()
            self.opt.zero_grad()
            if step % every == 0:
                self._timed("wait", saver.wait)
                before_save()
                self._timed("save", saver.save, step, self.model, self.opt, {"step": step})
        self._timed("wait", saver.wait)
        self.manager.saver.close()
        return saver.reports

    def held_bounds(self, async_save: bool) -> list[float]:
        """Per save, in order: the longest the loop can have been held by it. Sync: the save call. Async: the save
        call, the waits before step() until the next wait(), and that wait."""
        saves = [(t0, t1) for kind, t0, t1 in self.calls if kind == "save"]
        waits = [(t0, t1) for kind, t0, t1 in self.calls if kind == "wait"]
        export_waits = [(t0, t1) for kind, t0, t1 in self.calls if kind == "wait_export"]
        bounds = []
        for a, b in saves:
            if not async_save:
                bounds.append(b - a)
                continue
            after = min((w for w in waits if w[0] >= b), key=lambda w: w[0])
            before_step = sum(t1 - t0 for t0, t1 in export_waits if b <= t0 and t1 <= after[0])
            bounds.append(b - a + before_step + after[1] - after[0])
        return bounds
