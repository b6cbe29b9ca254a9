"""``ConfigError``: the one exception (and one-line format) of a bad optimizer config value; ``first_line``."""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["ConfigError", "config_error", "first_line"]


class ConfigError(ValueError):
    """A bad optimizer config value: one line naming the key, the value and what is allowed."""


def config_error(key: str, value: Any, allowed: str) -> ConfigError:
    """``optim.<key>=<value>: <allowed>`` as a :class:`ConfigError` (a schema choice shows its YAML spelling)."""
    if isinstance(value, Enum):
        value = value.value
    return ConfigError(f"optim.{key}={value!r}: {allowed}")


def first_line(error: BaseException | str, empty: str | None = None) -> str:
    """The first line of an error's text (stripped); for an error without text, ``empty`` (default: its type's
    name). The one place the recipe and the factory shorten an error to one line."""
    text = str(error).strip()
    if text:
        return text.splitlines()[0]
    return empty if empty is not None else type(error).__name__
