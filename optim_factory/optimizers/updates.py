"""How :class:`~optim_factory.optimizers.portable.PortableFusedAdam` runs the kernel arithmetic over a group.

Each parameter's update reads and writes FP32 working tensors (an :class:`Update`). The arithmetic
(:func:`~optim_factory.optimizers.kernel_math.adam_update`) is element-wise, so how elements are grouped into
calls does not change a bit of the result; what it changes is the number of calls and the memory they take.
Parameters below ``UPDATE_SLICE`` elements are updated together, in one call over their concatenated tensors
(TE's multi-tensor apply likewise packs many tensors into one kernel launch); larger ones a slice at a time, so
that the float64 temporaries of the arithmetic (about ten 8-byte values per element) stay within
``UPDATE_SLICE`` elements. A parameter whose tensors are not all contiguous is updated in one call over the
whole tensors (no slice bound). Each call's result is computed before it is written.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from optim_factory.optimizers.kernel_math import adam_update, bias_corrections

__all__ = ["UPDATE_SLICE", "Update", "f32", "run_updates"]

UPDATE_SLICE = 1 << 20  # elements per call of the kernel arithmetic


def f32(x: float) -> float:
    """Round a Python float to the nearest FP32 value (what a ``const float`` kernel argument receives)."""
    return struct.unpack("f", struct.pack("f", x))[0]


class Update(NamedTuple):
    """One parameter's update in flight: the FP32 tensors ``(g, param or master, exp_avg, exp_avg_sq)`` that
    the arithmetic reads and writes in place, and what storing them back needs."""

    param: torch.Tensor
    local: torch.Tensor  # the parameter's local shard
    remainder: bool
    use_master: bool
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

    @property
    def numel(self) -> int:
        return self.tensors[1].numel()

    @property
    def flat(self) -> bool:
        return all(t.is_contiguous() for t in self.tensors)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device


def group_scalars(group: dict, device: torch.device) -> dict:
    """A parameter group's scalars as the kernel receives them (FP32 values; tensors in capturable mode)."""
    beta1, beta2 = group["betas"]
    b1, b2 = f32(beta1), f32(beta2)
    step = group["step"]
    if not group["bias_correction"]:
        bc1 = bc2 = 1.0
    elif isinstance(step, torch.Tensor):
        bc1, bc2 = bias_corrections(b1, b2, step.reshape(()), device)
    else:
        bc1, bc2 = f32(1.0 - b1**step), f32(1.0 - b2**step)
    lr = group["lr"]
    lr = lr.to(device=device, dtype=torch.float32) if isinstance(lr, torch.Tensor) else f32(lr)
    decay, eps = f32(group["weight_decay"]), f32(group["eps"])
    return dict(beta1=b1, beta2=b2, bc1=bc1, bc2=bc2, eps=eps, lr=lr, decay=decay)


def run_updates(
    group: dict, updates: Iterable[Update], finish: Callable[[Update], None], *, adam_w_mode: bool, capturable: bool
) -> None:
    """Apply the group's step to every update (consumed lazily, so that at most ``UPDATE_SLICE`` elements of
    small parameters wait at a time), calling ``finish`` on each once its tensors hold the new values."""
    scalars: dict[torch.device, dict] = {}

    def arithmetic(tensors, device):
        if device not in scalars:
            scalars[device] = group_scalars(group, device)
        return adam_update(*tensors, **scalars[device], adam_w_mode=adam_w_mode, capturable=capturable)

    def in_slices(u: Update) -> None:  # a large parameter a slice at a time; a non-contiguous one in one call
        size = UPDATE_SLICE if u.flat else max(u.numel, 1)
        for start in range(0, u.numel, size):
            parts = [t.view(-1)[start : start + size] if u.flat else t for t in u.tensors]
            for dst, value in zip(parts[1:], arithmetic(parts, u.device)):
                dst.copy_(value)
        finish(u)

    def together(batch: list[Update]) -> None:  # small parameters in one call, then each one's share written back
        flats = [[t.view(-1) for t in u.tensors] for u in batch]
        parts = flats[0] if len(batch) == 1 else [torch.cat(column) for column in zip(*flats)]
        new = arithmetic(parts, batch[0].device)
        start = 0
        for u, views in zip(batch, flats):
            for dst, value in zip(views[1:], new):
                dst.copy_(value[start : start + u.numel])
            start += u.numel
            finish(u)

    batch: list[Update] = []
    waiting = 0
    for u in updates:
        if u.numel >= UPDATE_SLICE or not u.flat:
            in_slices(u)
            continue
        if batch and (waiting + u.numel > UPDATE_SLICE or batch[0].device != u.device):
            together(batch)
            batch, waiting = [], 0
        batch.append(u)
        waiting += u.numel
    if batch:
        together(batch)
