"""The export options: one frozen, validated object per optimizer.

``ExportOptions`` is built once from the optimizer's keyword-only constructor arguments, whose names each field
carries (:data:`OPTION_NAMES`: ``state_dict_cpu_offload`` for ``cpu_offload`` ...; the config keys are the same);
an impossible combination raises one ``ConfigError`` line naming the option (the rules:
:mod:`optim_factory.rules.export`). The factory validates configs with the same class. See docs/design.md,
"Export options".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from optim_factory.rules.export import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, Pinning, check_export_options, size_text

__all__ = ["ExportOptions", "Pinning", "OPTION_NAMES", "DEFAULT_CHUNK_BYTES", "MIN_CHUNK_BYTES"]


def _option(name: str, default: Any) -> Any:
    """A field of :class:`ExportOptions` with ``name``, the name users spell it by (constructor keyword, config key)."""
    return field(default=default, metadata={"option": name})


@dataclass(frozen=True)
class ExportOptions:
    """What ``state_dict()`` does (the keyword-only export options of both FusedAdam backends).

    Attributes:
        cpu_offload: export to CPU instead of TE's on-device FP32 copies, streamed in chunks.
        chunk_bytes: with ``cpu_offload``, stream the export in chunks of at most this many bytes of converted
            data; the accelerator holds at most two chunks. ``None`` (the default): ``DEFAULT_CHUNK_BYTES`` with
            ``cpu_offload``, else 0. ``0``: one whole state at a time (bitwise the same export, with a GPU
            peak of the largest converted state). After construction an int: 0 when nothing is chunked.
        reuse_buffers: with a chunked export, export into pooled host buffers that ``release_state_dict`` gives
            back for the next export.
        pinning: with ``reuse_buffers``, how pooled buffers of CUDA states get pinned (:class:`Pinning`).
        keep_bf16: export BF16 states as BF16 (no conversion, half the bytes) instead of FP32; in every mode.
            TE's own class cannot load such an export; both classes of this package can.
        background: with a chunked export, ``state_dict()`` returns at once with the host tensors allocated and a
            background thread fills them (side streams on CUDA); ``step()``, ``load_state_dict()`` and the next
            ``state_dict()`` wait for it, ``wait_state_dict()`` waits and re-raises its failure.
        host_budget: with a chunked export into fresh memory, the most bytes of host memory a save through
            ``optim_factory.checkpoint.BudgetSavePlanner`` holds at once (at least two chunks); ``None``: no cap;
            ``"auto"``: this rank's share of the host's available memory (:mod:`optim_factory.rules.host`), and
            no cap where the export's mode has none (no chunks, reused buffers, the background export). After
            construction bytes or ``None``.
    """

    cpu_offload: bool = _option("state_dict_cpu_offload", False)
    chunk_bytes: int | None = _option("state_dict_offload_chunk_bytes", None)
    reuse_buffers: bool = _option("state_dict_offload_reuse_buffers", False)
    pinning: Pinning = _option("state_dict_offload_pinning", Pinning.register)
    keep_bf16: bool = _option("state_dict_keep_bf16", False)
    background: bool = _option("state_dict_offload_background", False)
    host_budget: int | None = _option("state_dict_offload_host_budget", None)

    def __post_init__(self) -> None:
        chunk, pinning, budget = check_export_options(self)
        object.__setattr__(self, "chunk_bytes", chunk)
        object.__setattr__(self, "pinning", pinning)
        object.__setattr__(self, "host_budget", budget)

    @property
    def defers(self) -> bool:
        """Whether an export inside ``deferred_state_dict()`` returns before its host tensors are filled, into pooled
        buffers nothing else writes until they are released (``background`` with ``reuse_buffers``): a stager may
        pass those through uncopied once the export has filled them."""
        return self.background and self.reuse_buffers

    def pinning_on(self, device_type: str) -> Pinning:
        """How a pooled host buffer of a state on a device of ``device_type`` is pinned: :attr:`pinning` for a
        GPU's (``"cuda"``), none for the host's."""
        return self.pinning if device_type == "cuda" else Pinning.none

    def describe(self) -> str:
        """What ``state_dict()`` does, in a few words (the factory logs it)."""
        if not self.cpu_offload:
            return "on the device, FP32" + (", BF16 kept" if self.keep_bf16 else "")
        if not self.chunk_bytes:
            how = ["to CPU, one state at a time"]
        else:
            how = [f"to CPU in chunks of {size_text(self.chunk_bytes)}"]
            how.append(
                f"reused host buffers (pinning {self.pinning.value})" if self.reuse_buffers else "fresh host memory"
            )
        how += ["BF16 kept"] if self.keep_bf16 else []
        how += ["in the background"] if self.background else []
        how += (
            [f"budgeted saves (optim_factory.checkpoint) within {size_text(self.host_budget)}"]
            if self.host_budget
            else []
        )
        return ", ".join(how)

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> ExportOptions:
        """Build from ``values`` by the names users spell (:data:`OPTION_NAMES`: a constructor's arguments, a
        config); other keys are ignored. Both constructors and the factory build their options this way
        (``constructor.export_options``)."""
        return cls(**{name: values[option] for option, name in OPTION_NAMES.items()})


OPTION_NAMES: dict[str, str] = {f.metadata["option"]: f.name for f in fields(ExportOptions)}
"""The export options by the names users spell (constructor keywords, config keys) -> :class:`ExportOptions`'
fields, in the fields' order: ``{"state_dict_cpu_offload": "cpu_offload", ...}``."""
