"""A checkpoint directory on a small real file system (a tmpfs): a save that cannot fit is refused before it
writes, one that runs out of space mid-write says "disk full"; the older checkpoint stays intact either way."""

from __future__ import annotations

import errno
import re
import shutil
import subprocess
import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from recipes.checkpoint import disk_full, is_complete
from recipes.checkpoint.layout import interrupted
from tests.recipe.runs import QUICK, cli, metrics, snapshot, stopped

# measured on this CPU with torch 2.13: the quick job's checkpoint writes about 1.71 MB (its .metadata varies with
# the path's length); the first save's estimate, this rank's model and optimizer tensors, is 1.28 MB


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(bytes)``: a tmpfs of that size mounted under ``tmp_path`` (skipped where mounting is not
    allowed: it needs root)."""
    mounts = []

    def mount(size: int):
        if shutil.which("mount") is None:
            pytest.skip("cannot mount a tmpfs here: no mount command")
        where = tmp_path / f"fs{len(mounts)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip() or proc.returncode}")
        mounts.append(where)
        return where

    yield mount
    busy = []  # a file the failed save left open keeps its tmpfs busy
    for where in mounts:
        proc = subprocess.run(["umount", str(where)], capture_output=True)
        if proc.returncode != 0:
            busy.append(f"{where}: {proc.stderr.decode().strip() or proc.returncode}")
            subprocess.run(["umount", "-l", str(where)], check=False)  # detached, gone once the file is closed
    assert not busy, f"not unmounted after the test (a file left open?): {busy}"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_that_cannot_fit_is_refused_before_it_writes(async_save, small_fs, tmp_path):
    """Room for one checkpoint (1.71 MB of 3 MiB): step 10 saves, step 20 (needing what step 10 wrote) is one
    line naming the directory, the bytes free and needed, exit 2; step 10 untouched, nothing of step 20; the
    next launch resuming from step 10 is refused in one line before its first step."""
    ck = small_fs(3 << 20) / "checkpoints"
    proc = cli(*QUICK, f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={ck}", f"checkpoint.async_save={async_save}")
    line = stopped(proc)
    written = next(r["written_bytes"] for r in metrics(tmp_path / "run") if r["kind"] == "checkpoint")
    numbers = re.fullmatch(r".*: (\d+) bytes free, the save needs about (\d+)\) \(rank 0\); the newest .*", line)
    free, needed = map(int, numbers.groups())
    assert line.startswith(f"not saving step 20: no room for it ({ck}: "), line
    assert free < needed == written and "the newest good checkpoint is" in line, line
    assert sorted(p.name for p in ck.iterdir() if p.name != ".lock") == ["step_00000010"]
    before = snapshot(ck)
    assert is_complete(ck / "step_00000010")
    trained = [r for r in metrics(tmp_path / "run") if r["kind"] == "train"]
    again = cli(*QUICK, f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={ck}", f"checkpoint.async_save={async_save}")
    line = stopped(again)
    assert line.startswith(
        f"not resuming from {ck / 'step_00000010'}: no room for the run's next checkpoint ({ck}: "
    ), line
    numbers = re.fullmatch(r".*: (\d+) bytes free, the save needs about (\d+)\); free space there, .*", line)
    free, needed = map(int, numbers.groups())
    assert free < written <= needed, line  # the step-10 checkpoint's files: its .distcp and .metadata, its markers
    assert snapshot(ck) == before
    assert [r for r in metrics(tmp_path / "run") if r["kind"] == "train"] == trained  # refused before its first step


def test_a_fresh_run_whose_first_save_cannot_fit_is_refused_before_its_first_step(small_fs, tmp_path):
    """1 MiB, under the first save's estimate (1.28 MB: the model's bytes and two FP32 moments per parameter
    element): refused in one line before the first step, nothing trained, nothing recorded. Broken on purpose (the
    check on resume only): the run trains 10 steps and then its save is refused. The checkpoint.dir it made is
    removed again (the launch leaves the disk as it found it); one that was there stays."""
    ck = small_fs(1 << 20) / "checkpoints"
    run = tmp_path / "run"
    line = stopped(cli(*QUICK, f"run_dir={run}", f"checkpoint.dir={ck}"))
    numbers = re.fullmatch(
        rf"not training: no room for the run's first checkpoint \({ck}: (\d+) bytes free, the save needs about "
        r"(\d+)\); free space there, or give another checkpoint.dir",
        line,
    )
    assert numbers, line
    free, needed = map(int, numbers.groups())
    assert free < needed and needed > 1_000_000, line
    assert not (run / "metrics.jsonl").exists() and not list((run / "launches").iterdir())  # nothing trained
    assert not ck.exists()  # the checkpoint.dir this launch made is removed: the disk as the launch found it
    ck.mkdir()
    (ck / "mine").write_text("kept")  # a checkpoint.dir that was there is left as it is, the lock file included
    assert stopped(cli(*QUICK, f"run_dir={run}", f"checkpoint.dir={ck}")).startswith("not training: no room")
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "mine"]


def test_a_write_that_runs_out_of_space_says_disk_full(small_fs, tmp_path):
    """1.5 MiB: the first save's estimate (1.28 MB) fits, its files (1.71 MB) do not: the write fails with ENOSPC
    and the line says "disk full" with the path and the bytes free."""
    ck = small_fs(3 << 19) / "checkpoints"
    proc = cli(*QUICK, f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={ck}")
    line = stopped(proc)
    assert line.startswith(f"disk full: saving {ck / 'step_00000010'} failed, its partial files removed ("), line
    assert f"bytes free in {ck}): " in line, line
    assert not ck.exists()  # made by this launch, which saved nothing


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as raised:  # noqa: BLE001
        return raised


def test_disk_full_is_recognised_however_dcp_reports_it():
    """ENOSPC as DCP reports it (a rank's failure inside ``CheckpointException``, or a cause), and torch's short
    write of a zip record when the disk fills up mid-file; other write failures are not "disk full"."""
    enospc = OSError(errno.ENOSPC, "No space left on device")
    per_rank = CheckpointException("save failed", {0: (enospc, traceback.extract_stack())})
    assert disk_full(per_rank)
    assert disk_full(_raised(RuntimeError("saving failed"), enospc))
    assert disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    denied = PermissionError(errno.EACCES, "Permission denied")
    other = CheckpointException("save failed", {1: (denied, traceback.extract_stack())})
    assert not disk_full(other)
    assert not disk_full(_raised(RuntimeError("saving failed"), OSError(errno.EIO, "I/O error")))


def test_a_ctrl_c_inside_a_save_is_recognised_however_dcp_reports_it():
    """A second Ctrl-C while DCP writes raises KeyboardInterrupt in a rank's thread; DCP reports it as that rank's
    failure: the save re-raises it (the stop at once the user asked for), any other failure stays a failed save."""
    per_rank = CheckpointException("save failed", {0: (KeyboardInterrupt(), traceback.extract_stack())})
    assert interrupted(per_rank) and interrupted(_raised(RuntimeError("saving failed"), KeyboardInterrupt()))
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert not interrupted(CheckpointException("save failed", {1: (denied, traceback.extract_stack())}))
