"""One launch at a time per run_dir (recipes/run_lock.py): unlocked, two launches into one run_dir could both exit
0, the second overwriting the first's checkpoints and interleaving metrics.jsonl."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from optim_factory import ConfigError
from recipes.job import train
from recipes.run_lock import RunDirLock
from recipes.train import compose_config
from tests.distributed.launch import recipe_ranks
from tests.recipe.runs import QUICK, cli, refused, snapshot


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


@pytest.mark.slow
def test_every_rank_refuses_a_run_dir_in_use_and_none_waits(tmp_path):
    """Only rank 0 takes the lock: it shares its verdict after the process group is up, so both ranks give the
    line and exit (none is left waiting in the rendezvous while rank 0 alone refuses)."""
    run_dir = tmp_path / "run"
    with RunDirLock(str(run_dir)):
        ranks = recipe_ranks([*QUICK, "trainer.max_steps=4", f"run_dir={run_dir}"], 2, tmp_path / "out", timeout=180)
    for rank in ranks:
        assert "another launch is training in it" in refused(rank)


@pytest.mark.slow
def test_two_ranks_without_checkpoints_start_in_a_fresh_run_dir(tmp_path):
    """Rank 1 does not read rank 0's launch record as an earlier launch (which would refuse
    checkpoint.enabled=false)."""
    run_dir = tmp_path / "run"
    over = [*QUICK, "trainer.max_steps=4", "checkpoint.enabled=false", f"run_dir={run_dir}"]
    first = recipe_ranks(over, 2, tmp_path / "first")
    assert [rank.returncode for rank in first] == [0, 0], first
    for rank in recipe_ranks(over, 2, tmp_path / "again"):  # now an earlier launch is there: both ranks refuse
        assert "holds 1 earlier launch(es)" in refused(rank)


def test_a_file_system_without_flock_trains_without_the_lock(tmp_path, monkeypatch, caplog):
    import recipes.run_lock

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(recipes.run_lock, "_flock", lambda fd: refuse(fd, None))
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="recipes.train"):  # logged once the run's logging is set up
        summary = train(compose_config([*QUICK, "trainer.max_steps=2", "trainer.progress=false", f"run_dir={run_dir}"]))
    assert summary["end_step"] == 2
    assert any("refuses flock (No locks available)" in r.getMessage() for r in caplog.records)
    assert "refuses flock (No locks available)" in (run_dir / "train.log").read_text()


def test_a_run_dir_in_use_is_named_also_for_a_launch_without_checkpoints(tmp_path):
    """The lock is taken before the earlier-launch check: a launch training now is named as such (not as "holds 1
    earlier launch(es)")."""
    run_dir = tmp_path / "run"
    cfg = [*QUICK, "trainer.max_steps=2", "trainer.progress=false", f"run_dir={run_dir}"]
    train(compose_config(cfg))
    with RunDirLock(str(run_dir)), pytest.raises(ConfigError, match="another launch is training in it"):
        train(compose_config([*cfg, "checkpoint.enabled=false"]))


def test_a_lock_that_cannot_be_taken_is_one_line(tmp_path):
    """An OSError of rank 0's lock (here: .lock is a directory) is a refusal every rank gives, not a traceback on
    rank 0 alone."""
    run_dir = tmp_path / "run"
    (run_dir / ".lock").mkdir(parents=True)
    with pytest.raises(ConfigError) as info:
        train(compose_config([*QUICK, "trainer.max_steps=2", "trainer.progress=false", f"run_dir={run_dir}"]))
    assert str(info.value) == f"run_dir='{run_dir}': cannot take its lock (Is a directory)"


def test_a_second_launch_into_a_checkpoint_dir_in_use_is_refused(tmp_path):
    """Two launches, each with its own run_dir but one checkpoint.dir, at once: unlocked, the second would remove
    the first's checkpoint in progress, overwrite its steps and then fail; the first would exit 0 reporting
    checkpoints that hold the second's state. Broken on purpose (no checkpoint.dir lock): the second trains."""
    shared = tmp_path / "shared"
    cfg = [*QUICK, "trainer.max_steps=4", "trainer.progress=false", f"checkpoint.dir={shared}"]
    with RunDirLock(str(shared), "checkpoint.dir"):  # the first launch, training
        with pytest.raises(ConfigError) as info:
            train(compose_config([*cfg, f"run_dir={tmp_path / 'second'}"]))
        assert str(info.value).startswith(
            f"checkpoint.dir='{shared}': another launch is training in it (pid {os.getpid()} on "
        ), info.value
        assert str(info.value).endswith("wait for it to end, or use another checkpoint.dir")
        assert not (tmp_path / "second" / "launches").exists() and [p.name for p in shared.iterdir()] == [".lock"]
    assert train(compose_config([*cfg, f"run_dir={tmp_path / 'second'}"]))["end_step"] == 4


def test_a_checkpoint_dir_moved_away_from_the_run_s_checkpoints_is_refused(tmp_path):
    """checkpoint.dir changed in a run_dir with a finished launch is refused: it would train from step 0 again
    without a word and append a second history to metrics.jsonl."""
    run_dir = tmp_path / "run"
    cfg = [*QUICK, "trainer.max_steps=4", "trainer.progress=false", f"run_dir={run_dir}"]
    train(compose_config(cfg))
    before = snapshot(run_dir)
    with pytest.raises(ConfigError) as info:
        train(compose_config([*cfg, f"checkpoint.dir={run_dir / 'ck2'}"]))
    assert str(info.value).startswith(
        f"checkpoint.dir='{run_dir / 'ck2'}' holds no checkpoint, but the last launch in run_dir='{run_dir}' "
        f"saved into '{run_dir / 'checkpoints'}': this launch would train from step 0 again"
    ), info.value
    assert snapshot(run_dir) == before
