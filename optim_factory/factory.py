"""Config → optimizer: schema and cross-field validation, backend choice, dtype strings, parameter groups.

``build_optimizer(cfg, model)`` is the one entry point. ``validate_optim_config(cfg)`` runs every check that
needs no model, so a recipe can call it before it builds anything heavy; it returns a :class:`ValidatedOptim`
(read-only), which ``build_optimizer`` takes as it is, without validating again. Every bad value raises
:class:`ConfigError` with one line: which key, which value, what is allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optim_factory.config import (
    OPTIM_SCHEMAS,
    AdamWConfig,
    GroupOverride,
    StateDtype,
    omegaconf_error_line,
    schema_keys,
)
from optim_factory.errors import ConfigError, optim_keys
from optim_factory.optimizers.constructor import export_arguments, export_options
from optim_factory.optimizers.export import local_tensor
from optim_factory.param_groups import build_param_groups, named_trainable
from optim_factory.rules.adam import check_state_dtypes, parse_dtype
from optim_factory.rules.config import check_optim_config
from optim_factory.rules.export import check_export_effect

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
            cfg = OmegaConf.to_container(cfg, resolve=True)  # a plain copy: keys a +key override added are checked too
        except OmegaConfBaseException as exc:
            raise ConfigError(omegaconf_error_line(exc, "optim.")) from None
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"optim: expected a mapping, an OmegaConf node or a dataclass, got {type(cfg).__name__}")
    name = cfg.get("name", "fused_adam")
    if name not in OPTIM_SCHEMAS:
        raise ConfigError("name", name, f"expected one of {'|'.join(OPTIM_SCHEMAS)}")
    schema = OPTIM_SCHEMAS[name]
    _refuse_placeholders(cfg, "optim")
    _check_overrides(cfg.get("param_groups"))
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), _spell_dtypes(cfg))
        OmegaConf.to_object(node)  # raises on missing mandatory values (an override without its pattern)
    except OmegaConfBaseException as exc:
        raise ConfigError(omegaconf_error_line(exc, "optim.", schema_keys(schema))) from None
    OmegaConf.set_readonly(node, True)
    return node


def _refuse_placeholders(value: Any, key: str) -> None:
    """OmegaConf's ``???`` (a mandatory value) anywhere in the input: merged into the schema it kept the default
    without a word (``{"lr": "???"}`` built lr=1e-3); refused, naming the key."""
    if isinstance(value, str) and value == "???":
        raise ConfigError(f"{key}: missing value (???: mandatory, never given; set {key}=...)")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _refuse_placeholders(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_placeholders(v, f"{key}[{i}]")


def _check_overrides(param_groups: Any) -> None:
    """``param_groups.overrides``, item by item, so that an error names its item (OmegaConf's merge named only the
    leaf: ``optim.lr_mul: not a config key``, or ``optim.?=None`` for a mapping instead of a list)."""
    if not isinstance(param_groups, Mapping) or param_groups.get("overrides") is None:
        return
    key = "param_groups.overrides"
    overrides = param_groups["overrides"]
    if not isinstance(overrides, (list, tuple)):
        raise ConfigError(key, overrides, "expected a list of {pattern, lr_mult, weight_decay_mult} mappings")
    for i, item in enumerate(overrides):
        if not isinstance(item, Mapping):
            raise ConfigError(f"{key}[{i}]", item, "expected a mapping {pattern, lr_mult, weight_decay_mult}")
        try:
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GroupOverride), item))
        except OmegaConfBaseException as exc:
            raise ConfigError(omegaconf_error_line(exc, f"optim.{key}[{i}].", schema_keys(GroupOverride))) from None


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
            except ConfigError:
                pass
    return out


@optim_keys()
def validate_optim_config(cfg: Any) -> ValidatedOptim:
    """Check everything that needs no model; return the typed, read-only config and the constructor arguments.

    A pure function: ``cfg`` is not changed, and neither is the result afterwards. Call it once and hand the
    result to :func:`build_optimizer`. Raises :class:`ConfigError`. Warns (``UserWarning``) where an option
    silently has no effect (remainders without an FP32 master). A refusal's line is the ``optim`` group's key's
    (:func:`~optim_factory.errors.optim_keys`).
    """
    c = _to_schema(cfg)
    check_optim_config(c)  # the config's rules: optim_factory/rules/config.py
    if OmegaConf.get_type(c) is AdamWConfig:
        kwargs = dict(lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay, amsgrad=c.amsgrad)
        return ValidatedOptim(c, MappingProxyType({**kwargs, "foreach": c.foreach}))

    dtypes = check_state_dtypes(  # the constructors' own dtype / capturable / master-weight rules
        master_weights=c.master_weights,
        master_weight_dtype=c.master_weight_dtype,
        exp_avg_dtype=c.exp_avg_dtype,
        exp_avg_sq_dtype=c.exp_avg_sq_dtype,
        capturable=c.capturable,
        store_param_remainders=c.store_param_remainders,
    )
    export = export_options(c)  # the constructors' own export option rules, before anything is built
    check_export_effect(export, dtypes.exp_avg_dtype, dtypes.exp_avg_sq_dtype)
    return ValidatedOptim(c, MappingProxyType(_fused_adam_kwargs(c) | export_arguments(c)))


# ------------------------------------------------------------------------------------------------- backends
@optim_keys()
def choose_backend(requested: str, params: list[torch.Tensor]) -> tuple[str, str]:
    """``auto|te|portable`` → (``te`` or ``portable``, the reason). ``te`` without TE, or without CUDA parameters,
    raises ``optim.backend='te': ...``."""
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE, TE_INSTALL_HINT, te_import_error

    on_cuda = bool(params) and all(local_tensor(p).device.type == "cuda" for p in params)
    if requested == "portable":
        return "portable", "backend=portable requested"
    if requested == "te":
        if not TE_AVAILABLE:
            raise ConfigError(
                "backend", "te", f"Transformer Engine is not importable ({te_import_error()}); {TE_INSTALL_HINT}"
            )
        if not on_cuda:
            needs = "TE's FusedAdam needs CUDA parameters; use backend=portable or auto on CPU"
            raise ConfigError("backend", "te", needs)
        return "te", "backend=te requested"
    if TE_AVAILABLE and on_cuda:
        return "te", "auto: Transformer Engine is importable and the parameters are on CUDA"
    if not TE_AVAILABLE:
        return "portable", f"auto: Transformer Engine is not importable ({te_import_error()})"
    return "portable", "auto: the parameters are not on CUDA"


def _fused_adam_kwargs(c: DictConfig) -> dict[str, Any]:
    """The FusedAdam constructor's arguments but the export options (``export_arguments``) from a schema-typed
    config (dtypes parsed)."""
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
    )


def _states(kwargs: Mapping[str, Any], bf16_params: bool) -> str:
    """``master fp32, exp_avg bf16, exp_avg_sq fp32`` from a FusedAdam's constructor arguments (remainders only
    where there are BF16 parameters: the only ones they apply to)."""
    name = {parse_dtype(m): m.value for m in StateDtype}  # the config's spelling of each torch dtype
    master = "none"
    if kwargs["master_weights"]:
        master = name[kwargs["master_weight_dtype"]]
        if kwargs["store_param_remainders"] and bf16_params:
            master = "int16 remainders (BF16 parameters)"
    return f"master {master}, exp_avg {name[kwargs['exp_avg_dtype']]}, exp_avg_sq {name[kwargs['exp_avg_sq_dtype']]}"


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
    named = named_trainable(model)
    groups, summaries = build_param_groups(c, named, model if isinstance(model, torch.nn.Module) else None)
    params = [p for _, p in named]
    if v.name == "adamw":
        opt = torch.optim.AdamW(groups, **v.kwargs)
        log.info("optimizer: torch.optim.AdamW")
    else:
        backend, why = choose_backend(c.backend, params)
        bf16_params = any(p.dtype == torch.bfloat16 for p in params)
        if c.master_weights and not any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
            warnings.warn(
                "optim.master_weights=true has no effect: no parameter is BF16 or FP16 (the FP32 parameters are "
                "their own master; a model cast to BF16 after the optimizer was built is not covered)",
                UserWarning,
                stacklevel=2,
            )
        if c.store_param_remainders and not bf16_params:
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
        log.info("optimizer states: %s; state_dict: %s", _states(v.kwargs, bf16_params), opt.export_options.describe())
    for i, s in enumerate(summaries):
        log.info(s.line(i))
    return opt
