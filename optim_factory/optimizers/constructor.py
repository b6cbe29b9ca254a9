"""Both FusedAdam constructors' checks in one call (:func:`check_constructor`): the Adam options and the export
options by the rules of :mod:`optim_factory.rules` (a ``"64MiB"`` chunk size parsed, options that take no effect
warned about)."""

from __future__ import annotations

from typing import Any

from optim_factory.optimizers.export.options import ExportOptions
from optim_factory.rules.adam import ADAM_ARGUMENTS, AdamOptions, check_adam_options
from optim_factory.rules.export import check_export_effect, parse_bytes

__all__ = ["check_constructor"]


def check_constructor(arguments: dict[str, Any]) -> tuple[AdamOptions, ExportOptions]:
    """Both FusedAdam constructors' checks, from their arguments (``locals()`` of ``__init__``, whose names are
    TE 2.20's plus the export options): the Adam options (:func:`check_adam_options`) and the frozen
    :class:`ExportOptions` (a ``"64MiB"`` chunk size parsed). Raises :class:`~optim_factory.errors.ConfigError`."""
    adam = check_adam_options(**{name: arguments[name] for name in ADAM_ARGUMENTS})
    export = ExportOptions.from_kwargs(
        arguments["state_dict_cpu_offload"],
        parse_bytes(arguments["state_dict_offload_chunk_bytes"], "state_dict_offload_chunk_bytes"),
        arguments["state_dict_offload_reuse_buffers"],
        arguments["state_dict_offload_pinning"],
        arguments["state_dict_keep_bf16"],
        arguments["state_dict_offload_background"],
    )
    check_export_effect(export, adam.exp_avg_dtype, adam.exp_avg_sq_dtype)
    return adam, export
