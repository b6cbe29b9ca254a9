"""Parameter groups: which parameters get weight decay and which per-pattern multipliers, by name, by module type
and by dimension; each group's summary says why it exists."""

from __future__ import annotations

import logging
import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from optim_factory.config import DEFAULT_NO_DECAY
from optim_factory.errors import ConfigError, optim_keys
from optim_factory.rules.config import match_overrides

__all__ = ["GroupSummary", "named_trainable", "build_param_groups"]

log = logging.getLogger(__name__)


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


def named_trainable(model_or_params: Any) -> list[tuple[str, torch.nn.Parameter]]:
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
    cfg: Any, named: list[tuple[str, torch.nn.Parameter]], module: torch.nn.Module | None
) -> dict[str, str]:
    """Parameter name -> why its weight decay is 0, first reason wins: module type, fewer than 2 dims, pattern.

    A ``no_decay`` pattern that matches no parameter is logged as a warning, unless it is one of the schema's
    default patterns (those cover names a model may not have, so they stay quiet).
    """
    pg = cfg.param_groups
    by_type: dict[int, str] = {}
    own_patterns = [p for p in pg.no_decay if p not in DEFAULT_NO_DECAY]
    if pg.no_decay_auto and module is None and cfg.weight_decay != 0 and not own_patterns:
        log.warning(
            "optim.param_groups.no_decay_auto: given (name, parameter) pairs, not the model, the embedding and "
            "normalization rule cannot apply (a 2-D embedding decays like a linear weight); only the 1-D and "
            "no_decay name rules do: pass the nn.Module, or name them in optim.param_groups.no_decay (which ends "
            "this warning)"
        )
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


@optim_keys()
def build_param_groups(
    cfg: Any,
    named: list[tuple[str, torch.nn.Parameter]],
    module: torch.nn.Module | None = None,
) -> tuple[list[dict], list[GroupSummary]]:
    """Split parameters into groups (``cfg``: the typed optimizer config, e.g. ``ValidatedOptim.config``): weight
    decay off where a no-decay rule applies, per-pattern multipliers.

    No weight decay (with ``param_groups.no_decay_auto``, the default): parameters of embedding and
    normalization modules (see :func:`_no_decay_module_types`; needs ``module``, so it applies when
    ``build_optimizer`` gets an ``nn.Module``) and every parameter with fewer than 2 dimensions; the
    ``no_decay`` name patterns add to that. With (name, parameter) pairs only, the 1-D and name rules apply.

    Every trainable parameter lands in exactly one group (checked). An override pattern that matches nothing,
    or two override patterns matching one parameter, raise (:func:`~optim_factory.rules.config.match_overrides`;
    ``optim.param_groups.overrides...``); a user-given ``no_decay`` pattern matching nothing is logged as a warning.
    Each group's summary says why it exists (e.g. ``no decay: nn.Embedding (2), 1-D (9)``).
    """
    overrides = list(cfg.param_groups.overrides)
    reasons = _no_decay_reasons(cfg, named, module)
    matched = match_overrides([name for name, _ in named], [o.pattern for o in overrides])
    buckets: dict[tuple[int, bool], list[tuple[str, torch.nn.Parameter]]] = {}
    for (name, param), override in zip(named, matched):
        buckets.setdefault((override, name in reasons), []).append((name, param))

    groups, summaries = [], []
    for (override, decay_off), members in sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        o = overrides[override] if override >= 0 else None
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
