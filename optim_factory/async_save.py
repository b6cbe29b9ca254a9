"""Deprecated: ``optim_factory.async_save`` is ``optim_factory.checkpoint`` now (its one face); this module re-exports
what it exported, for one release, with a ``DeprecationWarning``."""

import warnings

from optim_factory.checkpoint import (
    DEFAULT_EXPORT_TIMEOUT_S,
    EXPORT_FAILED_LINE,
    NON_FINITE_LINE,
    AsyncSaveStager,
    SaveRefused,
)

__all__ = ["AsyncSaveStager", "SaveRefused", "DEFAULT_EXPORT_TIMEOUT_S", "EXPORT_FAILED_LINE", "NON_FINITE_LINE"]

warnings.warn(
    "optim_factory.async_save is deprecated and will be removed in the next release: "
    "import its names (AsyncSaveStager, SaveRefused ...) from optim_factory.checkpoint",
    DeprecationWarning,
    stacklevel=2,
)
