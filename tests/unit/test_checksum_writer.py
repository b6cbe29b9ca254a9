"""The recipe's checkpoint writer: several writer threads (one file each), every file with its XXH3, and
``torch.save``'s zip CRC32 left out of the records while it writes (XXH3 covers every byte)."""

from __future__ import annotations

import io
import os
import pickle
import re
import threading
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from recipes.checkpoint.checksums import CRC32_PER_THREAD, ChecksumFileSystem, ChecksumFileSystemWriter, writer_threads


def _save(path, threads: int) -> tuple[dict, ChecksumFileSystemWriter]:
    state = {f"t{i}": torch.randn(1000 + i, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    writer = ChecksumFileSystemWriter(path, thread_count=threads)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer)
    return state, writer


def test_records_carry_no_zip_crc32_the_setting_is_restored_and_the_checkpoint_loads(tmp_path):
    torch.serialization.set_crc32_options(True)
    state, writer = _save(tmp_path, threads=2)
    assert torch.serialization.get_crc32_options() is True  # as it was before the save
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    crcs = []
    for info in metadata.storage_data.values():
        data = (tmp_path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        crcs += [entry.CRC for entry in zipfile.ZipFile(io.BytesIO(data)).infolist() if entry.filename.endswith("/0")]
    assert len(crcs) == len(state), crcs  # each tensor's storage record
    if CRC32_PER_THREAD:  # else torch's setting is the process's, and left on
        assert set(crcs) == {0}, crcs
    else:
        assert 0 not in crcs, crcs
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_checksummed_file_is_written_front_to_back_in_wb_only(tmp_path):
    fs = ChecksumFileSystem()
    for mode in ("ab", "xb", "r+b"):
        with pytest.raises(RuntimeError, match=f"'{re.escape(mode)}' writes cannot be checksummed"):
            with fs.create_stream(tmp_path / "other", mode):
                pass
    with pytest.raises(io.UnsupportedOperation, match="front to back"):
        with fs.create_stream(tmp_path / "sought", "wb") as stream:
            stream.write(b"abc")
            stream.seek(0)
    with fs.create_stream(tmp_path / "written", "wb") as stream:
        assert (stream.write(bytearray(b"xyz") * 3), stream.tell()) == (9, 9)
    assert fs.records == {"written": {"size": 9, "xxh3_64": xxhash.xxh3_64(b"xyz" * 3).hexdigest()}}


def test_a_checksummed_file_is_buffered_as_open_buffers_it(tmp_path):
    def on_disk(stream, path) -> list[int]:  # the file's size after each of a few writes, the buffer unflushed
        sizes = []
        for _ in range(4):
            stream.write(b"x" * 3000)
            sizes.append(path.stat().st_size)
        return sizes

    with open(tmp_path / "opened", "wb") as stream:
        expected = on_disk(stream, tmp_path / "opened")
    with ChecksumFileSystem().create_stream(tmp_path / "hashed", "wb") as stream:
        assert on_disk(stream, tmp_path / "hashed") == expected


def test_every_file_is_whole_on_disk_when_it_is_fsynced(tmp_path, monkeypatch):
    synced: dict[str, int] = {}  # each file's size at its last fsync
    fsync = os.fsync

    def spy(fd: int) -> None:
        fsync(fd)
        synced[os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).removesuffix(".tmp")] = os.fstat(fd).st_size

    monkeypatch.setattr(os, "fsync", spy)
    _, writer = _save(tmp_path, threads=2)
    records = writer.checksums()
    assert synced == {name: record["size"] for name, record in records.items()}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full to fail a write with ENOSPC")
@pytest.mark.parametrize("sync", [True, False])
def test_a_file_whose_flush_fails_is_closed_and_its_failure_raised(sync):
    with pytest.raises(OSError, match="No space left"):
        with ChecksumFileSystem(sync=sync).create_stream("/dev/full", "wb") as stream:
            stream.write(b"x" * 100)  # buffered: the flush at close fails
    assert stream.raw.closed


def test_a_file_whose_writer_failed_is_closed_without_an_fsync(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    with pytest.raises(KeyboardInterrupt):
        with ChecksumFileSystem(sync=True).create_stream(tmp_path / "partial", "wb") as stream:
            stream.write(b"x" * 100)
            raise KeyboardInterrupt  # a second Ctrl-C during the write: no record, no wait for the disk
    assert stream.raw.closed and synced == []


def test_each_writer_thread_writes_its_own_file_with_its_checksum(tmp_path):
    _, writer = _save(tmp_path, threads=3)
    records = writer.checksums()
    assert sorted(records) == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    for name, record in records.items():
        data = (tmp_path / name).read_bytes()
        assert record == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name


def test_a_writer_kept_across_saves_names_only_the_last_save_s_files(tmp_path):
    """The recipe keeps one writer for every save, each save's directory its ``checkpoint_id``: DCP's ``reset``
    starts each save's records afresh (a save of fewer files than the one before names only its own)."""
    writer = ChecksumFileSystemWriter(tmp_path, thread_count=3)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({f"t{i}": torch.ones(100 + i) for i in range(6)}, checkpoint_id=tmp_path / "a", storage_writer=writer)
        writer.thread_count = 1
        dcp.save({"t": torch.zeros(10)}, checkpoint_id=tmp_path / "b", storage_writer=writer)
    records = writer.checksums()
    assert sorted(records) == [".metadata", "__0_0.distcp"]
    for name, record in records.items():
        data = (tmp_path / "b" / name).read_bytes()
        assert record == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_automatic_writer_threads_follow_the_cpus_this_process_may_use_up_to_4():
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert writer_threads(0) == 1
        assert writer_threads(3) == 3  # a number given is used as it is
    finally:
        os.sched_setaffinity(0, allowed)
    assert writer_threads(0) == min(4, len(allowed))


def _record_crcs(data: bytes) -> list[int]:
    return [e.CRC for e in zipfile.ZipFile(io.BytesIO(data)).infolist() if e.filename.endswith("/0")]


def test_another_thread_s_torch_save_keeps_its_crc32_while_a_file_is_written_and_a_failure_restores_it(tmp_path):
    fs = ChecksumFileSystem()
    other = []

    def save_elsewhere():
        buf = io.BytesIO()
        torch.save(torch.arange(100.0), buf)
        other.extend(_record_crcs(buf.getvalue()))

    with fs.create_stream(tmp_path / "a.distcp", "wb") as stream:
        stream.write(b"x" * 10)
        thread = threading.Thread(target=save_elsewhere)
        thread.start()
        thread.join()
    assert len(other) == 1 and other[0] != 0  # the training thread's torch.save during an async write
    with pytest.raises(OSError, match="disk"):
        with fs.create_stream(tmp_path / "b.distcp", "wb"):
            raise OSError("disk full")
    assert torch.serialization.get_crc32_options() is True


@pytest.mark.parametrize("failing", [["__0_0.distcp", "__0_1.distcp"], ["__0_1.distcp"]], ids=["every", "one"])
def test_a_file_failing_in_any_writer_thread_fails_the_save_in_its_caller_and_leaves_no_thread_exception(
    tmp_path, monkeypatch, failing
):
    """DCP's extra writer threads run its write loop bare: a file failing there (a full disk) ended the thread with
    an unhandled exception (a traceback on stderr in a user's run) and the save did not see it. Here the files
    cannot be opened (a directory in their place); which thread takes which file is DCP's: whichever fails, the
    save raises the OSError in the thread that called it, and no thread ends with an exception (with every file
    failing, DCP's extra thread always fails one)."""
    ended = []
    monkeypatch.setattr(threading, "excepthook", lambda args: ended.append(args.exc_value))
    for name in failing:
        (tmp_path / name).mkdir()
    before = set(threading.enumerate())
    with pytest.raises(CheckpointException) as info:  # a BaseException: DCP's own
        _save(tmp_path, threads=2)
    for thread in set(threading.enumerate()) - before:  # DCP's writer threads (not joined where its caller failed)
        thread.join(60)
    assert "IsADirectoryError" in str(info.value), info.value  # DCP's CheckpointException carries it
    assert not ended, ended
