"""FusedAdam: Transformer Engine's FusedAdam with an opt-in ``state_dict_cpu_offload``.

TE is an optional dependency. Without it this module still imports, and constructing :class:`FusedAdam`
raises one :class:`ImportError` that says how to install TE and points to :class:`PortableFusedAdam`.
"""

from __future__ import annotations

from typing import Any

import torch

from optim_factory.optimizers.export import export_state, load_exported_state

__all__ = ["FusedAdam", "TE_AVAILABLE", "te_import_error"]

try:  # TE can fail with ImportError, or with other errors from a broken install; report either.
    from transformer_engine.pytorch.optimizers import FusedAdam as _TEFusedAdam

    TE_AVAILABLE = True
    _TE_ERROR: BaseException | None = None
except Exception as exc:  # noqa: BLE001
    _TEFusedAdam = torch.optim.Optimizer  # type: ignore[assignment,misc]
    TE_AVAILABLE = False
    _TE_ERROR = exc

TE_INSTALL_HINT = (
    "optim_factory.FusedAdam needs NVIDIA Transformer Engine (a CUDA machine): "
    "pip install --no-build-isolation 'transformer_engine[pytorch]' "
    "(see https://github.com/NVIDIA/TransformerEngine); "
    "without TE, use optim_factory.PortableFusedAdam (pure PyTorch, same options) or backend=portable"
)


def te_import_error() -> str | None:
    """Why Transformer Engine could not be imported (``None`` when it was)."""
    return None if _TE_ERROR is None else f"{type(_TE_ERROR).__name__}: {_TE_ERROR}"


class FusedAdam(_TEFusedAdam):  # type: ignore[misc,valid-type]
    """``transformer_engine.pytorch.optimizers.FusedAdam`` plus keyword-only ``state_dict_cpu_offload``.

    With ``state_dict_cpu_offload=False`` (default) ``state_dict()`` is TE's own. With ``True`` it streams
    each converted FP32 state to CPU one at a time, so the GPU never holds more than the largest single
    FP32 state during export (see :mod:`optim_factory.optimizers.export`). Everything else, including the
    CUDA kernels of ``step()``, is TE's.
    """

    def __init__(self, params, *args: Any, state_dict_cpu_offload: bool = False, **kwargs: Any):
        if not TE_AVAILABLE:
            raise ImportError(f"{TE_INSTALL_HINT} (import failed: {te_import_error()})")
        super().__init__(params, *args, **kwargs)
        self.state_dict_cpu_offload = bool(state_dict_cpu_offload)

    def state_dict(self) -> dict[str, Any]:
        """TE's ``state_dict()``, or the per-state CPU-offloaded export when the option is on."""
        if self.state_dict_cpu_offload:
            return export_state(self, cpu_offload=True)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load CPU or GPU, plain or DTensor states, one state at a time (see ``load_exported_state``)."""
        load_exported_state(self, state_dict)
