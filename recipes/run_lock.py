"""One launch at a time per ``run_dir`` and per ``checkpoint.dir``: the job's rank 0 holds an exclusive lock on
``<run_dir>/.lock`` and on ``<checkpoint.dir>/.lock`` (two launches with their own run_dir but one checkpoint.dir
remove and overwrite each other's checkpoints). A regular file, not the directory: on
NFS ``flock`` is a byte-range lock, which needs a file open for writing.

Two launches training in one ``run_dir`` at once overwrite each other's checkpoints and interleave their
``metrics.jsonl`` (both may exit 0, the first reporting checkpoints that hold the second's state). The lock
is ``flock`` on a file of the run directory: the kernel drops it when the holding process ends, however it ends,
so a crashed launch never leaves the directory locked. Where ``flock`` is unavailable (not Linux/macOS) there is
no lock. On a network file system ``flock`` may be local to one host (NFS before v4, some FUSE mounts).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from optim_factory.errors import ConfigError

try:
    import fcntl
except ImportError:  # no flock: no lock
    fcntl = None

LOCK_NAME = ".lock"
# flock refused by the file system itself (Lustre mounted noflock, NFSv3 without lockd, some FUSE mounts): no lock
_NO_FLOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


def missing_dirs(path: str) -> list[Path]:
    """``path`` (absolute) and those of its parents that do not exist yet, deepest first: what creating it makes."""
    missing = []
    for directory in [Path(path).absolute(), *Path(path).absolute().parents]:
        if directory.exists():
            break
        missing.append(directory)
    return missing


def _flock(fd: int) -> None:
    """Take the exclusive lock on ``fd`` without waiting (``BlockingIOError`` when another holds it)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class RunDirLock:
    """``acquire()`` takes the lock or raises one :class:`ConfigError` line naming the holder; ``note_holder()``
    then writes this process into the file (for the next launch's message); ``release()`` (or the end of the
    process) drops it. Where the file system refuses ``flock``, :attr:`unavailable` says why and nothing is
    locked (the caller logs it once its logging is set up). Also a context manager (acquire + note_holder)."""

    def __init__(self, run_dir: str, key: str = "run_dir") -> None:
        """``key``: the config key that names the directory (for the refusal)."""
        self.run_dir = run_dir
        self.key = key
        self.path = Path(run_dir) / LOCK_NAME
        self.unavailable: str | None = None
        self._fd: int | None = None

    def acquire(self) -> None:
        if fcntl is None or self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock(fd)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            held = f"another launch is training in it ({holder}); wait for it to end, or use another {self.key}"
            raise ConfigError(self.key, self.run_dir, held) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_FLOCK:
                raise
            self.unavailable = f"this file system refuses flock ({exc.strerror}): no lock against a second launch"
            return
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # held from here: release() drops it whatever follows

    def note_holder(self) -> None:
        """Write this process into the held lock's file (what a refused launch names)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        """Whether this process holds the lock."""
        return self._fd is not None

    def remove_created(self, created: list[Path]) -> None:
        """A launch that ends refused leaves the directory it made as it found it: where ``created`` (the missing
        directories the launch made, deepest first: :func:`missing_dirs`) starts with this lock's directory and that
        holds no file but the lock file, the file, the empty directories inside (a refused save's step directory,
        which another rank may still be removing) and those directories, deepest first, while any is empty. Only
        while the lock is held: another launch's directory is not this one's to remove."""
        folder = self.path.parent
        if not self.held or not created or created[0] != folder.absolute():
            return
        walk = list(os.walk(folder, topdown=False))  # deepest first; a directory removed meanwhile is skipped
        if any(Path(top, name) != self.path for top, _, files in walk for name in files):
            return
        self.path.unlink(missing_ok=True)
        inner = [Path(top, name) for top, dirs, _ in walk for name in dirs]
        for directory in [*inner, *created]:
            try:
                directory.rmdir()
            except FileNotFoundError:  # another rank removed it first
                continue
            except OSError:  # not empty (a run_dir with its train.log)
                return

    def release(self) -> None:
        """Unlock (closing the file drops the lock); the file stays. Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        self.acquire()
        self.note_holder()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
