"""Checkpoint integrity (issue 15, observations 7 and 8): checksums recorded at save time and verified before a
load, fallback only to a checkpoint that verifies, non-finite training stopped before it is saved, keep_last never
deleting the newest verified checkpoint, the resolved config stored in each checkpoint's manifest."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
from omegaconf import OmegaConf

from optim_factory import ConfigError
from recipes.checkpoint import FALLBACK_HINT, MARKER, CheckpointError, is_complete, read_checkpoint, read_manifest
from recipes.checkpoint.checksums import MANIFEST_DIGEST, writer_threads
from recipes.checkpoint.layout import DAMAGED_KEPT, set_aside, write_manifest
from recipes.job import train
from recipes.train import compose_config
from tests.recipe.runs import QUICK, cli, complete_steps, run_cli, snapshot, stopped

STEP20 = "step_00000020"


def _run(run_dir, *extra):
    return train(compose_config([*QUICK, f"run_dir={run_dir}", *extra]))


def _shard(run_dir, step_dir=STEP20, name="__0_0.distcp"):
    return run_dir / "checkpoints" / step_dir / name


def _assert_refused(run_dir, fragment):
    """Resuming raises one CheckpointError line naming the checkpoint, the file and the reason, with the
    fallback hint; nothing on disk changes."""
    before = snapshot(run_dir / "checkpoints")
    with pytest.raises(CheckpointError) as info:
        _run(run_dir, "trainer.max_steps=25")
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert f"checkpoint {run_dir / 'checkpoints' / STEP20} is damaged: {fragment}" in msg, msg
    assert msg.endswith(FALLBACK_HINT), msg
    assert snapshot(run_dir / "checkpoints") == before
    return msg


def _all_finite(path) -> bool:
    state = read_checkpoint(path)
    return all(torch.isfinite(v).all() for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_obs7_overwritten_bytes_are_refused_and_fallback_resumes_from_the_previous_verified(run_dir, tmp_path):
    shard = _shard(run_dir)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # 4 KiB of 0xFF in the middle of the shard, size unchanged
        f.seek(size // 2)
        f.write(b"\xff" * 4096)
    assert shard.stat().st_size == size
    _assert_refused(run_dir, "__0_0.distcp: checksum mismatch (xxh3_64 ")
    summary = _run(run_dir, "trainer.max_steps=25", "checkpoint.fallback=true")
    assert summary["resumed_from"].endswith("step_00000010") and summary["start_step"] == 10
    assert math.isfinite(summary["last_loss"])
    assert _all_finite(run_dir / "checkpoints" / "step_00000025")


def test_obs8_truncated_shard_names_the_file_and_the_reason(run_dir):
    shard = _shard(run_dir)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    _assert_refused(run_dir, f"__0_0.distcp: truncated ({size // 2} of {size} bytes)")


def test_missing_file_is_refused(run_dir):
    _shard(run_dir).unlink()
    _assert_refused(run_dir, "__0_0.distcp: missing")


def test_the_last_file_of_a_rank_s_share_is_verified_too(run_dir):
    """Each writer thread writes a file of its own: damage in the last of them (by name, as the ranks deal them
    out) is refused as in the first."""
    shards = sorted(p.name for p in (run_dir / "checkpoints" / STEP20).glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp"], shards
    last = _shard(run_dir, name=shards[-1])
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    last.write_bytes(bytes(data))
    _assert_refused(run_dir, f"{shards[-1]}: checksum mismatch")


def test_corrupted_metadata_is_refused(run_dir):
    meta = _shard(run_dir, name=".metadata")
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    meta.write_bytes(bytes(data))
    _assert_refused(run_dir, ".metadata: checksum mismatch")


def test_fallback_goes_only_to_a_checkpoint_that_verifies(run_dir):
    for step_dir in (STEP20, "step_00000010"):
        _shard(run_dir, step_dir).unlink()
    with pytest.raises(CheckpointError, match=r"step_00000010 is damaged: __0_0.distcp: missing") as info:
        _run(run_dir, "trainer.max_steps=25", "checkpoint.fallback=true")
    # the hint is not "set checkpoint.fallback=true" (it is set): it says why it did not help
    assert str(info.value).endswith("; no older complete checkpoint is left to fall back to"), info.value


def test_a_given_path_that_is_damaged_says_fallback_does_not_apply_to_it(run_dir):
    _shard(run_dir).unlink()
    given = f"checkpoint.resume={run_dir / 'checkpoints' / STEP20}"
    with pytest.raises(CheckpointError) as info:
        _run(run_dir, "trainer.max_steps=25", "checkpoint.fallback=true", given)
    assert str(info.value).endswith("; checkpoint.fallback applies to resume=auto, not to a given path"), info.value


def test_a_given_path_older_than_a_complete_checkpoint_is_refused(run_dir):
    """resume=<step 10> with complete 20 beside it is refused: trained on, the next resume=auto would jump to 20,
    the branch's own steps dropped (keep_last would delete them first). Broken on purpose (no check): training
    starts."""
    before = snapshot(run_dir)
    given = run_dir / "checkpoints" / "step_00000010"
    with pytest.raises(CheckpointError) as info:
        _run(run_dir, "trainer.max_steps=25", f"checkpoint.resume={given}")
    assert str(info.value) == (
        f"checkpoint.resume='{given}' but checkpoint.dir='{run_dir / 'checkpoints'}' holds newer complete checkpoints "
        f"({STEP20}), which a later resume=auto would continue instead of this run; use checkpoint.resume=auto to "
        "continue the newest, another checkpoint.dir (e.g. run_dir=<new>) to train on from step_00000010, or remove "
        "the newer ones to rewind this run"
    )
    assert snapshot(run_dir) == before  # refused before anything is written (no launch record either)
    _run(run_dir.parent / "branch", "trainer.max_steps=25", f"checkpoint.resume={given}")  # a branch of its own


@pytest.mark.parametrize("how", ["symlink", "copy"])
def test_a_given_path_not_named_by_its_step_is_compared_by_its_manifest(run_dir, how):
    """resume=<a symlink to step 10, or a copy of it> gets the check above by its manifest's step: by the folder's
    name it would skip it, train again over the complete steps 15/20, and every requeue would rewind there again.
    Broken on purpose (the step from the name only): training starts."""
    given = run_dir / "latest_good"
    if how == "symlink":
        given.symlink_to(run_dir / "checkpoints" / "step_00000010")
    else:
        shutil.copytree(run_dir / "checkpoints" / "step_00000010", given)
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError, match=rf"holds newer complete checkpoints \({STEP20}\)"):
        _run(run_dir, "trainer.max_steps=25", f"checkpoint.resume={given}")
    assert snapshot(run_dir) == before


def test_a_renamed_checkpoint_is_refused_as_damaged(run_dir):
    """step_00000020 renamed step_00000030 would resume "at step 20" without a word (resume=auto and keep_last go
    by the name). Broken on purpose (no name check): the run trains from step 20."""
    checkpoints = run_dir / "checkpoints"
    (checkpoints / STEP20).rename(checkpoints / "step_00000030")
    with pytest.raises(CheckpointError) as info:
        _run(run_dir, "trainer.max_steps=40")
    assert str(info.value).startswith(
        f"checkpoint {checkpoints / 'step_00000030'} is damaged: its name says step 30, its COMPLETE.json step 20 "
        "(renamed?); "
    ), info.value


def test_checkpointing_off_in_a_run_dir_with_checkpoints_is_refused_by_its_launches(run_dir):
    """checkpoint.enabled=false in a run_dir with checkpoints would train from step 0 and append a second
    history to metrics.jsonl. The launch that wrote them is on record (launches/): refused by that."""
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"^checkpoint.enabled=false but run_dir=.* holds 1 earlier launch\(es\)"):
        _run(run_dir, "checkpoint.enabled=false")
    assert snapshot(run_dir) == before


def test_checkpointing_off_after_an_earlier_launch_is_refused(tmp_path):
    """A second launch with checkpoint.enabled=false would train from step 0 and append a second step 1.. to
    metrics.jsonl. The first launch into a fresh run_dir trains."""
    _run(tmp_path, "checkpoint.enabled=false", "trainer.max_steps=3")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"^checkpoint.enabled=false but run_dir=.* holds 1 earlier launch\(es\)"):
        _run(tmp_path, "checkpoint.enabled=false", "trainer.max_steps=3")
    assert snapshot(tmp_path) == before


def test_a_crash_of_a_one_process_run_completes_the_save_in_flight(tmp_path, monkeypatch):
    """An exception at step 7 finishes the async save of step 5 (written): without its marker the next launch
    would remove it and start at step 0. Broken on purpose (no finishing): step 5 is incomplete."""
    import recipes.job

    def fail(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(recipes.job, "evaluate", fail)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        _run(tmp_path, "checkpoint.async_save=true", "checkpoint.every_steps=5", "trainer.eval_every=7")
    assert complete_steps(tmp_path) == [5]
    summary = _run(tmp_path, "checkpoint.async_save=true", "checkpoint.every_steps=5", "trainer.eval_every=0")
    assert summary["start_step"] == 5


@pytest.mark.parametrize("async_save", [False, True])
def test_manifest_records_every_file_with_its_checksum_and_the_resolved_config(async_save, tmp_path, caplog):
    cfg = compose_config([*QUICK, f"run_dir={tmp_path}", f"checkpoint.async_save={async_save}", "optim.eps=1e-7"])
    with caplog.at_level(logging.INFO, logger="recipes.train"):
        train(cfg)
    said = f"checkpoints: {writer_threads(0)} writer thread(s) per rank (checkpoint.write_threads=0: min(4, the CPUs"
    assert any(r.getMessage().startswith(said) for r in caplog.records), [r.getMessage() for r in caplog.records]
    for step in (10, 20):
        path = tmp_path / "checkpoints" / f"step_{step:08d}"
        manifest = read_manifest(path)
        on_disk = {p.name for p in path.iterdir() if p.name != MARKER}
        threads = writer_threads(cfg.checkpoint.write_threads)  # one file per writer thread
        assert set(manifest["files"]) == on_disk == {".metadata", *(f"__0_{i}.distcp" for i in range(threads))}
        for name, record in manifest["files"].items():
            data = (path / name).read_bytes()
            assert record == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name
        assert manifest["config"] == OmegaConf.to_container(cfg, resolve=True)
        assert manifest["config"]["optim"]["eps"] == 1e-7


def test_each_checkpoint_keeps_the_config_that_produced_it(tmp_path):
    _run(tmp_path, "trainer.stop_at=10", "optim.weight_decay=0.05")
    _run(tmp_path, "optim.weight_decay=0.07")
    ck = tmp_path / "checkpoints"
    assert read_manifest(ck / "step_00000010")["config"]["optim"]["weight_decay"] == 0.05
    assert read_manifest(ck / STEP20)["config"]["optim"]["weight_decay"] == 0.07


@pytest.mark.parametrize(
    "old,new",
    [
        ('"d_ff": 256', '"d_ff": 257'),
        ('"step": 20', '"step": 31'),
        ('"exp_avg_dtype": "fp32"', '"exp_avg_dtype": "fp22"'),
    ],
    ids=["architecture", "step", "invalid-value"],
)
def test_a_changed_byte_in_the_manifest_is_refused_before_its_config_is_trusted(run_dir, old, new):
    """Unhashed, d_ff 256 -> 257 in COMPLETE.json would refuse the resume as a config change (even with fallback), a
    step edit would be ignored, an invalid dtype "converted". Broken on purpose (manifest unhashed): those again."""
    marker = run_dir / "checkpoints" / STEP20 / MARKER
    text = marker.read_text()
    assert text.count(old) == 1, old
    marker.write_text(text.replace(old, new))
    msg = _assert_refused(run_dir, "COMPLETE.json: its own checksum does not match")
    assert "d_ff" not in msg and "fp22" not in msg
    summary = _run(run_dir, "trainer.max_steps=25", "checkpoint.fallback=true")  # an older one that verifies
    assert summary["start_step"] == 10


def test_checkpoint_without_checksums_loads_with_a_warning(run_dir, caplog):
    """Checkpoints written before checksums were recorded (no ``files`` in the manifest) are accepted,
    with one warning naming the checkpoint; a damaged one of them fails as DCP finds it."""
    marker = run_dir / "checkpoints" / STEP20 / MARKER
    manifest = json.loads(marker.read_text())
    for key in ("files", "checksum", "config", MANIFEST_DIGEST):  # as written then
        del manifest[key]
    marker.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="recipes.checkpoint"):
        summary = _run(run_dir, "trainer.max_steps=25")
    assert summary["start_step"] == 20
    warned = [r.getMessage() for r in caplog.records if "has no checksums" in r.getMessage()]
    assert len(warned) == 1 and STEP20 in warned[0] and "loading it unverified" in warned[0]


def test_keep_last_never_deletes_the_newest_verified_checkpoint(run_dir):
    """Step 20 has no checksums (loaded unverified, so never set aside) and a missing shard; the run falls back to
    10 and saves 15. keep_last=1 would keep only the highest step (the broken 20): 15, the newest that loaded or
    was saved, stays, and the next resume uses it."""
    marker = run_dir / "checkpoints" / STEP20 / MARKER
    manifest = json.loads(marker.read_text())
    for key in ("files", "checksum", "config", MANIFEST_DIGEST):  # as written before checksums were recorded
        del manifest[key]
    marker.write_text(json.dumps(manifest))
    _shard(run_dir).unlink()
    common = ["checkpoint.fallback=true", "checkpoint.keep_last=1", "checkpoint.every_steps=5"]
    summary = _run(run_dir, "trainer.max_steps=15", *common)
    assert summary["start_step"] == 10
    ck = run_dir / "checkpoints"
    assert is_complete(ck / "step_00000015") and not (ck / "step_00000010").exists()
    summary = _run(run_dir, "trainer.max_steps=18", *common)
    assert summary["resumed_from"].endswith("step_00000015")


def test_set_aside_checkpoints_are_bounded_to_the_newest(tmp_path):
    """Four checkpoints written in the order of their steps, found damaged and set aside in another order: the
    DAMAGED_KEPT set aside last stay, whatever their steps, names and the times they were written, also where the
    clock gave two of them one time (its ticks are coarse) or one set aside earlier has a later time than now (a
    clock set back, another host's). Broken on purpose (each folder's time the clock's): the last one set aside
    here was deleted."""
    assert DAMAGED_KEPT == 2
    for step in (1, 2, 3, 4, 5):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / "__0_0.distcp").write_text(str(step))
    for step in (3, 2, 4, 1):
        set_aside(tmp_path / f"step_{step:08d}")
    assert sorted(p.name for p in tmp_path.glob("*.damaged")) == ["step_00000001.damaged", "step_00000004.damaged"]
    later = time.time_ns() + 60 * 10**9  # a minute ahead of this clock, 4 set aside after 1
    for n, step in enumerate((1, 4)):
        os.utime(tmp_path / f"step_{step:08d}.damaged", ns=(later + n, later + n))
    set_aside(tmp_path / "step_00000005")
    assert sorted(p.name for p in tmp_path.glob("*.damaged")) == ["step_00000004.damaged", "step_00000005.damaged"]


def test_a_damaged_checkpoint_takes_no_keep_last_place(tmp_path, caplog):
    """Steps 10 and 20 saved, 8 bytes flipped in the middle of step 20's shard; the next run with fallback resumes
    from 10 and saves 15, 30 and 35. The damaged 20 is set aside once 10 has loaded (renamed, said in one line), so
    keep_last=3 keeps the three good checkpoints 15, 30, 35 and the resume after them takes 35."""
    _run(tmp_path, "trainer.max_steps=20", "checkpoint.every_steps=10", "checkpoint.keep_last=3")
    shard = tmp_path / "checkpoints" / "step_00000020" / "__0_0.distcp"
    middle = shard.stat().st_size // 2
    with open(shard, "r+b") as f:
        f.seek(middle)
        flipped = bytes(b ^ 0xFF for b in f.read(8))
        f.seek(middle)
        f.write(flipped)
    again = ["checkpoint.every_steps=15", "checkpoint.keep_last=3", "checkpoint.fallback=true"]
    with caplog.at_level(logging.WARNING, logger="recipes.checkpoint"):
        summary = _run(tmp_path, "trainer.max_steps=35", *again)
    assert summary["start_step"] == 10
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "recipes.checkpoint" and r.levelno == logging.WARNING and "step_00000020" in r.getMessage()
    ]
    assert len(said) == 2 and "checksum mismatch" in said[0] and "trying the older" in said[0], said
    assert said[1].endswith("step_00000020 as step_00000020.damaged: neither resume nor keep_last counts it")
    ck = tmp_path / "checkpoints"
    assert [Path(p).name for p in summary["kept_checkpoints"]] == ["step_00000015", "step_00000030", "step_00000035"]
    assert sorted(p.name for p in ck.iterdir() if p.name != ".lock") == [
        "step_00000015",
        "step_00000020.damaged",
        "step_00000030",
        "step_00000035",
    ]
    assert complete_steps(tmp_path) == [15, 30, 35]
    assert _run(tmp_path, "trainer.max_steps=36", *again)["resumed_from"].endswith("step_00000035")


def test_fallback_sets_aside_only_a_damaged_checkpoint_not_one_this_run_cannot_load(tmp_path, caplog):
    """With checkpoint.fallback, a newest checkpoint that verifies but does not load into this run (here: another
    model's shapes, refused by DCP) is skipped for the older one and left as it is: only damage (a failed
    verification) renames a checkpoint ``.damaged``; a fitting run may still resume from it."""
    from optim_factory import PortableFusedAdam
    from recipes.checkpoint import CheckpointManager
    from recipes.config import CheckpointConfig

    def build(width):
        model = torch.nn.Linear(4, width)
        opt = PortableFusedAdam(model.parameters(), lr=1e-2)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return model, opt

    cfg = CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=1, keep_last=0, fallback=True)
    for step, width in ((1, 3), (2, 5)):
        manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"))
        manager.saver.save(step, *build(width), {"step": step})
        manager.saver.close()
    manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="recipes.checkpoint"):
        path, state = manager.resume(*build(3), {"step": 0})
    manager.saver.close()
    assert Path(path).name == "step_00000001" and state["step"] == 1
    assert any("step_00000002 cannot be loaded into this run" in r.getMessage() for r in caplog.records), caplog.text
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000001", "step_00000002"]
    assert is_complete(tmp_path / "ck" / "step_00000002")


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_before_the_next_save(tmp_path):
    """lr=1e30: the first step moves every weight by ~1e29 (finite, saved at step 1); the second forward
    overflows, its loss is NaN: one line, exit 2 (a process: a refusal after the process group and a save),
    and no checkpoint of that step or later exists."""
    proc = run_cli([*QUICK, f"run_dir={tmp_path}", "optim.lr=1e30", "checkpoint.every_steps=1", "trainer.max_steps=5"])
    last = stopped(proc)
    assert last.startswith("step 2: non-finite loss or gradient norm (NaN/inf); stopped before saving"), last
    assert "step_00000001" in last
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.iterdir() if p.name != ".lock") == ["step_00000001"]
    assert _all_finite(ck / "step_00000001")


def test_a_non_finite_loss_between_checkpoints_is_named_by_its_step(tmp_path):
    """As above with no save at steps 2-3: step 2's flag is read at step 3's check (between checkpoints a flag is
    read one check late), which stops the run there and names step 2."""
    args = ["optim.lr=1e30", "checkpoint.every_steps=4", "trainer.max_steps=5", "trainer.log_every=1"]
    proc = cli(*QUICK, f"run_dir={tmp_path}", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 2: non-finite loss or gradient norm (NaN/inf); stopped before saving"), last
    assert "the newest good checkpoint is none" in last and not (tmp_path / "checkpoints" / "step_00000004").exists()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]  # step 3 ran: the flag was read late


def test_a_non_finite_state_is_never_saved(tmp_path):
    """lr=1e39 (inf in FP32): the first step's loss and gradient norm are finite, its update is not; the save
    due after it refuses, and leaves no directory behind."""
    with pytest.raises(CheckpointError) as info:
        _run(tmp_path, "optim.lr=1e39", "checkpoint.every_steps=1", "trainer.max_steps=5")
    assert str(info.value).startswith("not saving step 1: the model or optimizer state holds non-finite values")
    assert not (tmp_path / "checkpoints").exists()  # made by this launch, which saved nothing: removed again


def test_a_resume_reads_each_candidate_s_manifest_once(run_dir, monkeypatch):
    """The config check and the verification share the manifest the load read (its hash checked once)."""
    from recipes.checkpoint import load

    reads = []
    real = load.read_manifest
    monkeypatch.setattr(load, "read_manifest", lambda path, key=None: reads.append(path) or real(path, key))
    _run(run_dir, "trainer.max_steps=25")
    assert reads == [run_dir / "checkpoints" / STEP20]


def test_the_marker_is_on_disk_whole_before_it_takes_its_name_and_the_directory_after(tmp_path, monkeypatch):
    synced = []  # (what was fsynced, its size then, whether COMPLETE.json was there then)
    fsync = os.fsync

    def spy(fd: int) -> None:
        fsync(fd)
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        synced.append((name, os.fstat(fd).st_size, (tmp_path / MARKER).exists()))

    monkeypatch.setattr(os, "fsync", spy)
    write_manifest(tmp_path, {"step": 3}, None)
    size = (tmp_path / MARKER).stat().st_size
    assert synced[0] == (MARKER + ".tmp", size, False)  # whole, under its temporary name
    assert synced[1][0] == tmp_path.name and synced[1][2]  # then the directory, holding the renamed marker
    assert read_manifest(tmp_path)["step"] == 3


def test_a_write_that_failed_in_its_calling_thread_records_nothing_into_the_next_save(tmp_path, monkeypatch):
    """DCP joins its extra writer threads only once the calling thread's files are written: after a write that
    failed in the calling thread, another thread of it may still be writing, and records its file's checksum when
    it closes it. Here that thread closes its file after the next save was written and before its manifest is
    sealed: the manifest holds the next save's own checksums, each matching its file."""
    from optim_factory import PortableFusedAdam
    from recipes.checkpoint import CheckpointManager
    from recipes.checkpoint.checksums import ChecksumFileSystem, file_problem
    from recipes.config import CheckpointConfig

    opened, release, recorded = threading.Event(), threading.Event(), threading.Event()
    first = threading.Event()  # the first save's streams: its calling thread's fails, another's waits for release
    first.set()
    real = ChecksumFileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if not first.is_set() or mode != "wb" or not str(path).endswith(".distcp"):
            with real(self, path, mode) as stream:
                yield stream
            return
        if threading.get_ident() == self.caller:  # the first save's calling thread fails once the other has opened
            opened.wait(60)
            raise OSError(errno.EIO, "the test's failed write")
        with real(self, path, mode) as stream:
            opened.set()
            release.wait(60)
            yield stream
        recorded.set()  # closed and its checksum recorded

    monkeypatch.setattr(ChecksumFileSystem, "create_stream", create_stream)

    def on_phase(phase, step, path):  # the next save is written, its manifest not sealed yet
        if (phase, step) == ("write", 2):
            release.set()
            assert recorded.wait(60)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = PortableFusedAdam(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.ones(2, 64)).sum().backward()
        opt.step()

    cfg = CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=1, keep_last=0, write_threads=2)
    manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"), on_phase=on_phase)
    step()
    with pytest.raises(CheckpointError, match="the test's failed write"):
        manager.saver.save(1, model, opt, {"step": 1})
    first.clear()
    step()  # the next save's files differ from the first's
    manager.saver.save(2, model, opt, {"step": 2})
    manager.saver.close()
    manifest = read_manifest(tmp_path / "ck" / "step_00000002")
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    for name, record in manifest["files"].items():
        assert file_problem(tmp_path / "ck" / "step_00000002", name, record) is None, name
