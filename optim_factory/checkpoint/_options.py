"""``StagerOptions``: what an ``AsyncSaveStager`` does besides staging, given to it whole (as ``ExportOptions`` is to
the export, and DCP's ``StagingOptions`` to its stager), checked when it is made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["DEFAULT_EXPORT_TIMEOUT_S", "Check", "StagerOptions", "option_names"]

DEFAULT_EXPORT_TIMEOUT_S = 600.0
"""How long a save waits for a background export to fill before refusing it (``StagerOptions.export_timeout_s``)."""

Check = Callable[[dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class StagerOptions:
    """Attributes:
    refuse_non_finite: refuse a save whose state holds NaN or inf (``NON_FINITE_LINE``), each value read where it
        lives (``_finite_check.py``). Not with a host budget (its save is written while it is filled).
    check: called on the staging's completion thread with the filled staged state dict; a returned line refuses
        the save. Not with a host budget.
    pinned: the model's host copies of CUDA tensors in pinned memory kept from save to save.
    export_timeout_s: how long a save waits for a background export to fill before refusing it.
    """

    refuse_non_finite: bool = False
    check: Check | None = None
    pinned: bool = True
    export_timeout_s: float = DEFAULT_EXPORT_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("refuse_non_finite", "pinned"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"StagerOptions({name}=...): expected True or False, got {getattr(self, name)!r}")
        if self.check is not None and not callable(self.check):
            raise TypeError(f"StagerOptions(check=...): expected a function of the staged dict, got {self.check!r}")
        timeout = self.export_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise TypeError(f"StagerOptions(export_timeout_s=...): expected seconds > 0, got {timeout!r}")

    @property
    def checks_filled_state(self) -> bool:
        """Whether a save's filled state is read before it is written (which a host budget's save cannot be)."""
        return self.refuse_non_finite or self.check is not None


def option_names() -> set[str]:
    """The options' names: the stager's, never DCP's (``AsyncSaveStager.async_save`` refuses them)."""
    return {f.name for f in fields(StagerOptions)}
