"""Deprecated: ``optim_factory.async_save`` is ``optim_factory.checkpoint`` now (its one face); this module re-exports
what the docs named here, for one release, with a ``DeprecationWarning``."""

import warnings

from optim_factory.checkpoint import AsyncSaveStager, SaveRefused

__all__ = ["AsyncSaveStager", "SaveRefused"]

warnings.warn(
    "optim_factory.async_save is deprecated and will be removed in the next release: "
    "import AsyncSaveStager and SaveRefused from optim_factory.checkpoint",
    DeprecationWarning,
    stacklevel=2,
)
