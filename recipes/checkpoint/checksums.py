"""Checksums of every checkpoint file, recorded while DCP writes it, checked again before a load.

:class:`ChecksumFileSystemWriter` is DCP's ``FileSystemWriter`` with a file system whose write streams run a
64-bit XXH3 hash over every byte on its way to the file (bytes already in memory: the file is never read back),
so a save costs one extra pass over data that is hot in cache (XXH3: zlib.crc32 is several times slower per core,
docs/design.md, "Measured figures behind the defaults"). Each rank's writer knows the size and hash of the files
it wrote (rank 0 also of ``.metadata``); the checkpoint manager (recipes/checkpoint/save.py) gathers them into the
checkpoint's manifest. :func:`file_problem` reads a file back and says what is wrong with it, if anything.

These find damage, not a deliberate change: anyone can recompute an XXH3. With ``checkpoint.key_env`` (a key in an
environment variable, never in the run folder) every file also gets a keyed digest (HMAC-SHA256, beside XXH3 on its
way to the file) and the manifest a MAC over its content (:func:`seal_manifest`); a load with the key checks those
instead (docs/reliability.md, "Trust").

Only public DCP classes are subclassed (``FileSystemWriter``, ``FileSystem``): the writer's ``fs`` attribute,
and ``FileSystem.create_stream`` / ``rename``, which the writer uses for every data file and for ``.metadata``
(torch 2.11-2.14). The manager checks after each save that every file in the checkpoint has a checksum, so a
torch that wrote around them would fail the save loudly instead of writing unverifiable checkpoints.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from optim_factory.checkpoint import cpus_per_rank, host_budget

ALGORITHM = "xxh3_64"  # the manifest's key for each file's hash (hex digest)
MANIFEST_DIGEST = "manifest_xxh3_64"  # the manifest's hash of its own other keys (sorted JSON)
KEYED = "hmac_sha256"  # with checkpoint.key_env's key: each file's keyed digest (hex HMAC-SHA256)
MANIFEST_MAC = "manifest_hmac_sha256"  # with that key: the MAC of the manifest's other keys but its digest
READ_CHUNK = 16 * 2**20
HASH_CHUNK = 2**20  # fits in L2: the write's copy reads what the hash just read


def new_hasher():
    return xxhash.xxh3_64()


def new_keyed(key: bytes):
    return hmac.new(key, digestmod=hashlib.sha256)


class _HashingFile(io.BufferedWriter):
    """A file opened for writing as DCP's own ``FileSystem.create_stream`` opens one (``open(path, "wb")``: buffered,
    the buffer the file system's block size), that keeps a running hash and size of every byte written to it:
    ``write`` and ``close`` are its own, DCP's ``tell``, ``flush`` and ``fileno`` the file's.

    Data files are written front to back (``wb``; DCP and ``torch.save`` only append), so the running hash is the
    file's. It does not seek: a writer that seeks back fails here instead of being miscounted.
    """

    def __init__(self, path, key: bytes | None, sync: bool):
        self.sync = sync  # flushed and fsynced when closed
        raw = io.FileIO(path, "wb")
        block = os.fstat(raw.fileno()).st_blksize  # open()'s buffer: a parallel file system's block is MiBs
        super().__init__(raw, buffer_size=block if block > 1 else io.DEFAULT_BUFFER_SIZE)
        self.hasher = new_hasher()
        self.keyed = new_keyed(key) if key else None  # beside XXH3, with checkpoint.key_env's key
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), HASH_CHUNK):  # hash a piece, then write it while it is still in cache
            piece = view[start : start + HASH_CHUNK]
            self.hasher.update(piece)
            if self.keyed is not None:
                self.keyed.update(piece)
            super().write(piece)  # a blocking buffered write takes all of it or raises
        self.size += len(view)
        return len(view)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # a failed file gets no record, nor an fsync: a second Ctrl-C does not wait for it
            self.sync = False
        return super().__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Closed on disk whole where ``sync``: DCP's own fsync (torch 2.11-2.13) comes before the buffer's flush, so
        the last bytes of a file (all of ``.metadata``) would reach the disk only when the kernel writes them."""
        try:
            if self.sync and not self.closed:
                self.flush()
                os.fsync(self.fileno())
        finally:  # the file is closed even where its flush failed (a full disk)
            super().close()

    def seekable(self) -> bool:
        return False

    def seek(self, *args) -> int:
        raise io.UnsupportedOperation("a checksummed checkpoint file is written front to back")


class _Discarded(io.RawIOBase):
    """A write stream that counts the bytes written to it and keeps none (:meth:`ChecksumFileSystem.create_stream`:
    a data file that a failed writer thread could not open)."""

    def __init__(self) -> None:
        super().__init__()
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.position += memoryview(data).nbytes
        return memoryview(data).nbytes

    def tell(self) -> int:
        return self.position


def _crc32_per_thread() -> bool:
    """Whether ``torch.serialization.set_crc32_options`` in one thread leaves another thread's setting alone
    (per thread in torch 2.13; one for the process in 2.11, seen on an H200). Tried once at import, restored."""
    seen = []
    before = torch.serialization.get_crc32_options()
    try:
        torch.serialization.set_crc32_options(not before)
        thread = threading.Thread(target=lambda: seen.append(torch.serialization.get_crc32_options()))
        thread.start()
        thread.join()
    finally:
        torch.serialization.set_crc32_options(before)
    return seen == [before]


CRC32_PER_THREAD = _crc32_per_thread()


class ChecksumFileSystem(FileSystem):
    """DCP's local file system, recording ``{file name: {"size", "xxh3_64"}}`` of every file written through it."""

    def __init__(self, key: bytes | None = None, sync: bool = True) -> None:
        super().__init__()
        self.key = key  # checkpoint.key_env's: each file's keyed digest too
        self.sync = sync  # the writer's sync_files: each written file flushed and fsynced before it is closed
        self.records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads (thread_count > 1)
        # the thread that called the writer's last write_data, and the first failure of a data file written by
        # another (DCP's extra writer threads): ChecksumFileSystemWriter.write_data raises it in that thread
        self.caller: int | None = None
        self.failure: Exception | None = None

    @contextmanager
    def create_stream(self, path, mode: str):
        """For a write (``wb``, the only mode DCP writes in), the file opened as DCP opens it, hashing what is
        written to it (:class:`_HashingFile`); a read is DCP's own. While a written file is open, ``torch.save`` in
        this thread writes its zip records without their CRC32 where torch keeps that setting per thread
        (:data:`CRC32_PER_THREAD`; DCP writes each file from one thread): XXH3 here already covers every byte,
        checked before any load, and the CRC32 is another pass over every byte, which slows the writer threads
        below the disk's rate (docs/design.md, "Measured figures behind the defaults"). Where the setting is one
        for the process (torch 2.11), it is left as it is: turning it off would reach every other thread's
        ``torch.save``."""
        if mode in ("r", "rb"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if mode != "wb":
            raise RuntimeError(f"{path}: {mode!r} writes cannot be checksummed (only 'wb')")
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(crc32 and not CRC32_PER_THREAD)
        opened = False
        try:
            with _HashingFile(path, self.key, self.sync) as counted:
                opened = True
                yield counted
        except Exception as exc:
            if not str(path).endswith(".distcp") or self.caller in (None, threading.get_ident()):
                raise
            # a data file of one of DCP's extra writer threads, which run its write loop bare: raised there, the
            # failure (a full disk's ENOSPC) would end the thread as an unhandled exception, a traceback on stderr,
            # and the save would not see it. Kept for write_data, which raises it in its own thread once DCP has
            # joined the threads (where the calling thread failed too, its own failure is the save's); a file that
            # did not open takes the thread's bytes for it into nothing.
            with self._lock:
                self.failure = self.failure or exc
            if not opened:
                yield _Discarded()
            return
        finally:
            torch.serialization.set_crc32_options(crc32)
        with self._lock:  # only a stream that was written and closed without an error is recorded
            record = {"size": counted.size, ALGORITHM: counted.hasher.hexdigest()}
            if counted.keyed is not None:
                record[KEYED] = counted.keyed.hexdigest()
            self.records[Path(path).name] = record

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its lock (a writer process gets the writer: ``StagerOptions.write_in_process``)."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.records.pop(Path(path).name, None)
            if record is not None:
                self.records[Path(new_path).name] = record


class ChecksumFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files get a size and hash as they are written (see :meth:`checksums`); with
    ``key`` (``checkpoint.key_env``'s), a keyed digest too."""

    def __init__(self, path, *, key: bytes | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        if not isinstance(getattr(self, "fs", None), FileSystem):
            raise RuntimeError(
                f"torch {torch.__version__}: FileSystemWriter has no local `fs` to checksum files through"
            )
        self.fs = ChecksumFileSystem(key, sync=self.sync_files)

    def reset(self, checkpoint_id=None) -> None:
        """DCP's reset before each save with a ``checkpoint_id``: the save gets a file system of its own (its records,
        its threads' failure). DCP joins its extra writer threads only once the calling thread's files are written,
        so a thread of an earlier save whose calling thread failed may still be writing: it records into that save's
        file system, never into this one."""
        super().reset(checkpoint_id)
        self.fs = ChecksumFileSystem(self.fs.key, sync=self.sync_files)

    def write_data(self, plan: Any, planner: Any) -> Any:
        """DCP's ``write_data``, whose failure in any of its writer threads raises here, in the calling thread (a
        failed file of another thread ends that thread's file early instead of raising there: ``create_stream``)."""
        self.fs.caller, self.fs.failure = threading.get_ident(), None
        written = super().write_data(plan, planner)  # DCP joins its writer threads before it returns
        if self.fs.failure is not None:
            failure, self.fs.failure = self.fs.failure, None
            raise failure
        return written

    def take_written(self, written: ChecksumFileSystemWriter) -> None:
        """Take the records of ``written``, the copy of this writer that a writer process saved with
        (``StagerOptions(write_in_process=True)``: the stager calls it once that save is written), so that
        :meth:`checksums` names that save's files here."""
        with self.fs._lock:
            self.fs.records = {k: dict(v) for k, v in written.fs.records.items()}

    def checksums(self) -> dict[str, dict[str, Any]]:
        """``{file name: {"size": bytes, "xxh3_64": hex[, "hmac_sha256": hex]}}`` of the files this rank wrote in the
        last save."""
        with self.fs._lock:
            return {k: dict(v) for k, v in self.fs.records.items()}


def writer_threads(write_threads: int) -> int:
    """The DCP writer threads of ``checkpoint.write_threads``: itself, or for 0 min(4, the CPUs of this rank:
    its affinity shared among the ranks on its host): one thread leaves a fast disk idle while it serializes, and
    more threads than CPUs compete with each other (docs/design.md, "Measured figures behind the defaults")."""
    return write_threads or min(4, cpus_per_rank())


def writer_options(optimizer: Any, write_threads: int) -> dict[str, int]:
    """DCP's ``FileSystemWriter`` options of a save of ``optimizer``: ``write_threads`` threads; within a host budget,
    one thread without copy-ahead, which asks for the tensors in the order the budget fills them
    (``optim_factory.checkpoint``)."""
    if host_budget(optimizer) is not None:
        return {"thread_count": 1, "per_thread_copy_ahead": 0}
    return {"thread_count": write_threads}


def file_hash(path: Path, hasher=None) -> tuple[int, str]:
    """(size, hex digest) of a file, read in 16 MiB chunks: XXH3, or ``hasher`` (a keyed one)."""
    hasher, size = hasher or new_hasher(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(READ_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def file_problem(directory: Path, name: str, record: dict[str, Any], key: bytes | None = None) -> str | None:
    """What is wrong with ``directory/name`` against its manifest ``record`` (None: it verifies). With ``key``, the
    file's keyed digest is checked (a file changed by someone without the key is found), else its XXH3."""
    path = Path(directory) / name
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size < record["size"]:
        return f"{name}: truncated ({size} of {record['size']} bytes)"
    if size > record["size"]:
        return f"{name}: {size} bytes, {record['size']} recorded"
    if key is not None:
        if KEYED not in record:
            return f"{name}: no keyed digest recorded (not signed with checkpoint.key_env's key)"
        _, digest = file_hash(path, new_keyed(key))
        if not hmac.compare_digest(digest.encode(), str(record[KEYED]).encode()):
            return f"{name}: keyed digest mismatch (changed without checkpoint.key_env's key, or signed with another)"
        return None
    _, digest = file_hash(path)
    if digest != record.get(ALGORITHM):
        return f"{name}: checksum mismatch ({ALGORITHM} {digest}, {record.get(ALGORITHM)} recorded)"
    return None


def _body(manifest: dict[str, Any], *without: str) -> bytes:
    return json.dumps({k: v for k, v in manifest.items() if k not in without}, sort_keys=True).encode()


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """The hash of a manifest's keys but :data:`MANIFEST_DIGEST` (their sorted JSON)."""
    return xxhash.xxh3_64_hexdigest(_body(manifest, MANIFEST_DIGEST))


def _manifest_mac(manifest: dict[str, Any], key: bytes) -> str:
    """The MAC of a manifest's keys but :data:`MANIFEST_DIGEST` and :data:`MANIFEST_MAC` (their sorted JSON)."""
    return hmac.new(key, _body(manifest, MANIFEST_DIGEST, MANIFEST_MAC), hashlib.sha256).hexdigest()


def seal_manifest(manifest: dict[str, Any], key: bytes | None = None) -> str:
    """The text of a manifest with a hash of its own content (:data:`MANIFEST_DIGEST`), so that a changed byte in
    ``COMPLETE.json`` (its config, its step) is found before anything trusts it, like a changed byte in a file; with
    ``key``, also its MAC (:data:`MANIFEST_MAC`), which only a holder of the key can recompute."""
    if key is not None:
        manifest = {**manifest, MANIFEST_MAC: _manifest_mac(manifest, key)}
    return json.dumps({**manifest, MANIFEST_DIGEST: _manifest_digest(manifest)}, sort_keys=True)


def manifest_problem(manifest: dict[str, Any], key: bytes | None = None) -> str | None:
    """What is wrong with a read manifest's own hash, if anything (``None`` also for a manifest written before
    manifests were hashed, which has none; its files' checksums still verify the data). With ``key``, its MAC must
    be there and verify: the hash alone can be recomputed by anyone who changes the manifest."""
    digest = manifest.get(MANIFEST_DIGEST)
    if digest is not None and _manifest_digest(manifest) != digest:
        return "its own checksum does not match (changed after it was written)"
    if key is None:
        return None
    mac = manifest.get(MANIFEST_MAC)
    if mac is None:
        return "it is not signed (checkpoint.key_env is set: only a checkpoint signed with its key loads)"
    if not hmac.compare_digest(str(mac).encode(), _manifest_mac(manifest, key).encode()):
        return "its MAC does not verify with checkpoint.key_env's key (changed without the key, or signed with another)"
    return None
