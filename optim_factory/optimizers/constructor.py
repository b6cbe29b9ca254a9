"""Both FusedAdam constructors' checks in one call (:func:`check_constructor`): the Adam options by the rules of
optim_factory/optimizers/rules.py, and the export options, a ``"64MiB"`` chunk size parsed (:func:`parse_bytes`)
and options that take no effect warned about (:func:`check_export_effect`); :func:`export_options`, the one way the
constructors and the factory build ``ExportOptions``."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from optim_factory.optimizers.export.options import DEFAULT_CHUNK_BYTES, OPTION_NAMES, ExportOptions
from optim_factory.optimizers.rules import ADAM_ARGUMENTS, DTYPE_SPELLINGS, AdamOptions, OptionError, check_adam_options

__all__ = ["check_constructor", "check_export_effect", "export_arguments", "export_options", "parse_bytes"]

_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_bytes(value: Any, key: str) -> int | None:
    """``None``, an int, or a string like ``"64MiB"`` (units B, KiB, MiB, GiB) -> bytes."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and (m := _SIZE.match(value)):
        return int(m.group(1)) * _UNITS[m.group(2)]
    default = f"{DEFAULT_CHUNK_BYTES >> 20}MiB"
    allowed = (
        f"expected null (the default: {default} chunks), 0 (one state at a time), bytes as an int or a size like 64MiB"
    )
    raise OptionError(key, value, allowed)


def short_name(dtype: torch.dtype) -> str:
    """The first spelling of ``dtype`` in :data:`DTYPE_SPELLINGS` (``fp32``, ``bf16`` ...)."""
    return next(name for name, d in DTYPE_SPELLINGS.items() if d == dtype)


def check_export_effect(export: ExportOptions, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype) -> None:
    """Export options that a valid FusedAdam accepts without any effect: a ``UserWarning`` each (moment dtypes as
    :func:`check_state_dtypes` returns them)."""
    if export.keep_bf16 and torch.bfloat16 not in (exp_avg_dtype, exp_avg_sq_dtype):
        warnings.warn(
            "state_dict_keep_bf16=True has no effect: no optimizer state is BF16 (exp_avg_dtype="
            f"{short_name(exp_avg_dtype)}, exp_avg_sq_dtype={short_name(exp_avg_sq_dtype)})",
            UserWarning,
            stacklevel=1,  # one location: shown once per process, however many callers check the same config
        )


def export_arguments(values: Mapping[str, Any]) -> dict[str, Any]:
    """The export options in ``values`` (a constructor's arguments, a config node) by the names users spell
    (``OPTION_NAMES``), as the constructors take them: a ``"64MiB"`` chunk size parsed into bytes."""
    arguments = {option: values[option] for option in OPTION_NAMES}
    chunk = "state_dict_offload_chunk_bytes"
    arguments[chunk] = parse_bytes(arguments[chunk], chunk)
    return arguments


def export_options(values: Mapping[str, Any]) -> ExportOptions:
    """The frozen :class:`ExportOptions` of ``values`` (see :func:`export_arguments`); raises :class:`OptionError` or
    ``ValueError``."""
    return ExportOptions.from_options(export_arguments(values))


def check_constructor(arguments: dict[str, Any]) -> tuple[AdamOptions, ExportOptions]:
    """Both FusedAdam constructors' checks, from their arguments (``locals()`` of ``__init__``, whose names are
    TE 2.20's plus the export options): the Adam options (:func:`check_adam_options`) and the frozen
    :class:`ExportOptions` (a ``"64MiB"`` chunk size parsed). Raises :class:`OptionError` or ``ValueError``."""
    adam = check_adam_options(**{name: arguments[name] for name in ADAM_ARGUMENTS})
    export = export_options(arguments)
    check_export_effect(export, adam.exp_avg_dtype, adam.exp_avg_sq_dtype)
    return adam, export
