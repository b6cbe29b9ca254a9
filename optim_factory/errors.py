"""``ConfigError``: the one exception (and one-line format) of a bad optimizer config value."""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["ConfigError", "config_error"]


class ConfigError(ValueError):
    """A bad optimizer config value: one line naming the key, the value and what is allowed."""


def config_error(key: str, value: Any, allowed: str) -> ConfigError:
    """``optim.<key>=<value>: <allowed>`` as a :class:`ConfigError` (a schema choice shows its YAML spelling)."""
    if isinstance(value, Enum):
        value = value.value
    return ConfigError(f"optim.{key}={value!r}: {allowed}")
