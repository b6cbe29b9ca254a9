"""One launch at a time per run_dir (recipes/run_lock.py). Seen before: two launches into one run_dir both exited
0, the second overwriting the first's checkpoints and interleaving metrics.jsonl."""

from __future__ import annotations

import os

import pytest

from optim_factory import ConfigError
from recipes.run_lock import RunDirLock
from recipes.train import compose_config, train
from tests.recipe.test_config_errors import cli, refused
from tests.recipe.test_train import QUICK, snapshot


def test_a_second_launch_into_a_run_dir_in_use_is_refused_and_changes_nothing(tmp_path):
    """Broken on purpose (no lock taken by train): the second launch trains."""
    run_dir = tmp_path / "run"
    cfg = compose_config([*QUICK, "trainer.max_steps=4", "trainer.progress=false", f"run_dir={run_dir}"])
    with RunDirLock(str(run_dir)):  # a launch in progress (this process, another open file: flock conflicts)
        before = snapshot(run_dir)
        with pytest.raises(ConfigError) as info:
            train(cfg)
        assert str(info.value) == (
            f"run_dir='{run_dir}': another launch is training in it (pid {os.getpid()} on {os.uname().nodename}); "
            "wait for it to end, or use another run_dir"
        )
        assert snapshot(run_dir) == before  # no launch record, no train.log, no checkpoint
    assert train(cfg)["end_step"] == 4  # released: the next launch trains
    assert train(cfg)["start_step"] == 4  # and every launch released it at its end


def test_a_launch_from_another_process_is_one_line_with_exit_code_2(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_config([*QUICK, "trainer.max_steps=4", "trainer.progress=false", f"run_dir={run_dir}"]))
    with RunDirLock(str(run_dir)):  # as a launch training on from step 4 would hold it
        before = sorted(map(str, run_dir.rglob("*"))), snapshot(run_dir)
        line = refused(cli(*QUICK, "trainer.max_steps=8", f"run_dir={run_dir}"))
        assert (sorted(map(str, run_dir.rglob("*"))), snapshot(run_dir)) == before
    assert line.startswith(f"run_dir='{run_dir}': another launch is training in it (pid {os.getpid()} on ")
