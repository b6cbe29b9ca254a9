"""A 2-rank run (20 steps, checkpoints at 10 and 20) and what its checkpoints do on 1 and 2 ranks: resharding
both ways, verification shared by the ranks, and a resume on 1 rank that continues the same run. The 2-rank
launches run the entry point on 2 gloo ranks with torchrun's variables, without its agent (tests/distributed/launch.py
recipe_ranks; tests/recipe/test_launchers.py runs the recipe under torchrun itself)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from recipes.checkpoint import CheckpointError, read_manifest
from recipes.checkpoint.checksums import writer_threads
from recipes.config import CheckpointConfig
from recipes.job import train
from recipes.train import compose_config
from tests.distributed.launch import recipe_ranks
from tests.recipe.runs import QUICK, metrics, stopped

pytestmark = pytest.mark.slow
OVER = [*QUICK, "trainer.log_every=1", "trainer.eval_every=10", "checkpoint.keep_last=0"]
STEP10 = "step_00000010"


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """``OVER`` on 2 ranks: its run directory and rank 0's stderr. Read only."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    run_dir = tmp / "run"
    ranks = recipe_ranks([*OVER, f"run_dir={run_dir}"], 2, tmp / "out")
    assert [rank.returncode for rank in ranks] == [0, 0], ranks
    return run_dir, ranks[0].stderr


def _from_step_10(two_rank_run, run_dir: Path) -> Path:
    """A new run directory holding only the 2-rank run's step-10 checkpoint."""
    shutil.copytree(two_rank_run[0] / "checkpoints" / STEP10, run_dir / "checkpoints" / STEP10)
    return run_dir


def _assert_reports_count_every_rank_s_bytes(run_dir: Path, steps: list[int]) -> None:
    """The run's checkpoint reports are of ``steps``, each with the bytes of every rank's files (rank 0 reports
    them)."""
    reports = [r for r in metrics(run_dir) if r["kind"] == "checkpoint"]
    assert [r["step"] for r in reports] == steps
    for r in reports:
        files = [p for p in Path(r["path"]).iterdir() if p.name != "COMPLETE.json"]
        assert r["written_bytes"] == sum(p.stat().st_size for p in files), r


def _run(run_dir, *extra):
    return train(compose_config([*OVER, f"run_dir={run_dir}", *extra]))


def test_every_rank_writes_its_file_and_rank_0_reports_all_bytes(two_rank_run, monkeypatch):
    run_dir, stderr = two_rank_run
    assert "world_size=2" in stderr
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as the ranks had it: the host's CPUs shared between them
    threads = writer_threads(CheckpointConfig().write_threads)  # one file per rank and writer thread
    assert f"checkpoints: {threads} writer thread(s) per rank" in stderr
    assert set(read_manifest(run_dir / "checkpoints" / STEP10)["files"]) == {
        ".metadata",
        *(f"__{rank}_{i}.distcp" for rank in range(2) for i in range(threads)),
    }
    _assert_reports_count_every_rank_s_bytes(run_dir, [10, 20])


def test_resharding_both_ways(two_rank_run, tmp_path):
    """2-rank checkpoint → 1 rank (this process) → its 1-rank checkpoint → 2 ranks."""
    run_dir = _from_step_10(two_rank_run, tmp_path / "run")
    assert _run(run_dir, "trainer.max_steps=30", "trainer.stop_at=20")["start_step"] == 10
    assert "saved by 2 rank(s)" in (run_dir / "train.log").read_text()
    back = recipe_ranks([*OVER, f"run_dir={run_dir}", "trainer.max_steps=30"], 2, tmp_path / "ranks")
    assert [rank.returncode for rank in back] == [0, 0], back
    assert "saved by 1 rank(s)" in back[0].stderr  # rank 0 logs the resume
    _assert_reports_count_every_rank_s_bytes(run_dir, [20, 30])


def test_a_two_rank_checkpoint_verifies_on_one_and_two_ranks(two_rank_run, tmp_path):
    """Files do not depend on the world size: a 2-rank checkpoint verifies on 1 rank (which reads rank 1's file
    too), and 2 ranks share the verification (rank 1 checks __0_0.distcp; both ranks stop with the same line)."""
    good = _from_step_10(two_rank_run, tmp_path / "good")
    two = _from_step_10(two_rank_run, tmp_path / "two")
    assert _run(good, "trainer.max_steps=12")["start_step"] == 10  # 2 -> 1 rank, verified

    shard = two / "checkpoints" / STEP10 / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    with pytest.raises(CheckpointError, match=r"step_00000010 is damaged: __1_0.distcp: checksum mismatch"):
        _run(two, "trainer.max_steps=12")
    shutil.copy(two_rank_run[0] / "checkpoints" / STEP10 / "__1_0.distcp", shard)
    zero = two / "checkpoints" / STEP10 / "__0_0.distcp"
    zero.write_bytes(zero.read_bytes()[:100])
    ranks = recipe_ranks([*OVER, f"run_dir={two}", "trainer.max_steps=12"], 2, tmp_path / "ranks")
    for rank in ranks:  # both ranks stop with the same verdict
        assert re.match(r"checkpoint \S+ is damaged: __0_0.distcp: truncated \(100 of ", stopped(rank)), rank.stderr


def test_resumed_on_one_rank_it_continues_the_same_run(two_rank_run, tmp_path):
    """Resumed on 1 rank from step 10, the run logs the loss curve of the uninterrupted 2-rank run. The logged
    loss is the mean over ranks of each rank's mean over its equal share, i.e. the mean over the global batch on
    either world size; FSDP2 averages gradients over ranks the same way."""
    two = two_rank_run[0]
    one = _from_step_10(two_rank_run, tmp_path / "one")
    summary = _run(one)
    assert summary["start_step"] == 10 and summary["resumed_from"].endswith(STEP10)

    def curve(run_dir, kind, key):
        return {r["step"]: r[key] for r in metrics(run_dir) if r["kind"] == kind and r["step"] > 10}

    a, b = curve(two, "train", "loss"), curve(one, "train", "loss")
    assert sorted(a) == sorted(b) == list(range(11, 21))
    diff = max(abs(a[s] - b[s]) for s in a)
    # measured: 2.4e-7 (fp32 reduction order: 2 half-batch means and a gradient average vs one global mean);
    # a per-rank batch of the global size (twice the global batch on 2 ranks) makes the curves differ by 7.7e-3
    assert diff < 1e-5, (diff, a, b)
    ea, eb = curve(two, "eval", "eval_loss"), curve(one, "eval", "eval_loss")
    assert list(ea) == list(eb) == [20]
    assert abs(ea[20] - eb[20]) < 1e-5, (ea, eb)
