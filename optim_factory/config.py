"""Optimizer config schemas (dataclasses) registered in Hydra's ConfigStore.

The YAML files under ``conf/optim/`` name these schemas in their defaults list, so an unknown key or a value
of the wrong type fails when Hydra composes the config, before any model, process group or GPU allocation
exists. :func:`optim_factory.factory.validate_optim_config` adds the checks across fields.

This is the only module of the library that imports Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

__all__ = [
    "GroupOverride",
    "ParamGroupsConfig",
    "FusedAdamConfig",
    "AdamWConfig",
    "OPTIM_SCHEMAS",
    "register_configs",
]

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
    """Every option of TE's FusedAdam, the export options (``state_dict_cpu_offload``,
    ``state_dict_offload_chunk_bytes``, ``state_dict_offload_reuse_buffers``) and the backend choice."""

    name: str = "fused_adam"
    backend: str = "auto"  # auto | te | portable
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    bias_correction: bool = True
    adam_w_mode: bool = True
    capturable: bool = False
    master_weights: bool = False
    master_weight_dtype: str = "fp32"  # fp32 | fp16
    exp_avg_dtype: str = "fp32"  # fp32 | fp16 | bf16 | fp8 (or torch.<dtype> spellings)
    exp_avg_sq_dtype: str = "fp32"
    use_decoupled_grad: bool = False
    store_param_remainders: bool = False
    state_dict_cpu_offload: bool = False
    state_dict_offload_chunk_bytes: Any = None  # null (one state at a time) | bytes | "64MiB"
    state_dict_offload_reuse_buffers: bool = False
    state_dict_keep_bf16: bool = False  # export BF16 states as BF16 (half the bytes; TE's own class cannot load it)
    param_groups: ParamGroupsConfig = field(default_factory=ParamGroupsConfig)


@dataclass
class AdamWConfig:
    """``torch.optim.AdamW``."""

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
    """Register the schemas in Hydra's ConfigStore (group ``optim``: ``fused_adam_schema``, ``adamw_schema``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, schema in OPTIM_SCHEMAS.items():
        cs.store(group="optim", name=f"{name}_schema", node=schema)
