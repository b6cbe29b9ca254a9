"""Model and trainer numbers are checked before anything is built: one ConfigError line naming the key (not a
traceback after the run has started, nor silently accepted)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from optim_factory import ConfigError
from recipes.job import USER_ERRORS
from recipes.preflight import preflight
from recipes.train import compose_config

BAD = [
    (["model.n_heads=3"], "model.d_model=64: must be divisible by model.n_heads=3"),
    (["model.d_model=0"], "model.d_model=0: must be >= 1"),
    (["trainer.log_every=0"], "trainer.log_every=0: must be >= 1"),
    (["trainer.warmup_steps=-5"], "trainer.warmup_steps=-5: must be >= 0"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0: must be >= 0"),
    (["trainer.threads=-2"], "trainer.threads=-2: must be >= 0"),
    (["trainer.max_steps=0"], "trainer.max_steps=0: must be >= 1"),
]


@pytest.mark.parametrize("overrides,line", BAD, ids=[b[0][0] for b in BAD])
def test_bad_numbers_are_one_line(overrides, line):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as info:
        OmegaConf.to_object(cfg)  # the schemas' rules (recipes/config.py), as the preflight runs them
    assert str(info.value) == line


def test_the_defaults_pass():
    cfg = compose_config([])
    OmegaConf.to_object(cfg)


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["data.digits=12", "model.d_model=0"], "model.d_model=0: must be >= 1"),  # model before data
        (["trainer.max_steps=0", "data.seq_len=999999"], "trainer.max_steps=0: must be >= 1"),  # a group's, then across
        (["data.seq_len=999999", "data.global_batch_size=0"], "data.global_batch_size=0: must be a positive multiple of"
         " the world size (1 ranks), each rank takes an equal share"),  # the world size, then across groups
    ],
)  # fmt: skip
def test_the_preflight_s_order(overrides, line, tmp_path):
    """With several mistakes, the first refused: each group's own rules (model, data, checkpoint, trainer: the
    schema's order), then the launcher, the device and the data for the world size, then the rules across
    groups (recipes/preflight.py)."""
    with pytest.raises(USER_ERRORS) as info:
        preflight(compose_config([*overrides, f"run_dir={tmp_path}"]))
    assert str(info.value) == line
