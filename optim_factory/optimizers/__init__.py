"""Optimizers: the TE subclass, its portable twin, and the export path they share."""

from optim_factory.optimizers.export import export_state, load_exported_state
from optim_factory.optimizers.portable import PortableFusedAdam

__all__ = ["PortableFusedAdam", "export_state", "load_exported_state", "FusedAdam"]


def __getattr__(name: str):
    # Lazy: importing Transformer Engine is slow and optional.
    if name == "FusedAdam":
        from optim_factory.optimizers.te_fused_adam import FusedAdam

        return FusedAdam
    raise AttributeError(name)
