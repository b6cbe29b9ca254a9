"""Config → optimizer: schema and cross-field validation, backend choice, dtype strings, parameter groups.

``build_optimizer(cfg, model)`` is the one entry point. ``validate_optim_config(cfg)`` runs every check that
needs no model, so a recipe can call it before it builds anything heavy; it returns a :class:`ValidatedOptim`
(read-only), which ``build_optimizer`` takes as it is, without validating again. Every bad value raises
:class:`ConfigError` with one line: which key, which value, what is allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optim_factory.config import (
    DEFAULT_NO_DECAY,
    OPTIM_SCHEMAS,
    AdamWConfig,
    FusedAdamConfig,
    StateDtype,
    omegaconf_error_line,
    schema_keys,
)
from optim_factory.optimizers.export import ExportOptions, Pinning, local_tensor
from optim_factory.optimizers.rules import OptionError, check_state_dtypes, parse_bytes, parse_dtype

__all__ = [
    "ConfigError",
    "ValidatedOptim",
    "build_optimizer",
    "validate_optim_config",
    "parse_dtype",
    "build_param_groups",
    "choose_backend",
]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad optimizer config value: one line naming the key, the value and what is allowed."""


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    if isinstance(value, Enum):  # a schema choice: its YAML spelling
        value = value.value
    return ConfigError(f"optim.{key}={value!r}: {allowed}")


@dataclass(frozen=True)
class ValidatedOptim:
    """The result of :func:`validate_optim_config`, accepted by :func:`build_optimizer` as it is.

    Attributes:
        config: the typed optimizer config (an OmegaConf node of :class:`FusedAdamConfig` or :class:`AdamWConfig`,
            read-only: assigning to it raises), exactly as given: ``"64MiB"`` stays ``"64MiB"``.
        kwargs: the optimizer constructor's keyword arguments derived from it (dtypes and byte sizes parsed),
            a read-only mapping.
    """

    config: DictConfig
    kwargs: Mapping[str, Any]

    @property
    def name(self) -> str:
        """``fused_adam`` or ``adamw``."""
        return self.config.name


# ----------------------------------------------------------------------------------------------- validation
def _to_schema(cfg: Any) -> DictConfig:
    """Any of OmegaConf node / dataclass / mapping → a new read-only node typed by its schema.

    The input is read, never changed. Every key is checked against the schema, also keys a Hydra ``+key=value``
    override added to a typed node; an unknown key's error names the nearest valid key.
    """
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = OmegaConf.structured(cfg)
    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)  # a plain copy: extra keys are no longer let through
        except OmegaConfBaseException as exc:
            raise ConfigError(omegaconf_error_line(exc, "optim.")) from None
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"optim: expected a mapping, an OmegaConf node or a dataclass, got {type(cfg).__name__}")
    name = cfg.get("name", "fused_adam")
    if name not in OPTIM_SCHEMAS:
        raise _fail("name", name, f"expected one of {'|'.join(OPTIM_SCHEMAS)}")
    schema = OPTIM_SCHEMAS[name]
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), _spell_dtypes(cfg))
        OmegaConf.to_object(node)  # raises on missing mandatory values (an override without its pattern)
    except OmegaConfBaseException as exc:
        raise ConfigError(omegaconf_error_line(exc, "optim.", schema_keys(schema))) from None
    OmegaConf.set_readonly(node, True)
    return node


def _spell_dtypes(cfg: Mapping) -> dict:
    """A copy with dtype options given as the constructors take them (``torch.bfloat16``, ``"torch.bfloat16"``,
    ``"bfloat16"``) spelled as the schema's :class:`StateDtype`; other values stay, for the schema to refuse."""
    spelling = {parse_dtype(m): m for m in StateDtype}
    out = dict(cfg)
    for key in ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = out.get(key)
        if value is not None and not (isinstance(value, str) and value in StateDtype.__members__):
            try:
                out[key] = spelling.get(parse_dtype(value, key), value)
            except OptionError:
                pass
    return out


def _check_number(key: str, value: Any, *, positive: bool = False, lo: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(key, value, "expected a finite number")
    if positive and value <= 0:
        raise _fail(key, value, "must be > 0")
    if lo is not None and value < lo:
        raise _fail(key, value, f"must be >= {lo}")
    return float(value)


def _check_patterns(key: str, patterns: Iterable[str]) -> None:
    for i, pattern in enumerate(patterns):
        if not isinstance(pattern, str) or not pattern:
            raise _fail(f"{key}[{i}]", pattern, "expected a non-empty regular expression")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _fail(f"{key}[{i}]", pattern, f"not a valid regular expression ({exc})") from None


def validate_optim_config(cfg: Any) -> ValidatedOptim:
    """Check everything that needs no model; return the typed, read-only config and the constructor arguments.

    A pure function: ``cfg`` is not changed, and neither is the result afterwards. Call it once and hand the
    result to :func:`build_optimizer`. Raises :class:`ConfigError`. Warns (``UserWarning``) where an option
    silently has no effect (remainders without an FP32 master).
    """
    c = _to_schema(cfg)
    _check_number("lr", c.lr, positive=True)
    if len(c.betas) != 2:
        raise _fail("betas", list(c.betas), "expected two numbers [beta1, beta2], each in [0, 1)")
    for i, beta in enumerate(c.betas):
        _check_number(f"betas[{i}]", beta)
        if not 0.0 <= beta < 1.0:
            raise _fail(f"betas[{i}]", beta, "must be in [0, 1)")
    _check_number("eps", c.eps, lo=0.0)
    _check_number("weight_decay", c.weight_decay, lo=0.0)
    _check_patterns("param_groups.no_decay", c.param_groups.no_decay)
    _check_patterns("param_groups.overrides.pattern", [o.pattern for o in c.param_groups.overrides])
    for i, o in enumerate(c.param_groups.overrides):
        _check_number(f"param_groups.overrides[{i}].lr_mult", o.lr_mult, positive=True)
        _check_number(f"param_groups.overrides[{i}].weight_decay_mult", o.weight_decay_mult, lo=0.0)
    if OmegaConf.get_type(c) is AdamWConfig:
        kwargs = dict(lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay, amsgrad=c.amsgrad)
        return ValidatedOptim(c, MappingProxyType({**kwargs, "foreach": c.foreach}))

    if c.amsgrad:
        raise _fail("amsgrad", c.amsgrad, "FusedAdam does not support AMSGrad; use optim=adamw for it")
    try:  # the optimizers' own dtype / capturable / master-weight rules (one source: optimizers/rules.py)
        check_state_dtypes(
            master_weights=c.master_weights,
            master_weight_dtype=c.master_weight_dtype,
            exp_avg_dtype=c.exp_avg_dtype,
            exp_avg_sq_dtype=c.exp_avg_sq_dtype,
            capturable=c.capturable,
            store_param_remainders=c.store_param_remainders,
        )
    except OptionError as exc:
        raise _fail(exc.key, exc.value, exc.allowed) from None
    try:  # the optimizers' own rules for the export options, checked before anything is built
        chunk = parse_bytes(c.state_dict_offload_chunk_bytes, "state_dict_offload_chunk_bytes")
        ExportOptions(
            c.state_dict_cpu_offload,
            chunk,
            c.state_dict_offload_reuse_buffers,
            Pinning(c.state_dict_offload_pinning),
            c.state_dict_keep_bf16,
        )
    except ValueError as exc:
        raise ConfigError(f"optim.{exc}") from None
    return ValidatedOptim(c, MappingProxyType(_fused_adam_kwargs(c, chunk)))


# --------------------------------------------------------------------------------------------- param groups
@dataclass
class GroupSummary:
    """One optimizer group as logged: its members and hyperparameters."""

    label: str
    names: list[str]
    numel: int
    lr: float
    weight_decay: float

    def line(self, index: int) -> str:
        return (
            f"param group {index} [{self.label}]: {len(self.names)} tensors, {self.numel:,} elements, "
            f"lr={self.lr:g}, weight_decay={self.weight_decay:g}"
        )


def _named_trainable(model_or_params: Any) -> list[tuple[str, torch.nn.Parameter]]:
    if isinstance(model_or_params, torch.nn.Module):
        named = list(model_or_params.named_parameters())
    else:
        named = list(model_or_params)
        if named and not (isinstance(named[0], tuple) and len(named[0]) == 2):
            raise ConfigError("build_optimizer: pass an nn.Module or an iterable of (name, parameter) pairs")
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ConfigError("build_optimizer: the model has no trainable parameters")
    return trainable


def _no_decay_module_types() -> list[tuple[type, str]]:
    """Module types whose own parameters get no weight decay: embeddings and normalization layers.

    TE's LayerNorm / RMSNorm count when Transformer Engine is already imported (a model that holds them has
    imported it; this never imports TE itself). Norm classes of other libraries (e.g. Hugging Face's
    ``LlamaRMSNorm``) are caught by the 1-D rule: their weights have one dimension.
    """
    nn = torch.nn
    names = ["Embedding", "EmbeddingBag", "LayerNorm", "RMSNorm", "GroupNorm", "LocalResponseNorm"]
    kinds = ("BatchNorm", "InstanceNorm", "LazyBatchNorm", "LazyInstanceNorm")
    names += [f"{kind}{d}d" for kind in kinds for d in "123"] + ["SyncBatchNorm"]
    types = [(getattr(nn, n), f"nn.{n}") for n in names if hasattr(nn, n)]  # nn.RMSNorm: torch >= 2.4
    te = sys.modules.get("transformer_engine.pytorch")
    types += [(getattr(te, n), f"te.{n}") for n in ("LayerNorm", "RMSNorm") if isinstance(getattr(te, n, None), type)]
    return types


def _no_decay_reasons(
    cfg: FusedAdamConfig | AdamWConfig, named: list[tuple[str, torch.nn.Parameter]], module: torch.nn.Module | None
) -> dict[str, str]:
    """Parameter name -> why its weight decay is 0, first reason wins: module type, fewer than 2 dims, pattern.

    A ``no_decay`` pattern that matches no parameter is logged as a warning, unless it is one of the schema's
    default patterns (those cover names a model may not have, so they stay quiet).
    """
    pg = cfg.param_groups
    by_type: dict[int, str] = {}
    if pg.no_decay_auto and module is not None:
        types = _no_decay_module_types()
        for m in module.modules():
            label = next((lbl for cls, lbl in types if isinstance(m, cls)), None)
            if label is not None:
                for p in m.parameters(recurse=False):
                    by_type.setdefault(id(p), label)
    patterns = [(pattern, re.compile(pattern)) for pattern in pg.no_decay]
    used = {pattern: False for pattern, _ in patterns}
    reasons: dict[str, str] = {}
    for name, param in named:
        hits = [pattern for pattern, rx in patterns if rx.search(name)]
        for pattern in hits:
            used[pattern] = True
        if id(param) in by_type:
            reasons[name] = by_type[id(param)]
        elif pg.no_decay_auto and param.ndim < 2:
            reasons[name] = "1-D" if param.ndim == 1 else f"{param.ndim}-D"
        elif hits:
            reasons[name] = f"pattern {hits[0]!r}"
    for i, pattern in enumerate(pg.no_decay):
        if not used[pattern] and pattern not in DEFAULT_NO_DECAY:
            log.warning("optim.param_groups.no_decay[%d]=%r matches no parameter", i, pattern)
    return reasons


def build_param_groups(
    cfg: ValidatedOptim | FusedAdamConfig | AdamWConfig,
    named: list[tuple[str, torch.nn.Parameter]],
    module: torch.nn.Module | None = None,
) -> tuple[list[dict], list[GroupSummary]]:
    """Split parameters into groups: weight decay off where a no-decay rule applies, per-pattern multipliers.

    No weight decay (with ``param_groups.no_decay_auto``, the default): parameters of embedding and
    normalization modules (see :func:`_no_decay_module_types`; needs ``module``, so it applies when
    ``build_optimizer`` gets an ``nn.Module``) and every parameter with fewer than 2 dimensions; the
    ``no_decay`` name patterns add to that. With (name, parameter) pairs only, the 1-D and name rules apply.

    Every trainable parameter lands in exactly one group (checked). An override pattern that matches nothing,
    or two override patterns matching one parameter, raise; a user-given ``no_decay`` pattern matching nothing
    is logged as a warning. Each group's summary says why it exists (e.g. ``no decay: nn.Embedding (2), 1-D (9)``).
    """
    if isinstance(cfg, ValidatedOptim):
        cfg = cfg.config
    pg = cfg.param_groups
    overrides = [(re.compile(o.pattern), o) for o in pg.overrides]
    used_override = [False] * len(overrides)
    reasons = _no_decay_reasons(cfg, named, module)
    buckets: dict[tuple[int, bool], list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in named:
        hits = [i for i, (rx, _) in enumerate(overrides) if rx.search(name)]
        if len(hits) > 1:
            pats = ", ".join(repr(overrides[i][1].pattern) for i in hits)
            raise _fail("param_groups.overrides", pats, f"patterns overlap on parameter {name!r}; make them disjoint")
        for i in hits:
            used_override[i] = True
        buckets.setdefault((hits[0] if hits else -1, name in reasons), []).append((name, param))
    for i, used in enumerate(used_override):
        if not used:
            raise _fail(
                f"param_groups.overrides[{i}].pattern", overrides[i][1].pattern, "matches no trainable parameter"
            )

    groups, summaries = [], []
    for (override, decay_off), members in sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        o = overrides[override][1] if override >= 0 else None
        lr = cfg.lr * (o.lr_mult if o else 1.0)
        wd = 0.0 if decay_off else cfg.weight_decay * (o.weight_decay_mult if o else 1.0)
        label = f"override {o.pattern!r}" if o else "default"
        if decay_off:
            why = Counter(reasons[n] for n, _ in members)  # listed as the rules rank: type, dimensions, pattern
            rank = sorted(why, key=lambda r: (r.startswith("pattern"), r.endswith("-D"), r))
            label += ", no decay: " + ", ".join(f"{r} ({why[r]})" for r in rank)
        groups.append({"params": [p for _, p in members], "lr": lr, "weight_decay": wd})
        summaries.append(GroupSummary(label, [n for n, _ in members], sum(p.numel() for _, p in members), lr, wd))
    assert sum(len(g["params"]) for g in groups) == len(named) == len({id(p) for _, p in named})
    return groups, summaries


# ------------------------------------------------------------------------------------------------- backends
def choose_backend(requested: str, params: list[torch.Tensor]) -> tuple[str, str]:
    """``auto|te|portable`` → (``te`` or ``portable``, the reason). ``te`` without TE raises."""
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE, TE_INSTALL_HINT, te_import_error

    on_cuda = bool(params) and all(local_tensor(p).device.type == "cuda" for p in params)
    if requested == "portable":
        return "portable", "backend=portable requested"
    if requested == "te":
        if not TE_AVAILABLE:
            raise _fail(
                "backend", "te", f"Transformer Engine is not importable ({te_import_error()}); {TE_INSTALL_HINT}"
            )
        if not on_cuda:
            raise _fail("backend", "te", "TE's FusedAdam needs CUDA parameters; use backend=portable or auto on CPU")
        return "te", "backend=te requested"
    if TE_AVAILABLE and on_cuda:
        return "te", "auto: Transformer Engine is importable and the parameters are on CUDA"
    if not TE_AVAILABLE:
        return "portable", f"auto: Transformer Engine is not importable ({te_import_error()})"
    return "portable", "auto: the parameters are not on CUDA"


def _fused_adam_kwargs(c: DictConfig, chunk_bytes: int | None) -> dict[str, Any]:
    """The FusedAdam constructor's arguments from a schema-typed config (dtypes parsed; chunk size in bytes)."""
    return dict(
        lr=c.lr,
        betas=tuple(c.betas),
        eps=c.eps,
        weight_decay=c.weight_decay,
        amsgrad=c.amsgrad,
        bias_correction=c.bias_correction,
        adam_w_mode=c.adam_w_mode,
        capturable=c.capturable,
        master_weights=c.master_weights,
        master_weight_dtype=parse_dtype(c.master_weight_dtype, "master_weight_dtype"),
        exp_avg_dtype=parse_dtype(c.exp_avg_dtype, "exp_avg_dtype"),
        exp_avg_sq_dtype=parse_dtype(c.exp_avg_sq_dtype, "exp_avg_sq_dtype"),
        use_decoupled_grad=c.use_decoupled_grad,
        store_param_remainders=c.store_param_remainders,
        state_dict_cpu_offload=c.state_dict_cpu_offload,
        state_dict_offload_chunk_bytes=chunk_bytes,
        state_dict_offload_reuse_buffers=c.state_dict_offload_reuse_buffers,
        state_dict_offload_pinning=Pinning(c.state_dict_offload_pinning),
        state_dict_keep_bf16=c.state_dict_keep_bf16,
    )


def build_optimizer(cfg: Any, model: Any) -> torch.optim.Optimizer:
    """Build the optimizer that ``cfg`` describes for ``model``.

    Args:
        cfg: the ``optim`` config: a :class:`ValidatedOptim` (used as it is), or an OmegaConf node, a dataclass
            (:class:`FusedAdamConfig`, :class:`AdamWConfig`) or a plain dict, validated here;
            ``name`` picks ``fused_adam`` (default) or ``adamw``.
        model: an ``nn.Module`` or an iterable of ``(name, parameter)`` pairs.

    Returns:
        ``optim_factory.FusedAdam`` (TE), ``optim_factory.PortableFusedAdam`` or ``torch.optim.AdamW``.

    Raises:
        ConfigError: one line naming the key, the value and what is allowed.
    """
    v = cfg if isinstance(cfg, ValidatedOptim) else validate_optim_config(cfg)
    c = v.config
    named = _named_trainable(model)
    groups, summaries = build_param_groups(c, named, model if isinstance(model, torch.nn.Module) else None)
    params = [p for _, p in named]
    if v.name == "adamw":
        opt = torch.optim.AdamW(groups, **v.kwargs)
        log.info("optimizer: torch.optim.AdamW")
    else:
        backend, why = choose_backend(c.backend, params)
        on_gpu = any(local_tensor(p).device.type == "cuda" for p in params)
        if c.state_dict_cpu_offload and not on_gpu:
            warnings.warn(
                "optim.state_dict_cpu_offload=true has no memory effect here: the parameters are not on a GPU",
                UserWarning,
                stacklevel=2,
            )
        if c.store_param_remainders and not any(p.dtype == torch.bfloat16 for p in params):
            warnings.warn(
                "optim.store_param_remainders=true has no effect: no parameter is BF16",
                UserWarning,
                stacklevel=2,
            )
        if backend == "te":
            from optim_factory.optimizers.te_fused_adam import FusedAdam as cls
        else:
            from optim_factory.optimizers.portable import PortableFusedAdam as cls
        opt = cls(groups, **v.kwargs)
        log.info("optimizer: %s (%s)", cls.__name__, why)
    for i, s in enumerate(summaries):
        log.info(s.line(i))
    return opt
