"""Optimizer config schemas (dataclasses) registered in Hydra's ConfigStore.

The YAML files under ``conf/optim/`` name these schemas in their defaults list, so an unknown key or a value
of the wrong type fails when Hydra composes the config, before any model, process group or GPU allocation
exists. :func:`optim_factory.factory.validate_optim_config` adds the checks across fields.

This is the only module of the library that imports Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from optim_factory.errors import ConfigError, first_line
from optim_factory.rules.pinning import Pinning

__all__ = [
    "Choice",
    "Backend",
    "StateDtype",
    "GroupOverride",
    "ParamGroupsConfig",
    "FusedAdamConfig",
    "AdamWConfig",
    "OPTIM_SCHEMAS",
    "register_configs",
    "schema_keys",
    "omegaconf_error_line",
    "unknown_key_line",
]


class Choice(str, Enum):
    """A config choice: member names are the YAML spellings (``exp_avg_dtype: bf16``), values equal the names.

    A ``str`` subclass, so ``Backend.te == "te"`` and f-strings print the plain spelling. OmegaConf rejects any
    other value when the config is composed (one line: :func:`omegaconf_error_line`).
    """

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def spelled(cls) -> str:
        """The allowed spellings, for messages: ``auto|te|portable``."""
        return "|".join(m.value for m in cls)


class Backend(Choice):
    """Which FusedAdam: ``auto`` (TE when importable and the parameters are on CUDA), ``te`` or ``portable``."""

    auto = "auto"
    te = "te"
    portable = "portable"


class StateDtype(Choice):
    """Dtype of an optimizer state (``fp8`` is E4M3, spelled ``torch.uint8`` in TE's arguments).

    :func:`optim_factory.factory.parse_dtype` is the one place that maps these to ``torch.dtype``.
    """

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8 = "fp8"


DEFAULT_NO_DECAY = [r"(^|\.)bias$", r"norm", r"(^|\.)ln_?\w*\.", r"embed"]


@dataclass
class GroupOverride:
    """Per-pattern multipliers: parameters whose name matches ``pattern`` (``re.search``) get their own group."""

    pattern: str = MISSING
    lr_mult: float = 1.0
    weight_decay_mult: float = 1.0


@dataclass
class ParamGroupsConfig:
    """How trainable parameters are split into optimizer groups.

    Attributes:
        no_decay: regular expressions (``re.search`` on the parameter's name); a match gets weight decay 0.
            The defaults catch biases, norms (``*norm*``, ``ln_*``) and embeddings.
        no_decay_auto: weight decay 0 also for every parameter with fewer than 2 dimensions and for the
            parameters of embedding and normalization modules (``nn.Embedding``, ``nn.LayerNorm``,
            ``nn.RMSNorm``, ``nn.GroupNorm``, ``nn.BatchNorm*``, ``nn.InstanceNorm*``, TE's LayerNorm/RMSNorm);
            the module rule needs the model as an ``nn.Module``.
        overrides: patterns with lr / weight-decay multipliers; a parameter may match at most one.
    """

    no_decay: list[str] = field(default_factory=lambda: list(DEFAULT_NO_DECAY))
    no_decay_auto: bool = True
    overrides: list[GroupOverride] = field(default_factory=list)


@dataclass
class FusedAdamConfig:
    """Every option of TE's FusedAdam, the export options and the backend choice.

    The defaults are the library's: exactly the constructor defaults of TE's ``FusedAdam`` and of
    :class:`~optim_factory.PortableFusedAdam` (tested), so ``build_optimizer({})`` builds what
    ``FusedAdam(params)`` would. A recipe's YAML (``conf/optim/fused_adam.yaml``) holds only what differs.
    """

    name: str = "fused_adam"  # the schema: fused_adam | adamw
    backend: Backend = Backend.auto
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False  # not supported by FusedAdam (refused)
    bias_correction: bool = True
    adam_w_mode: bool = True  # false: L2 regularisation instead of decoupled weight decay
    capturable: bool = False  # lr/step as device tensors (CUDA graphs); needs fp32 master, fp32|bf16 moments
    master_weights: bool = False  # master copy for FP16/BF16 parameters
    master_weight_dtype: StateDtype = StateDtype.fp32  # fp32 | fp16
    exp_avg_dtype: StateDtype = StateDtype.fp32  # fp32 | fp16 | bf16 | fp8
    exp_avg_sq_dtype: StateDtype = StateDtype.fp32  # fp32 | fp16 | bf16 | fp8
    use_decoupled_grad: bool = False  # read param.decoupled_grad instead of param.grad
    store_param_remainders: bool = False  # BF16 params + FP32 master: keep only the master's low 16 bits (int16)
    state_dict_cpu_offload: bool = False  # export to CPU during state_dict(), streamed in chunks
    state_dict_offload_chunk_bytes: Any = None  # the chunk: null (64MiB) | bytes | "64MiB" | 0: one state at a time
    state_dict_offload_reuse_buffers: bool = False  # with chunks: reuse pinned host buffers across checkpoints
    state_dict_offload_pinning: Pinning = Pinning.register  # with reuse: register | alloc | none (CUDA states)
    state_dict_keep_bf16: bool = False  # export BF16 states as BF16 (half the bytes; TE's own class cannot load it)
    state_dict_offload_background: bool = False  # with chunks: fill the export in the background; step() waits
    state_dict_offload_host_budget: Any = None  # null: no cap | auto: a share of the host | bytes | "512MiB"
    param_groups: ParamGroupsConfig = field(default_factory=ParamGroupsConfig)


@dataclass
class AdamWConfig:
    """``torch.optim.AdamW``; the defaults are its constructor's (tested)."""

    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    amsgrad: bool = False
    foreach: bool | None = None
    param_groups: ParamGroupsConfig = field(default_factory=ParamGroupsConfig)


OPTIM_SCHEMAS: dict[str, type] = {"fused_adam": FusedAdamConfig, "adamw": AdamWConfig}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore, at its root (``fused_adam_schema``, ``adamw_schema``), so that
    they are not options of the ``optim`` group (nor listed as such by ``--help``); a group file builds on one
    with ``defaults: [/fused_adam_schema@_here_, _self_]``."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, schema in OPTIM_SCHEMAS.items():
        cs.store(name=f"{name}_schema", node=schema)


def schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a schema dataclass, nested schemas included (``param_groups.no_decay``)."""
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(kind):
            keys += schema_keys(kind, f"{prefix}{f.name}.")
    return keys


def omegaconf_error_line(exc: OmegaConfBaseException, prefix: str = "", known: list[str] | None = None) -> str:
    """One line for an OmegaConf error: the key, the value and what is allowed (the nearest key if unknown).

    Args:
        exc: raised while merging into or reading from a structured config.
        prefix: put before the key (``"optim."`` when the node is a recipe's ``optim`` group).
        known: the valid dotted keys (relative to the node, without ``prefix``), for a "did you mean".
    """
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    msg = first_line(getattr(exc, "msg", None) or exc)
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        return unknown_key_line(f"{prefix}{key}", [prefix + k for k in known or []])
    if isinstance(exc, MissingMandatoryValue):
        return f"{prefix}{key}: missing value (it has no default; set {prefix}{key}=...)"
    enum = re.fullmatch(r"Invalid value '.*', expected one of \[(.*)\]", msg)
    if enum:
        msg = "expected one of " + "|".join(s.strip() for s in enum.group(1).split(","))
    return str(ConfigError(f"{prefix}{key}", getattr(exc, "value", None), msg))


def unknown_key_line(key: str, known: list[str]) -> str:
    """``optim.state_dict_cpu_ofload: not a config key; did you mean optim.state_dict_cpu_offload?``"""
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}  # same node only
    near = [siblings[k] for k in difflib.get_close_matches(leaf, list(siblings), n=1)]
    near = near or [k for k in known if k.rpartition(".")[2] == leaf][:2]  # the same name elsewhere: lr -> optim.lr
    return f"{key}: not a config key" + (f"; did you mean {' or '.join(near)}?" if near else "")
