"""``compose_config`` gives Hydra's own composition: the config, or the one line of Hydra's error, for every kind of
override, although it composes the config-group choices once and applies the other overrides to a copy."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optim_factory import ConfigError
from recipes.command_line import config_error_line
from recipes.config import CONFIG_DIR
from recipes.train import compose_config

OVERRIDES = [
    [],
    ["experiment=quick", "trainer.threads=1", "run_dir=/tmp/a"],
    ["optim.lr=0.1", "optim=fused_adam_lowmem"],  # a value before the choice it belongs to: applied after composing
    ["experiment=lowmem", "model.dtype=fp32", "optim=adamw"],
    ["+optim.no_such_key=1"],
    ["~checkpoint.keep_last"],
    ["++trainer.max_steps=7", "++trainer.max_steps=8"],
    ["optim={lr: 0.2}"],  # a dict given to a group's name is a value, merged
    ["trainer.max_steps=1,2"],
    ["optim=adamw,fused_adam"],
    ["optim.lr_typo=1"],
    ["optim=nope"],
    ["trainer.max_steps=[1"],
    ["experiment=quick", "hydra.job.chdir=true", "hydra/launcher=laptop"],
    ["trainer.eval_every=${trainer.max_steps}"],
    ["optim@trainer=adamw"],
    ["model.dtype=fp64"],
]


def _hydra(overrides: list[str]) -> str:
    """Hydra's own composition of ``overrides``, resolved, as YAML (or the line of its error)."""
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        return f"error: {config_error_line(exc, overrides)}"
    return OmegaConf.to_yaml(cfg)


def _ours(overrides: list[str]) -> str:
    try:
        return OmegaConf.to_yaml(compose_config(overrides))
    except ConfigError as exc:
        return f"error: {exc}"


@pytest.mark.parametrize("overrides", OVERRIDES, ids=lambda o: " ".join(o) or "(none)")
def test_compose_config_is_hydra_s_composition(overrides):
    expected = _hydra(overrides)
    assert _ours(overrides) == expected
    assert _ours(overrides) == expected  # again, from what was composed before


def test_a_changed_config_leaves_the_next_composition_as_it_was():
    cfg = compose_config(["experiment=quick", "optim.lr=0.5"])
    cfg.optim.lr, cfg.trainer.max_steps = 7.0, 3
    assert _ours(["experiment=quick", "optim.lr=0.5"]) == _hydra(["experiment=quick", "optim.lr=0.5"])
