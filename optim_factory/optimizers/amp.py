"""``torch.amp.GradScaler`` with a capturable FusedAdam, whose ``step(grad_scaler=...)`` unscales the gradients in
its kernels (``grad * 1 / scale``).

The usual gradient-clipping pattern, ``scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)``, unscales
them first: TE 2.20.2's ``step()`` then divides them by the scale a second time, and the parameters leave
``torch.optim.Adam``'s under the same scaler (the portable twin the same; docs/design.md, "Measured figures
behind the defaults"). :func:`scaler_for_step` hands
``step()`` a scaler that reports scale 1 for gradients already unscaled, and the scaler's own inf check, so the
step still skips on overflow and unscales once.

torch keeps the unscaled mark in ``GradScaler._per_optimizer_states[id(optimizer)]["stage"]`` (``OptState``), a
private attribute stable from torch 2.0 to 2.14; if it is missing, a warning says so once and the scaler is used
as given (TE's behaviour). torch 2.13 warns that ``GradScaler`` will stop passing ``grad_scaler=`` and set
``opt.grad_scale`` / ``opt.found_inf`` instead; neither TE 2.20.2's step nor ours reads those (not handled here).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

__all__ = ["scaler_for_step"]


def _grads_unscaled(grad_scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    try:
        from torch.amp.grad_scaler import OptState

        state = grad_scaler._per_optimizer_states.get(id(optimizer))  # (a defaultdict: .get adds nothing)
    except (ImportError, AttributeError):
        _warn_unknown_scaler(type(grad_scaler))
        return False
    return state is not None and state.get("stage") is OptState.UNSCALED


@functools.cache
def _warn_unknown_scaler(kind: type) -> None:
    warnings.warn(
        f"{kind.__name__} keeps no _per_optimizer_states (torch {torch.__version__}): FusedAdam cannot tell whether "
        "scaler.unscale_ ran before scaler.step; after it, the capturable step unscales the gradients a second time",
        UserWarning,
        stacklevel=4,
    )


class _AlreadyUnscaled:
    """A ``GradScaler`` as FusedAdam's capturable step reads it, for gradients ``unscale_`` already unscaled: the
    same inf check (of the unscaled gradients), scale 1."""

    def __init__(self, grad_scaler: Any) -> None:
        self._scaler = grad_scaler

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._scaler._check_inf_per_device(optimizer)

    def _get_scale_async(self) -> torch.Tensor:
        return torch.ones_like(self._scaler._get_scale_async())


def scaler_for_step(grad_scaler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The ``grad_scaler`` a capturable ``step()`` should use: itself, or for gradients it already unscaled
    (``scaler.unscale_(optimizer)`` before ``scaler.step(optimizer)``) one whose scale is 1."""
    if grad_scaler is not None and _grads_unscaled(grad_scaler, optimizer):
        return _AlreadyUnscaled(grad_scaler)
    return grad_scaler
