"""One optimizer step of the recipe (:class:`TrainStep`), its learning-rate schedule, and the model's FSDP2
sharding: what the training loop and ``benchmarks/probes/bench_recipe_overhead.py`` both run."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard


def lr_factor(step: int, warmup: int, max_steps: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% at ``max_steps`` (``step`` is 0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _set_lr(optimizer: torch.optim.Optimizer, base_lrs: list[float], factor: float) -> float:
    for group, base in zip(optimizer.param_groups, base_lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(base * factor)
        else:
            group["lr"] = base * factor
    return base_lrs[0] * factor


@dataclass
class StepResult:
    """What one training step leaves for the rest of the loop (all on the step's device; nothing synchronised)."""

    loss: torch.Tensor  # this rank's loss
    nonfinite: torch.Tensor  # this rank's loss or the global gradient norm is NaN/inf (bool scalar)
    lr: float
    tokens: int  # tokens of the global batch


@dataclass
class TrainStep:
    """One optimizer step of the recipe, callable on its own: the training loop and
    ``benchmarks/probes/bench_recipe_overhead.py`` both run it. Learning-rate schedule, the step's batch, forward,
    backward, gradient clipping (``grad_clip`` > 0), the non-finite check (no sync), ``optimizer.step()`` and
    ``zero_grad``; with ``prepare_at`` set, ``optimizer.prepare_state_dict()`` after that step (reused buffers)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data: Any
    device: torch.device
    rank: int
    world: int
    base_lrs: list[float]
    warmup_steps: int
    max_steps: int
    grad_clip: float
    prepare_at: int | None = None
    # called right before optimizer.step(): the recipe passes Saver.wait_export, which waits (timed,
    # counted in that checkpoint's blocking_s) for an async save's export still being filled in the background
    before_step: Callable[[], None] | None = None

    def __call__(self, step: int) -> StepResult:
        lr = _set_lr(self.optimizer, self.base_lrs, lr_factor(step, self.warmup_steps, self.max_steps))
        inputs, targets = self.data.batch(step, self.rank, self.world)
        loss = self.model(inputs.to(self.device), targets.to(self.device))
        loss.backward()
        nonfinite = ~torch.isfinite(loss.detach())  # this rank's loss; no sync here
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            norm = norm.to_local() if hasattr(norm, "to_local") else norm  # replicated: the global norm
            nonfinite = nonfinite | ~torch.isfinite(norm)
        if self.before_step is not None:
            self.before_step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if step == self.prepare_at and hasattr(self.optimizer, "prepare_state_dict"):
            # reused export buffers: allocate, touch and pin them in the background now, so that even the
            # first checkpoint streams at the host link's bandwidth (no-op unless the option is on)
            self.optimizer.prepare_state_dict()
        return StepResult(loss, nonfinite, lr, inputs.numel() * self.world)


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2: shard every block, then the root (also for one rank)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
