"""optim-factory inside other training frameworks (docs/drop-in.md): ``optim_factory.integrations.torchtitan``
(torchtitan 0.3's optimizer container and checkpoint manager) and ``optim_factory.integrations.automodel``
(NeMo Automodel 0.7's checkpointer). Each module imports its framework; ``import optim_factory`` imports none."""

from __future__ import annotations

from importlib import metadata

from optim_factory.errors import first_line

__all__ = ["SUPPORTED", "framework_import_error"]

SUPPORTED = {"torchtitan": "0.3", "nemo-automodel": "0.7"}
"""The release series each integration is written and tested for (tests/integrations/requirements.txt pins one)."""


def framework_import_error(distribution: str, exc: ImportError) -> ImportError:
    """The one-line error of an integration whose framework does not import: the version found (or none) and the
    one the integration is written for, then the import's own first line."""
    needed = SUPPORTED[distribution]
    try:
        found = f"{distribution} {metadata.version(distribution)} is installed"
    except metadata.PackageNotFoundError:
        found = f"{distribution} is not installed"
    return ImportError(f"optim_factory.integrations needs {distribution} {needed}; {found} ({first_line(exc)})")
