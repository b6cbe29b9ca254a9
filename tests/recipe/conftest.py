"""Trained runs that several tests read: each trained once per session (per pytest-xdist worker), in this process.
A test that changes a run works on a copy (``shutil.copytree``)."""

from __future__ import annotations

import shutil

import pytest

from recipes.job import train
from recipes.train import compose_config
from tests.recipe.runs import QUICK, complete_steps


@pytest.fixture(scope="session")
def run_at_step_10(tmp_path_factory):
    """The quick job stopped by ``trainer.max_steps=10`` (one checkpoint, step 10). Read only."""
    run_dir = tmp_path_factory.mktemp("at_step_10")
    train(compose_config([*QUICK, f"run_dir={run_dir}", "trainer.max_steps=10"]))
    return run_dir


@pytest.fixture
def run_dir(two_checkpoints, tmp_path):
    """A copy of :func:`two_checkpoints`'s run, for a test that changes it."""
    shutil.copytree(two_checkpoints, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture(scope="session")
def two_checkpoints(tmp_path_factory):
    """The quick job finished with ``checkpoint.keep_last=0``: complete checkpoints at steps 10 and 20, each with
    two ``.distcp`` files (``checkpoint.write_threads=2``: one per writer thread). Read only."""
    run_dir = tmp_path_factory.mktemp("two")
    train(compose_config([*QUICK, f"run_dir={run_dir}", "checkpoint.keep_last=0", "checkpoint.write_threads=2"]))
    assert complete_steps(run_dir) == [10, 20]
    return run_dir
