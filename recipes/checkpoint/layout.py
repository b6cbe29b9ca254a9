"""A checkpoint directory on disk: its layout, its manifest, discovery and retention (no collectives: every
module of the recipe may import it).

``checkpoint.dir`` holds one ``step_<8 digits>/`` directory per checkpoint: DCP's ``.metadata`` and
``__<rank>_<n>.distcp`` files and ``COMPLETE.json``, the manifest rank 0 writes (atomically) once DCP finished the
save. A checkpoint is *complete* when it has both. A checkpoint that failed verification is renamed
``<name>.damaged`` (:func:`set_aside`): neither discovery nor retention counts it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from optim_factory.checkpoint import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpoint
from optim_factory.errors import first_line
from optim_factory.tree import local_tensors, state_bytes
from recipes.checkpoint.checksums import manifest_problem, seal_manifest
from recipes.config import CheckpointError

log = logging.getLogger(__package__)  # recipes.checkpoint: one logger for the package

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE.json"
METADATA = ".metadata"
FALLBACK_HINT = "checkpoint.fallback=true resumes from the newest checkpoint that verifies"
DAMAGED_KEPT = 2  # set-aside checkpoints kept for inspection in a checkpoint.dir: the newest set aside
DCP_ERRORS = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files or manifest fail verification: bytes on disk, not the environment, are wrong."""


def checkpoint_key(cfg) -> bytes | None:
    """The key that signs and verifies this run's checkpoints: the value of the environment variable that
    ``checkpoint.key_env`` names (None without one). A missing or empty variable is one ``CheckpointError`` line
    (``recipes.preflight`` asks before anything runs)."""
    name = cfg.key_env
    if not name:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise CheckpointError(
            f"checkpoint.key_env={name}: the environment variable {name} is not set or empty (it holds the key "
            "that signs and verifies checkpoints; set it on every rank, or drop checkpoint.key_env)"
        )
    return value.encode()


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_*`` directory in ``root``, by step (none if ``root`` does not exist)."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def is_complete(path: Path) -> bool:
    return (path / METADATA).is_file() and (path / MARKER).is_file()


def complete(root: Path) -> list[tuple[int, Path]]:
    return [(s, p) for s, p in step_dirs(root) if is_complete(p)]


def recorded_files(path: Path, parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every rank's file records of a finished save of ``path`` (``ChecksumFileSystemWriter.checksums``), merged;
    a ``.metadata`` or ``.distcp`` file on disk without one (a torch that wrote around the checksumming file system)
    fails the save loudly, never an unverifiable checkpoint."""
    files = {name: record for part in parts for name, record in part.items()}
    on_disk = {p.name for p in path.iterdir() if p.name == METADATA or p.suffix == ".distcp"}
    unrecorded = sorted(on_disk - set(files))
    if unrecorded:
        raise CheckpointError(f"saving {path} failed: no checksum was recorded for {', '.join(unrecorded)}")
    return files


def write_manifest(path: Path, manifest: dict[str, Any], key: bytes | None) -> None:
    """Seal ``manifest`` (its own hash; with ``key``, its MAC) and write it as ``path``'s ``COMPLETE.json``,
    atomically and durably: a checkpoint counts once it is there, so the marker is fsynced before it takes its name
    and the directory after (a power loss leaves the checkpoint complete, or without a marker: never with an empty
    one)."""
    tmp = path / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(seal_manifest(manifest, key))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MARKER)
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_manifest(path: Path, key: bytes | None = None) -> dict[str, Any]:
    """The manifest (``COMPLETE.json``) of checkpoint ``path``: step, export report, ``files`` (name -> size and
    hash; absent in checkpoints written before checksums were recorded) and ``config`` (the resolved run
    config). A missing or unreadable manifest is a one-line CheckpointError; so is one whose own hash, or with
    ``key`` (``checkpoint.key_env``'s) whose MAC, does not verify."""
    marker = Path(path) / MARKER
    try:
        manifest = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path}: no {MARKER} (its save did not finish, or it was not written by this recipe); "
            f"{FALLBACK_HINT}"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path}: {MARKER} is unreadable ({first_line(exc, named=True)}); {FALLBACK_HINT}"
        ) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path}: {MARKER} is not a JSON object; {FALLBACK_HINT}")
    problem = manifest_problem(manifest, key)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: {MARKER}: {problem}; {FALLBACK_HINT}")
    return manifest


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's contents as one flat dictionary keyed as DCP flattens them (``"model.<fqn>"``,
    ``"optim.state.<fqn>.exp_avg"``, ``"optim.param_groups.0.lr"``, ``"trainer.step"`` ...), read on CPU without a
    process group, as data (``optim_factory.checkpoint.SafeFileSystemReader``: nothing in it runs)."""
    reader = SafeFileSystemReader(str(path))
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:  # saved with use_collectives=False: rank 0's own metadata, as DCP's load reads it
        metadata = reader.read_metadata(rank=0)
    template = {
        fqn: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        for fqn, meta in metadata.state_dict_metadata.items()
    }
    dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return template


def _raised(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception in its chain and in DCP's per-rank failures (``CheckpointException.failures``)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return seen


def write_failure(what: str, path: Path, root: Path, rank: int, exc: BaseException) -> str:
    """The line of a failed write of the checkpoint ``path`` into ``root``; out of space, rank 0 first removes the
    save's partial files (they hold the space an older checkpoint's next save or the user needs; older checkpoints
    are untouched)."""
    if not disk_full(exc):
        return f"{what}: {first_line(exc, named=True)}"
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    line = first_line(exc, named=True)
    return f"disk full: {what}, its partial files removed ({free_bytes(root)} bytes free in {root}): {line}"


def unsafe_refusal(exc: BaseException) -> UnsafeCheckpoint | None:
    """The refusal of a checkpoint that a load read as data (``optim_factory.checkpoint.UnsafeCheckpoint``) in
    ``exc``'s chain or DCP's per-rank failures, if any."""
    return next((e for e in _raised(exc) if isinstance(e, UnsafeCheckpoint)), None)


def disk_full(exc: BaseException) -> bool:
    """Whether a failed write ran out of space: ``ENOSPC`` anywhere in its chain or DCP's per-rank failures, or
    the text torch's file writer gives a short write (``unexpected pos``)."""
    seen = _raised(exc)
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in seen):
        return True
    text = " ".join(str(e) for e in seen)
    return "No space left on device" in text or "unexpected pos" in text


def interrupted(exc: BaseException) -> bool:
    """Whether a failed save was a Ctrl-C's ``KeyboardInterrupt`` (DCP wraps what a rank raised)."""
    return any(isinstance(e, KeyboardInterrupt) for e in _raised(exc))


def free_bytes(path: Path) -> int:
    """Free bytes of the file system that holds ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def retain(root: Path, keep_last: int, verified: Path | None) -> None:
    """``keep_last``: delete the complete checkpoints older than the newest ``keep_last`` (0 keeps all), never
    ``verified`` (the newest known good: the last saved or loaded)."""
    if keep_last <= 0:
        return
    done = complete(root)
    for step, path in done[: max(0, len(done) - keep_last)]:
        if verified is not None and path.resolve() == verified.resolve():
            log.info("keep_last=%d: keeping %s, the newest verified checkpoint", keep_last, path)
            continue
        log.info("keep_last=%d: deleting checkpoint %s (step %d)", keep_last, path, step)
        shutil.rmtree(path, ignore_errors=True)


def set_aside(path: Path) -> None:
    """Rename a checkpoint that failed verification to ``<name>.damaged`` (``.damaged.<n>`` if taken), out of
    discovery and retention, so that it never takes a good checkpoint's ``keep_last`` place; kept for
    inspection, said in one line. Of the set-aside checkpoints in its folder the :data:`DAMAGED_KEPT` set aside
    last stay (their modification time, set then, later than every other's: the clock's ticks are coarse, 4 ms on
    ext4, and two set aside within one would tie): the others are deleted, so that a run that meets damage again
    and again does not fill the disk."""
    aside, n = path.with_name(f"{path.name}.damaged"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
    try:
        path.rename(aside)
    except OSError as exc:
        log.warning("could not set aside the damaged checkpoint %s: %s", path, first_line(exc, named=True))
        return
    log.warning("set aside the damaged checkpoint %s as %s: neither resume nor keep_last counts it", path, aside.name)
    others = [(p.stat().st_mtime_ns, p) for p in path.parent.glob("step_*.damaged*") if p != aside]
    stamp = max([time.time_ns(), *(t + 1 for t, _ in others)])  # the order of the folders kept
    os.utime(aside, ns=(stamp, stamp))
    aside_all = [p for _, p in sorted(others, key=lambda o: o[0])] + [aside]
    for old in aside_all[:-DAMAGED_KEPT]:
        log.info("deleting the set-aside checkpoint %s (the newest %d stay)", old, DAMAGED_KEPT)
        shutil.rmtree(old, ignore_errors=True)


def first_save_bytes(model: torch.nn.Module) -> int:
    """This rank's share of a first checkpoint, estimated before the optimizer has states: the model's state bytes
    plus two FP32 moments (an Adam's exp_avg and exp_avg_sq, 8 bytes) per element of its (local) parameters."""
    return state_bytes(model.state_dict()) + 8 * sum(t.numel() for t in local_tensors(list(model.parameters())))
