"""``compose_config`` gives Hydra's own composition: the config, or the one line of Hydra's error, for every kind of
override, although it composes each set of config-group choices once and applies the plain overrides to a copy;
and a file under ``conf/`` edited, or a ConfigStore node stored again, is composed anew."""

from __future__ import annotations

import shutil

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optim_factory import ConfigError
from recipes import composing
from recipes.command_line import config_error_line
from recipes.config import CONFIG_DIR
from recipes.train import compose_config

OVERRIDES = [
    [],
    ["experiment=quick", "trainer.threads=1", "run_dir=/tmp/a"],
    ["optim.lr=0.1", "optim=fused_adam_lowmem"],  # a value before the choice it belongs to: applied after composing
    ["experiment=lowmem", "model.dtype=fp32", "optim=adamw"],
    ["+optim.no_such_key=1"],
    ["+trainer.max_steps=3"],
    ["~checkpoint.keep_last"],
    ["++trainer.max_steps=7", "++trainer.max_steps=8"],
    ["optim={lr: 0.2}"],  # a dict given to a group's name is a value, merged
    ["trainer.max_steps=3", "trainer={max_steps: 2}"],  # ... in its place among the values
    ["+optim.foo=1", "optim={foo: 2}"],
    ["optim.lr_typo=1", "optim={nokey: 1}"],
    ["optim=[adamw]"],
    ["hydra={a: 1}"],
    ["trainer.max_steps=1,2"],
    ["optim=adamw,fused_adam"],
    ["optim.lr_typo=1"],
    ["optim=nope"],
    ["trainer.max_steps=[1"],
    ["experiment=quick", "hydra.job.chdir=true", "hydra/launcher=laptop"],
    ["trainer.eval_every=${trainer.max_steps}"],
    ["+foo=${hydra:runtime.choices.optim}", "~foo"],
    ["optim@trainer=adamw"],
    ["model.dtype=fp64"],
    ["run_dir='a,b'", "optim.lr=1e-3"],
]


def _hydra(overrides: list[str], conf: str = CONFIG_DIR) -> str:
    """Hydra's own composition of ``overrides``, resolved, as YAML (or the line of its error)."""
    try:
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
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


def test_a_group_on_hydra_s_search_path_is_hydra_s(tmp_path):
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "p.yaml").write_text("# @package _global_\nrun_dir: from_preset\n")
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "+preset=p"]
    assert "run_dir: from_preset" in _hydra(overrides)
    assert _ours(overrides) == _hydra(overrides)


def test_a_changed_config_leaves_the_next_composition_as_it_was():
    cfg = compose_config(["experiment=quick", "optim.lr=0.5"])
    cfg.optim.lr, cfg.trainer.max_steps = 7.0, 3
    assert _ours(["experiment=quick", "optim.lr=0.5"]) == _hydra(["experiment=quick", "optim.lr=0.5"])


def test_an_edited_config_file_is_composed_anew(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(CONFIG_DIR, conf)
    monkeypatch.setattr(composing, "CONFIG_DIR", str(conf))
    assert compose_config(["experiment=quick", "run_dir=a"]).trainer.eval_every == 250
    quick = conf / "experiment" / "quick.yaml"
    quick.write_text(quick.read_text().replace("  log_every: 5\n", "  log_every: 5\n  eval_every: 3\n"))
    for run_dir in ("a", "b"):
        overrides = ["experiment=quick", f"run_dir={run_dir}"]
        assert compose_config(overrides).trainer.eval_every == 3
        assert _ours(overrides) == _hydra(overrides, str(conf))


def test_a_config_store_node_stored_again_or_added_is_composed_anew():
    store = ConfigStore.instance()
    try:
        for warmup, run_dir in ((5, "a"), (7, "b")):
            store.store(group="schedule", name="short", package="_global_", node={"trainer": {"warmup_steps": warmup}})
            for overrides in (["+schedule=short", f"run_dir={run_dir}"], ["schedule=short", f"run_dir={run_dir}"]):
                assert _ours(overrides) == _hydra(overrides)
            assert f"warmup_steps: {warmup}" in _ours(["+schedule=short", f"run_dir={run_dir}"])
    finally:
        store.repo.pop("schedule", None)
