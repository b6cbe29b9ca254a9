"""optim-factory: TE FusedAdam with opt-in ``state_dict_cpu_offload``, a portable twin, and a Hydra factory."""

from optim_factory.factory import ConfigError, build_optimizer, validate_optim_config
from optim_factory.optimizers import PortableFusedAdam, export_state, load_exported_state

__version__ = "0.1.0"
__all__ = [
    "FusedAdam",
    "PortableFusedAdam",
    "build_optimizer",
    "validate_optim_config",
    "ConfigError",
    "export_state",
    "load_exported_state",
    "__version__",
]


def __getattr__(name: str):
    # Lazy: importing Transformer Engine is slow and optional. The module that defines FusedAdam imports TE where
    # it is installed, so `import optim_factory` leaves that module alone until FusedAdam is asked for.
    if name == "FusedAdam":
        from optim_factory.optimizers.te_fused_adam import FusedAdam

        return FusedAdam
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # dir() lists the lazy FusedAdam too, so help(optim_factory) and pydoc show it (importing it on that call).
    return sorted({*globals(), "FusedAdam"})
