"""``compose_config``: ``conf/train.yaml`` composed as the command line composes it (for tests and notebooks), each
set of config-group choices composed by Hydra once.

Hydra composes a config from its defaults list, which only the config-group choices change (``experiment=quick``,
``optim=adamw``), then applies every other override to it one by one, in their order
(``ConfigLoaderImpl._apply_overrides_to_config``). A composition takes about 0.3 s of CPU on a 2-core machine, the
applied overrides a few milliseconds. So Hydra's composition is kept for each set of choices, together with what it
was composed from (the files under ``conf/`` and the ConfigStore's nodes: an edited file or a node stored again is
composed anew), and the other overrides (``key=value``, ``+key=value``, ``~key``) are applied to a copy of it by
Hydra's own step. A list with an override of Hydra's config or one that names it (``${hydra:...}``), a package
(``group@package=``), a sweep, or a group given anything but an option's name (a dict, a list, ``null``, ``~group``)
is composed by Hydra whole, as the command line composes it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optim_factory.errors import ConfigError
from recipes.command_line import config_error_line
from recipes.config import CONFIG_DIR, register_configs

__all__ = ["compose_config"]

register_configs()  # the schemas conf/train.yaml composes (the command line's Hydra finds them too)
_SEEN_NODES: dict[int, Any] = {}  # every ConfigStore node a key named: kept, so that no later node reuses its id


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose ``conf/train.yaml`` with ``overrides``, as the command line would (the module docstring says how).

    Raises:
        ConfigError: Hydra's or OmegaConf's error, in the command line's one line.
    """
    overrides = list(overrides or [])
    try:
        sources = _sources()
        split = _split(OverridesParser.create().parse_overrides(overrides), _groups(sources))
        if split is None:
            cfg = _composed(tuple(overrides))
        else:
            choices, values = split
            cfg = copy.deepcopy(_kept(choices, sources))
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(config_error_line(exc, overrides)) from None
    return cfg


def _split(parsed: list[Override], groups: frozenset[str]) -> tuple[tuple[str, ...], list[Override]] | None:
    """The choices of ``groups`` (``group=option``) and the other overrides of ``parsed``, or None where one of them
    needs Hydra's whole composition (the module docstring says which)."""
    choices, values = [], []
    for o in parsed:
        if "hydra" in o.input_line or o.package is not None or o.is_sweep_override():
            return None
        if o.key_or_group in groups:
            if not isinstance(o.value(), str):  # a dict merged, a list, null: Hydra orders them
                return None
            choices.append(o.input_line)
        else:
            values.append(o)
    return tuple(choices), values


def _composed(overrides: tuple[str, ...]) -> DictConfig:
    """``conf/train.yaml`` composed by Hydra with ``overrides`` (unresolved)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@functools.lru_cache(maxsize=16)
def _kept(choices: tuple[str, ...], sources: tuple) -> DictConfig:
    """:func:`_composed` with ``choices``, kept while ``sources`` (:func:`_sources`) are as they were (callers copy
    it)."""
    return _composed(choices)


@functools.lru_cache(maxsize=4)
def _groups(sources: tuple) -> frozenset[str]:
    """The config groups Hydra finds for ``conf/train.yaml`` (``optim``, ``hydra/launcher``, ...) from ``sources``."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()

        def below(parent: str) -> list[str]:
            names = [f"{parent}/{g}" if parent else g for g in loader.list_groups(parent)]
            return [n for name in names for n in (name, *below(name))]

        return frozenset(below(""))


def _sources() -> tuple:
    """What a composition is made from, as a key: each file under ``conf/`` (its path, size and modification
    time) and each ConfigStore node (its path and identity)."""
    conf = Path(CONFIG_DIR)
    files = []
    for path in sorted(conf.rglob("*")):
        if path.is_file():
            stat = path.stat()
            files.append((str(path.relative_to(conf)), stat.st_size, stat.st_mtime_ns))
    return tuple(files), tuple(_store_nodes(ConfigStore.instance().repo, ""))


def _store_nodes(repo: dict[str, Any], prefix: str) -> Iterator[tuple[str, int]]:
    for name, node in sorted(repo.items()):
        if isinstance(node, dict):
            yield from _store_nodes(node, f"{prefix}{name}/")
        else:
            _SEEN_NODES.setdefault(id(node), node)
            yield f"{prefix}{name}", id(node)
