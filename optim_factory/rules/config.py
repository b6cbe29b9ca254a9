"""The rules an optimizer config adds to the constructors', written once: ``lr > 0``, the ``param_groups`` patterns
and multipliers and FusedAdam without AMSGrad (:func:`check_optim_config`, which ``validate_optim_config`` runs on
the typed config), and the override patterns against a model's parameter names (:func:`match_overrides`, which
``build_param_groups`` runs). Each refusal is a :class:`~optim_factory.errors.ConfigError` keyed as the config
spells it below its ``optim`` group (``param_groups.overrides[0].lr_mult``); ``optim_factory.errors.optim_keys``
writes it as the config's line."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from optim_factory.errors import ConfigError
from optim_factory.rules.adam import check_hyperparameters

__all__ = ["check_optim_config", "match_overrides"]


def _check_number(key: str, value: Any, *, positive: bool = False, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(key, value, "expected a finite number")
    if positive and value <= 0:
        raise ConfigError(key, value, "must be > 0")
    if lo is not None and value < lo:
        raise ConfigError(key, value, f"must be >= {lo}")


def _check_patterns(key: str, patterns: Iterable[str]) -> None:
    """Each pattern a valid regular expression; ``key`` holds ``{i}`` where the index goes."""
    for i, pattern in enumerate(patterns):
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(key.format(i=i), pattern, "expected a non-empty regular expression")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(key.format(i=i), pattern, f"not a valid regular expression ({exc})") from None


def check_optim_config(c: Any) -> None:
    """The rules of a typed optimizer config (an OmegaConf node of its schema) that need no model, in order: ``lr >
    0`` (torch accepts lr=0, which trains nothing), the constructors' hyperparameter rules
    (:func:`~optim_factory.rules.adam.check_hyperparameters`), each ``no_decay`` and override pattern a regular
    expression, each override's ``lr_mult > 0`` and ``weight_decay_mult >= 0``; ``optim=fused_adam`` without
    AMSGrad (``optim=adamw`` has it)."""
    if isinstance(c.lr, float) and c.lr <= 0:
        raise ConfigError("lr", c.lr, "must be > 0")
    check_hyperparameters(c.lr, list(c.betas), c.eps, c.weight_decay)
    overrides = c.param_groups.overrides
    _check_patterns("param_groups.no_decay[{i}]", c.param_groups.no_decay)
    _check_patterns("param_groups.overrides[{i}].pattern", [o.pattern for o in overrides])
    for i, o in enumerate(overrides):
        _check_number(f"param_groups.overrides[{i}].lr_mult", o.lr_mult, positive=True)
        _check_number(f"param_groups.overrides[{i}].weight_decay_mult", o.weight_decay_mult, lo=0.0)
    if c.name == "fused_adam" and c.amsgrad:
        raise ConfigError("amsgrad", c.amsgrad, "FusedAdam does not support AMSGrad; use optim=adamw for it")


def match_overrides(names: Sequence[str], patterns: Sequence[str]) -> list[int]:
    """For each parameter name, the index of the override pattern that matches it (``re.search``; -1: none).
    Refused: two patterns matching one name (the first such name), then a pattern matching no name."""
    compiled = [re.compile(pattern) for pattern in patterns]
    used = [False] * len(patterns)
    matched = []
    for name in names:
        hits = [i for i, rx in enumerate(compiled) if rx.search(name)]
        if len(hits) > 1:
            overlapping = ", ".join(repr(patterns[i]) for i in hits)
            raise ConfigError(
                "param_groups.overrides", overlapping, f"patterns overlap on parameter {name!r}; make them disjoint"
            )
        for i in hits:
            used[i] = True
        matched.append(hits[0] if hits else -1)
    for i, pattern in enumerate(patterns):
        if not used[i]:
            raise ConfigError(f"param_groups.overrides[{i}].pattern", pattern, "matches no trainable parameter")
    return matched
