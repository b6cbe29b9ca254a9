"""optim-factory: TE FusedAdam with opt-in ``state_dict_cpu_offload``, a portable twin, and a Hydra factory."""

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


# Lazy: each name is imported from its module when first asked for. Importing torch takes seconds and Transformer
# Engine longer (the module that defines FusedAdam imports TE where it is installed), so `import optim_factory`, and
# the import of a light submodule such as optim_factory.config (the recipe's command line checks its config with it
# before torch is imported), runs neither.
_LAZY = {
    "FusedAdam": "optim_factory.optimizers.te_fused_adam",
    "PortableFusedAdam": "optim_factory.optimizers",
    "build_optimizer": "optim_factory.factory",
    "validate_optim_config": "optim_factory.factory",
    "ConfigError": "optim_factory.errors",
    "export_state": "optim_factory.optimizers",
    "load_exported_state": "optim_factory.optimizers",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # dir() lists the lazy names too, so help(optim_factory) and pydoc show them (importing them on that call).
    return sorted({*globals(), *_LAZY})
