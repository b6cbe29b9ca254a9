"""Both FusedAdam constructors' checks in one call (:func:`check_constructor`): the Adam options and the export
options by the rules of :mod:`optim_factory.rules` (a ``"64MiB"`` chunk size parsed, options that take no effect
warned about); :func:`export_options`, the one way the constructors and the factory build ``ExportOptions``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optim_factory.optimizers.export.options import OPTION_NAMES, ExportOptions
from optim_factory.rules.adam import ADAM_ARGUMENTS, AdamOptions, check_adam_options
from optim_factory.rules.export import check_export_effect, parse_bytes

__all__ = ["check_constructor", "export_arguments", "export_options"]


def export_arguments(values: Mapping[str, Any]) -> dict[str, Any]:
    """The export options in ``values`` (a constructor's arguments, a config node) by the names users spell
    (``OPTION_NAMES``), as the constructors take them: a ``"64MiB"`` chunk size parsed into bytes."""
    arguments = {option: values[option] for option in OPTION_NAMES}
    chunk = "state_dict_offload_chunk_bytes"
    arguments[chunk] = parse_bytes(arguments[chunk], chunk)
    return arguments


def export_options(values: Mapping[str, Any]) -> ExportOptions:
    """The frozen :class:`ExportOptions` of ``values`` (see :func:`export_arguments`); raises
    :class:`~optim_factory.errors.ConfigError`."""
    return ExportOptions.from_options(export_arguments(values))


def check_constructor(arguments: dict[str, Any]) -> tuple[AdamOptions, ExportOptions]:
    """Both FusedAdam constructors' checks, from their arguments (``locals()`` of ``__init__``, whose names are
    TE 2.20's plus the export options): the Adam options (:func:`check_adam_options`) and the frozen
    :class:`ExportOptions` (a ``"64MiB"`` chunk size parsed). Raises :class:`~optim_factory.errors.ConfigError`."""
    adam = check_adam_options(**{name: arguments[name] for name in ADAM_ARGUMENTS})
    export = export_options(arguments)
    check_export_effect(export, adam.exp_avg_dtype, adam.exp_avg_sq_dtype)
    return adam, export
