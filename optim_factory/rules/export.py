"""The rules of the export options (``state_dict_cpu_offload`` and the options of its streamed export), written
once: what each accepts (:class:`Pinning`'s choices, chunk sizes as ints or ``"64MiB"``, flags), what each needs of
the others (:func:`check_export_options`, which ``ExportOptions.__post_init__`` runs), and the options a valid
optimizer takes without effect (:func:`check_export_effect`, a warning each). See docs/design.md, "Export options".
"""

from __future__ import annotations

import re
import warnings
from dataclasses import fields
from typing import Any

import torch

from optim_factory.errors import ConfigError
from optim_factory.rules.adam import DTYPE_SPELLINGS, check_flags
from optim_factory.rules.host import auto_host_budget
from optim_factory.rules.pinning import Pinning

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "Pinning",
    "check_export_effect",
    "check_export_options",
    "parse_bytes",
]

DEFAULT_CHUNK_BYTES = 64 << 20  # the chunk of ``state_dict_cpu_offload=True`` alone: the GPU holds 2 (128 MiB)
MIN_CHUNK_BYTES = 64  # one aligned piece; real budgets are MiBs


AUTO = "auto"  # state_dict_offload_host_budget: this rank's share of the host (optim_factory.rules.host)
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
    raise ConfigError(key, value, allowed)


def size_text(nbytes: int) -> str:
    """``nbytes`` as a size :func:`parse_bytes` reads back (``118MiB``), rounded up to a whole unit: the largest of
    GiB, MiB, KiB whose rounding adds at most 1 % (else bytes, ``B``), so that a least size stays one when pasted."""
    for unit in ("GiB", "MiB", "KiB"):
        whole = -(-nbytes // _UNITS[unit])
        if whole * _UNITS[unit] - nbytes <= nbytes / 100:
            return f"{whole}{unit}"
    return f"{nbytes}B"


def check_export_options(options: Any) -> tuple[int, Pinning, int | None]:
    """The rules of ``options`` (an ``ExportOptions``; named as the constructors spell them, from each field's
    metadata), in order: the offload a ``bool``; a chunk size ``None``, 0 or an int >= :data:`MIN_CHUNK_BYTES`, and
    only with the CPU offload; every other flag (a field whose default is a ``bool``) a ``bool``; reused buffers and
    the background export only with a chunked export; a :class:`Pinning` choice, other than ``register`` only with
    reused buffers; a host budget ``None`` or a size (:func:`parse_bytes`) of at least two chunks, only with a
    chunked export into fresh memory that is not filled in the background (pooled buffers keep a whole export; a
    background export fills all of it at once), or ``"auto"``: this rank's share of the host (``rules/host.py``,
    at least two chunks) in that mode, and no budget in the others. Returns the chunk size in bytes (0: nothing
    chunked), the pinning as a :class:`Pinning` and the budget in bytes."""
    cpu_offload, chunk_bytes, reuse_buffers = options.cpu_offload, options.chunk_bytes, options.reuse_buffers
    pinning, background = options.pinning, options.background
    check_flags(state_dict_cpu_offload=cpu_offload)
    chunk = chunk_bytes
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0 or 0 < chunk < MIN_CHUNK_BYTES:
            allowed = (
                f"expected None (the default, {DEFAULT_CHUNK_BYTES >> 20} MiB), 0 (one state at a time) or an int "
                f">= {MIN_CHUNK_BYTES} (bytes of converted data per chunk)"
            )
            raise ConfigError("state_dict_offload_chunk_bytes", chunk, allowed)
        if not cpu_offload:  # 0 included: without the offload nothing is exported in chunks or states
            needs = "needs state_dict_cpu_offload=True (chunked streaming is a mode of the CPU-offloaded export)"
            raise ConfigError("state_dict_offload_chunk_bytes", chunk, needs)
    chunk = (DEFAULT_CHUNK_BYTES if cpu_offload else 0) if chunk is None else chunk
    flags = [f for f in fields(options) if isinstance(f.default, bool) and f.name != "cpu_offload"]
    check_flags(**{f.metadata["option"]: getattr(options, f.name) for f in flags})  # a new flag is checked too
    for key, on in (("background", background), ("reuse_buffers", reuse_buffers)):
        if on and not chunk:
            needs = "state_dict_cpu_offload=True" if not cpu_offload else "state_dict_offload_chunk_bytes != 0"
            raise ConfigError(f"state_dict_offload_{key}", True, f"needs {needs} (a mode of the chunked export)")
    try:
        chosen = Pinning(pinning.value if isinstance(pinning, Pinning) else pinning)
    except ValueError:
        allowed = "|".join(p.value for p in Pinning)
        raise ConfigError("state_dict_offload_pinning", pinning, f"expected one of {allowed}") from None
    if chosen is not Pinning.register and not reuse_buffers:
        needs = "needs state_dict_offload_reuse_buffers=True (only pooled buffers are pinned)"
        raise ConfigError("state_dict_offload_pinning", chosen, needs, shown=chosen.value)
    return chunk, chosen, _check_budget(options.host_budget, chunk, reuse_buffers, background)


def _check_budget(value: Any, chunk: int, reuse_buffers: bool, background: bool) -> int | None:
    key = "state_dict_offload_host_budget"
    if value is None:
        return None
    if value == AUTO:  # this rank's share of the host (rules/host.py), where the export's mode has a budget
        return max(2 * chunk, auto_host_budget()) if chunk and not (reuse_buffers or background) else None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, str))
        or (isinstance(value, str) and not _SIZE.match(value))
    ):
        raise ConfigError(
            key, value, f"expected null (no cap), {AUTO} (a share of the host), bytes as an int or a size like 512MiB"
        )
    budget = parse_bytes(value, key)
    if not chunk:
        raise ConfigError(
            key, value, "needs a chunked export (state_dict_cpu_offload=True, state_dict_offload_chunk_bytes != 0)"
        )
    if reuse_buffers or background:
        other = "reuse_buffers" if reuse_buffers else "background"
        why = "keeps a whole export on the host" if reuse_buffers else "fills the whole export at once"
        raise ConfigError(key, value, f"cannot be combined with state_dict_offload_{other}=True, which {why}")
    if budget < 2 * chunk:
        raise ConfigError(
            key,
            value,
            f"expected at least two chunks of state_dict_offload_chunk_bytes={chunk} ({2 * chunk} bytes; a smaller "
            "chunk lowers it)",
        )
    return budget


def short_name(dtype: torch.dtype) -> str:
    """The first spelling of ``dtype`` in :data:`DTYPE_SPELLINGS` (``fp32``, ``bf16`` ...)."""
    return next(name for name, d in DTYPE_SPELLINGS.items() if d == dtype)


def check_export_effect(export: Any, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype) -> None:
    """Export options (an ``ExportOptions``) that a valid FusedAdam accepts without any effect: a ``UserWarning``
    each (moment dtypes as :func:`~optim_factory.rules.adam.check_state_dtypes` returns them)."""
    if export.keep_bf16 and torch.bfloat16 not in (exp_avg_dtype, exp_avg_sq_dtype):
        warnings.warn(
            "state_dict_keep_bf16=True has no effect: no optimizer state is BF16 (exp_avg_dtype="
            f"{short_name(exp_avg_dtype)}, exp_avg_sq_dtype={short_name(exp_avg_sq_dtype)})",
            UserWarning,
            stacklevel=1,  # one location: shown once per process, however many callers check the same config
        )
