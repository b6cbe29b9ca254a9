"""Model and trainer numbers are checked before anything is built: one ConfigError line naming the key (not a
traceback after the run has started, nor silently accepted)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from optim_factory import ConfigError
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
