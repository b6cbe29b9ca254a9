"""``ConfigError``: the one exception of a refused value (a rule's, or a config's); ``SaveRefused``: a save refused on
every rank (``optim_factory.checkpoint``); ``optim_keys``: the one place a rule's refusal becomes the optimizer
config's line; ``first_line``: the one place an error is shortened to one line."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

__all__ = ["ConfigError", "SaveRefused", "first_line", "optim_keys"]


class ConfigError(ValueError, RuntimeError):
    """A refused value, in one line. Every rule of ``optim_factory.rules`` raises it, and so does every config check.

    * ``ConfigError(key, value, allowed)``: one value refused, ``<key>=<value!r>: <allowed>``; ``shown`` writes the
      value otherwise than its repr, ``text`` words the whole line for a direct caller (``torch.optim.Adam``'s
      ``Invalid learning rate: ...``, a param group's index). ``key``, ``value`` and ``allowed`` stay apart so that
      :func:`optim_keys` restates the refusal as a config key's (:meth:`under`).
    * ``ConfigError(line)``: a refusal worded whole (an unknown key, a missing value, a key of another optimizer);
      ``key``, ``value`` and ``allowed`` are None.

    A ``ValueError``, as ``torch.optim.Adam`` raises for a bad hyperparameter, and a ``RuntimeError``, as TE's
    ``FusedAdam`` raises for a bad dtype combination: code written against either keeps catching it.
    """

    def __init__(
        self,
        key: str,
        value: Any = None,
        allowed: str | None = None,
        *,
        shown: str | None = None,
        text: str | None = None,
    ) -> None:
        if allowed is None:
            line, key = key, None
        else:
            line = text if text is not None else f"{key}={repr(value) if shown is None else shown}: {allowed}"
        self.key, self.value, self.allowed, self.shown = key, value, allowed, shown
        super().__init__(line)

    def under(self, prefix: str) -> ConfigError:
        """This refusal as a config key's, ``<prefix><key>=<value>: <allowed>`` (``optim.lr=nan: must be >= 0``): a
        choice (an ``Enum``) shows its spelling, and ``text`` (the wording for direct callers) is left out. A
        refusal worded whole is already a config's line: returned as it is."""
        if self.key is None:
            return self
        value = self.value.value if isinstance(self.value, Enum) else self.value
        return ConfigError(prefix + self.key, value, _as_overrides(self.allowed, prefix), shown=self.shown)


_KEY_IN_TEXT = re.compile(r"(?<![\w.])(state_dict_[a-z0-9_]+)(=True|=False)?\b")


def _as_overrides(allowed: str, prefix: str) -> str:
    """The optimizer keys an ``allowed`` text names (``state_dict_cpu_offload=True``), as the overrides that set
    them under ``prefix`` (``optim.state_dict_cpu_offload=true``): the refusal names the fix as it is typed."""

    def one(m: re.Match) -> str:
        return prefix + m[1] + (m[2] or "").lower()

    return _KEY_IN_TEXT.sub(one, allowed)


@contextmanager
def optim_keys() -> Iterator[None]:
    """The one place a rule's refusal becomes the optimizer config's line: a :class:`ConfigError` with a key raised
    inside is raised again as the ``optim`` group's key (``optim.lr=nan: must be >= 0``, :meth:`ConfigError.under`);
    a refusal worded whole is already a config's line. A context manager and a decorator (``@optim_keys()``): the
    public functions that read an optimizer config (``validate_optim_config``, ``build_param_groups``,
    ``choose_backend``) wear it, so a direct caller reads the line a recipe does. They do not call one another, so
    no refusal passes it twice."""
    try:
        yield
    except ConfigError as exc:
        raise exc.under("optim.") from None


def first_line(error: BaseException | str, empty: str | None = None, *, named: bool = False) -> str:
    """The first line of an error's text (stripped); for an error without text, ``empty`` (default: its type's
    name). The one place the library and the recipe shorten an error to one line.

    ``named``: for a report or a log line, ``<type>: <first line, at most 300 characters>``; an error that gathers
    other ranks' errors (DCP's ``CheckpointException``: ``failures``, rank -> (exception, traceback)) as its first
    rank's, ``rank <r>: ...``.
    """
    if not named or isinstance(error, str):
        text = str(error).strip()
        if text:
            return text.splitlines()[0]
        return empty if empty is not None else type(error).__name__
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items(), key=lambda kv: kv[0])[0]
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]  # (exception, traceback)
        described = first_line(inner, named=True) if isinstance(inner, BaseException) else str(inner)[:300]
        return f"rank {rank}: {described}"
    return f"{type(error).__name__}: {first_line(error, '')[:300]}"


class SaveRefused(RuntimeError):
    """A staged save refused on every rank before anything was written, in one line naming each rank's reason
    (``reasons``: ``"<reason> (rank N)"`` for every rank that refused)."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__(f"not saved, nothing was written: {'; '.join(reasons)}")
        self.reasons = reasons

    def __reduce__(self) -> tuple:  # DCP gathers a write's failures to its coordinator pickled
        return SaveRefused, (self.reasons,)
