"""CheckpointManager: DCP checkpoints of model + optimizer + trainer state, with export reports.

Layout of ``checkpoint.dir``::

    step_00000100/            one DCP checkpoint (``.metadata`` + ``__<rank>_<n>.distcp`` files)
        COMPLETE.json         the manifest, written by rank 0 (atomically) only after DCP finished the save (sync
                              or async): the export report, the size and XXH3-64 hash of every file (recorded while it
                              was written, see recipes/integrity.py) and the resolved run config
    step_00000200/ ...

A checkpoint is *complete* when it has both ``.metadata`` and ``COMPLETE.json``. Resume (``auto``) picks the
newest complete one; incomplete directories are reported and never loaded. A load first verifies every file of
the manifest (present, recorded size, recorded hash; the ranks share the files to read) and refuses a damaged
checkpoint in one line, before anything is read into the model or optimizer. A save refuses a state with
non-finite values. ``keep_last`` deletes only older complete checkpoints, and never the newest verified one (the
last saved or loaded); a checkpoint that ``checkpoint.fallback`` skipped is renamed ``<name>.damaged`` first,
so that it is counted by neither. A save that would not fit in the free space of ``checkpoint.dir`` is refused
before it writes; a write that runs out of space says "disk full". With ``async_save`` the previous save is
awaited before the next one starts and at exit, and DCP's collectives for it run on a gloo group of their own,
so that they never interleave with training's.

The optimizer is exported with ``get_optimizer_state_dict`` (``flatten_optimizer_state_dict`` configurable); the
export is timed and, on CUDA, its GPU peak above the pre-export level is measured. A background export
(``optim.state_dict_offload_background``) is waited for within that time, and its failure on any rank refuses
the save on every rank before anything is written; except in an async save into reused buffers, which is
*deferred*: the save returns before the export is filled, the loop calls :meth:`CheckpointManager.wait_export`
before the next ``optimizer.step()``, and the NaN/inf check and a failed export refuse the checkpoint on every
rank when the save is finalised (:meth:`CheckpointManager.wait`; no marker, the directory removed). The report
(seconds, bytes, GB/s, peak), completed with the time the checkpoint held the training loop and the bytes written
once the save is complete (docs/recipe.md, "Export report"), is logged and appended to the run's metrics file.

With ``optim.state_dict_offload_reuse_buffers`` the optimizer exports into pooled host buffers. They are handed
to DCP as they are (an async save stages copies of everything else, as DCP's default does, but not of them),
and given back to the optimizer only once the save that reads them has finished (sync: when ``dcp.save``
returns; async: in :meth:`CheckpointManager.wait`), so the next export can never overwrite a checkpoint that is
still being written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.export import OffloadedStateDict, all_finite
from recipes.config import CheckpointConfig
from recipes.host_copies import HostCopies
from recipes.integrity import (
    ALGORITHM,
    ChecksumFileSystemWriter,
    file_problem,
    local_tensors,
    manifest_problem,
    seal_manifest,
)

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE.json"
SAVE_PHASES = ("export", "write", "marker")  # the points of a save at which CheckpointManager.on_phase runs
METADATA = ".metadata"
FALLBACK_HINT = "checkpoint.fallback=true resumes from the newest checkpoint that verifies"
FINITE, NO_SPACE, NON_FINITE, EXPORT_FAILED = 0, 1, 2, 3  # a save's verdict before writing, agreed by all ranks
# (the worst wins)


_STAGER_FUTURES = hasattr(dcp.state_dict_saver, "AsyncSaveResponse")  # async_save accepts a stager's Future


class CheckpointError(RuntimeError):
    """A checkpoint problem, in one line naming the checkpoint (or key) and what is wrong."""

    older_may_load = True  # with checkpoint.fallback, an older checkpoint is tried (not for a refused config)


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files or manifest fail verification: bytes on disk, not the environment, are wrong."""


@dataclass
class ExportReport:
    """What one checkpoint export cost."""

    step: int
    path: str
    export_s: float
    export_bytes: int
    export_gbps: float
    gpu_peak_mib: float | None
    save_s: float
    async_save: bool
    flatten: bool
    # Known once the save is complete (async: when it is awaited); None until then, and if it failed.
    # blocking_s: how long the training loop was held by this checkpoint (docs/recipe.md, "Export report").
    blocking_s: float | None = None
    # written_bytes: the bytes of the files DCP wrote for it (all ranks' .distcp files and .metadata, as recorded
    # by the checksumming writer); rank 0 gathers them, other ranks report None.
    written_bytes: int | None = None

    def summary(self) -> dict[str, Any]:
        """The fields of the end-of-run summary's ``checkpoints`` list."""
        return {"step": self.step, "blocking_s": self.blocking_s, "written_bytes": self.written_bytes}


@dataclass
class _InFlight:
    """An async save between its :meth:`CheckpointManager.save` call and its :meth:`CheckpointManager.wait`."""

    future: Future  # DCP's upload
    step: int
    path: Path
    report: ExportReport
    optimizer: Any
    osd: dict
    writer: ChecksumFileSystemWriter
    held_s: float  # how long this checkpoint has held the loop so far
    stager: ExportBufferStager | None = None  # a deferred export (it finishes the staging in the background)
    export_t0: float = 0.0  # when the save call started (its export first); a deferred export_s ends when filled
    export_waited: bool = False  # wait_export() ran (later calls return at once)


_DCP_ERRORS = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException


def one_line(exc: BaseException) -> str:
    """A short description of ``exc``; for DCP's per-rank failures, the first rank's own error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items(), key=lambda kv: kv[0])[0]
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]  # (exception, traceback)
        return f"rank {rank}: {one_line(inner) if isinstance(inner, BaseException) else str(inner)[:300]}"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}"


def read_checkpoint(path: Path, scratch: Path) -> dict[str, Any]:
    """A checkpoint's contents as one flat ``{"model.<fqn>": tensor, "optim...": ..., "trainer.step": ...}``
    dictionary, read on CPU without a process group (through a ``torch.save`` file written into ``scratch``)."""
    target = Path(scratch) / f"{Path(path).parent.parent.name}-{Path(path).name}.pt"
    dcp_to_torch_save(str(path), str(target))
    flat: dict[str, Any] = {}

    def walk(tree: dict, prefix: str) -> None:
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk(torch.load(target, weights_only=False), "")
    return flat


def is_complete(path: Path) -> bool:
    return (path / METADATA).is_file() and (path / MARKER).is_file()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest (``COMPLETE.json``) of checkpoint ``path``: step, export report, ``files`` (name -> size and
    hash; absent in checkpoints written before checksums were recorded) and ``config`` (the resolved run
    config). A missing or unreadable manifest is a one-line CheckpointError."""
    marker = Path(path) / MARKER
    try:
        manifest = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path}: no {MARKER} (its save did not finish, or it was not written by this recipe); "
            f"{FALLBACK_HINT}"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is unreadable ({one_line(exc)}); {FALLBACK_HINT}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path}: {MARKER} is not a JSON object; {FALLBACK_HINT}")
    problem = manifest_problem(manifest)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: {MARKER}: {problem}; {FALLBACK_HINT}")
    return manifest


def disk_full(exc: BaseException) -> bool:
    """Whether a failed write ran out of space: ``ENOSPC`` anywhere in its chain or DCP's per-rank failures, or
    the text torch's file writer gives a short write (``unexpected pos``)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    text = " ".join(str(e) for e in seen)
    return "No space left on device" in text or "unexpected pos" in text


def free_bytes(path: Path) -> int:
    """Free bytes of the file system that holds ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def state_bytes(obj: Any) -> int:
    """Bytes of the (local shards of the) tensors in a nested state dict."""
    if isinstance(obj, DTensor):
        obj = obj._local_tensor
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def check_checkpoint_config(cfg: CheckpointConfig, rank: int = 0) -> None:
    """Validate the checkpoint config and the directory before any heavy work (one-line CheckpointError)."""
    if cfg.every_steps < 1:
        raise CheckpointError(f"checkpoint.every_steps={cfg.every_steps}: must be >= 1")
    if cfg.keep_last < 0:
        raise CheckpointError(f"checkpoint.keep_last={cfg.keep_last}: must be >= 0 (0 keeps all)")
    if not cfg.enabled:  # an earlier launch's run_dir is refused by the recipe (its launches/, read by rank 0)
        if cfg.resume not in ("auto", "never"):  # nothing would read it, not even a path that does not exist
            raise CheckpointError(
                f"checkpoint.resume={cfg.resume!r} with checkpoint.enabled=false: nothing would be loaded; "
                "drop checkpoint.resume, or set checkpoint.enabled=true"
            )
        return
    if not str(cfg.dir).strip():  # Path('') is the current directory: step directories would land there
        raise CheckpointError(f"checkpoint.dir={cfg.dir!r}: empty; expected a directory (e.g. <run_dir>/checkpoints)")
    root = Path(cfg.dir)
    if cfg.resume not in ("auto", "never"):
        path = Path(cfg.resume)
        if not path.exists():
            raise CheckpointError(
                f"checkpoint.resume={cfg.resume!r}: no such directory; expected auto|never|<path of a step_* directory>"
            )
        if not (path / METADATA).is_file():
            raise CheckpointError(
                f"checkpoint.resume={cfg.resume!r}: not a checkpoint directory (no {METADATA}); "
                "expected auto|never|<path of a step_* directory>"
            )
        _check_nothing_newer(cfg, path, root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{rank}-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"checkpoint.dir={cfg.dir!r}: not writable ({exc.strerror or exc})") from None
    if cfg.resume == "never":
        existing = step_dirs(root)
        if existing:
            raise CheckpointError(
                f"checkpoint.resume=never but checkpoint.dir={cfg.dir!r} already holds {len(existing)} checkpoint(s) "
                f"(e.g. {existing[-1][1].name}); use resume=auto or another checkpoint.dir"
            )


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_*`` directory in ``root``, by step (none if ``root`` does not exist)."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def _check_nothing_newer(cfg: CheckpointConfig, path: Path, root: Path) -> None:
    """An explicit ``checkpoint.resume`` path must be at least as new as every complete checkpoint in
    ``checkpoint.dir``: a later ``resume=auto`` (a requeue, a plain relaunch) would otherwise jump to those, and
    ``keep_last`` would keep them before this run's own."""
    try:  # the step its manifest records: a symlink or a copy need not be named step_*
        step = int(read_manifest(path)["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        match = STEP_DIR.match(path.resolve().name)
        if match is None:
            return  # no step to compare: the load refuses a checkpoint without a manifest
        step = int(match.group(1))
    here = path.resolve()
    newer = [p.name for s, p in step_dirs(root) if s > step and is_complete(p) and p.resolve() != here]
    if newer:
        raise CheckpointError(
            f"checkpoint.resume={cfg.resume!r} but checkpoint.dir={cfg.dir!r} holds newer complete checkpoints "
            f"({', '.join(newer)}), which a later resume=auto would continue instead of this run; use "
            f"checkpoint.resume=auto to continue the newest, another checkpoint.dir (e.g. run_dir=<new>) to "
            f"train on from {path.name}, or remove the newer ones to rewind this run"
        )


class CheckpointManager:
    """Saves, retains and resumes DCP checkpoints (see the module docstring)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        rank: int,
        device: torch.device,
        on_report=None,
        run_config: dict[str, Any] | None = None,
        waits_before_step: bool = False,
    ):
        """``run_config``: the resolved config of the run (a plain dict), stored in every checkpoint's manifest.
        ``waits_before_step``: the caller calls :meth:`wait_export` before every ``optimizer.step()`` (the recipe's
        loop does); only then may an async save return before a background export is filled (:meth:`_defers`),
        since the export's failure must reach the save, not a ``step()``."""
        self.cfg = cfg
        self.waits_before_step = waits_before_step
        self.run_config = run_config
        self.root = Path(cfg.dir)
        self.rank = rank
        self.device = device
        self.on_report = on_report
        self.options = StateDictOptions(flatten_optimizer_state_dict=cfg.flatten_optimizer_state_dict)
        self._pending: _InFlight | None = None
        self._host_copies = HostCopies()  # async saves: the model's host copies, reused from save to save
        # An async save plans and finishes on DCP's background thread with collectives of its own; on the
        # default group they would interleave with training's (gloo: a collective-mismatch abort; NCCL: a
        # hang), so they get a gloo group of their own (created here, on every rank, in the same order).
        self._save_group = (
            dist.new_group(backend="gloo") if cfg.enabled and cfg.async_save and dist.is_initialized() else None
        )
        self.reports: list[ExportReport] = []
        self._in_the_way: set[str] | None = None  # step directories of earlier launches, rank 0's (_clear_in_the_way)
        self.verified: Path | None = None  # the newest checkpoint known good: last saved or loaded; never deleted
        self.resume_changes: list = []  # recipes.resume.Change: how the run's config differs from the loaded one's

    def on_phase(self, phase: str, step: int, path: Path) -> None:
        """Called at each point of ``SAVE_PHASES`` of the save of ``step`` into ``path``; does nothing here.

        For subclasses that observe saves (``scripts/fault_train.py`` kills the process there):
        ``"export"``: the optimizer is exported (deferred: its export started), nothing of ``path`` is written;
        ``"write"``: ``dcp.save`` returned (sync) or ``dcp.async_save`` started writing (the save is in flight:
        :attr:`export_filling`), no completion marker yet; ``"marker"``: the save
        finished (async: inside :meth:`wait`) and the completion marker is about to be written.
        """

    def _clear_in_the_way(self, step: int, path: Path) -> None:
        """Rank 0 removes a directory of this step from an earlier launch (incomplete, or complete from before a
        resume at an earlier step) before any rank writes into it, behind a barrier.

        Only a directory that existed at this manager's first save can be in the way (each save writes a new,
        later step), so the first save learns rank 0's list of them (one broadcast) and later saves cost no
        collective at all unless their step is on it: a barrier in the save call would hold every rank until the
        slowest arrives. The collectives run on the gloo save group when there is one (NCCL's would also wait for
        the device)."""
        if self._in_the_way is None:
            names = [[p.name for _, p in step_dirs(self.root)] if self.rank == 0 else None]
            if dist.is_initialized():
                dist.broadcast_object_list(names, src=0, group=self._save_group)
            self._in_the_way = set(names[0])
        if path.name not in self._in_the_way:
            return
        self._in_the_way.discard(path.name)
        if self.rank == 0 and path.exists():
            kind = "complete" if is_complete(path) else "incomplete"
            log.warning("removing %s checkpoint %s before saving step %d again", kind, path, step)
            shutil.rmtree(path)
        if dist.is_initialized():
            dist.barrier(group=self._save_group)

    # ------------------------------------------------------------------ discovery
    def complete(self) -> list[tuple[int, Path]]:
        return [(s, p) for s, p in step_dirs(self.root) if is_complete(p)]

    def incomplete(self) -> list[tuple[int, Path]]:
        return [(s, p) for s, p in step_dirs(self.root) if not is_complete(p)]

    def resume_candidates(self) -> list[Path]:
        """Checkpoints to try, newest first, per ``checkpoint.resume`` (empty: start fresh)."""
        if not self.cfg.enabled or self.cfg.resume == "never":
            return []
        if self.cfg.resume != "auto":
            return [Path(self.cfg.resume)]
        for step, path in self.incomplete():
            log.warning("ignoring incomplete checkpoint %s (step %d): its save did not finish", path, step)
        return [p for _, p in reversed(self.complete())]

    def resume(self, model, optimizer, trainer_state: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest loadable checkpoint; with ``checkpoint.fallback``, older ones after a failure.

        Returns (path, trainer state) or None when there is nothing to resume. A checkpoint that fails to load
        raises CheckpointError (or, with fallback, is logged and skipped); the live model and optimizer are
        only written once a checkpoint has been read completely. Once an older checkpoint has loaded, the
        skipped ones that failed verification are set aside (:meth:`_set_aside`); a resume that fails changes
        nothing on disk.
        """
        candidates = self.resume_candidates()
        damaged: list[Path] = []
        for i, path in enumerate(candidates):
            try:
                state = self.load(path, model, optimizer, trainer_state)
            except CheckpointError as exc:
                if not exc.older_may_load or not (self.cfg.fallback and i + 1 < len(candidates)):
                    if exc.older_may_load and self.cfg.fallback:  # the hint's advice is taken: say why it did not help
                        why = (
                            "checkpoint.fallback applies to resume=auto, not to a given path"
                            if self.cfg.resume != "auto"
                            else "no older complete checkpoint is left to fall back to"
                        )
                        raise CheckpointError(str(exc).replace(FALLBACK_HINT, why)) from exc
                    raise
                why = str(exc).replace(f"; {FALLBACK_HINT}", "")  # the hint is being followed
                log.warning("%s; checkpoint.fallback=true: trying the older %s", why, candidates[i + 1])
                if isinstance(exc, DamagedCheckpoint):
                    damaged.append(path)
                continue
            for bad in damaged:
                self._set_aside(bad)
            return path, state
        return None

    def _set_aside(self, path: Path) -> None:
        """Rank 0 renames a checkpoint that failed verification to ``<name>.damaged`` (``.damaged.<n>`` if taken),
        out of discovery and retention, so that it never takes a good checkpoint's ``keep_last`` place; kept for
        inspection, said in one line. No collective: every rank saw the same verdict (verification shares it),
        and the other ranks never read the directory again."""
        if self.rank != 0:
            return
        aside, n = path.with_name(f"{path.name}.damaged"), 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
        try:
            path.rename(aside)
        except OSError as exc:
            log.warning("could not set aside the damaged checkpoint %s: %s", path, one_line(exc))
            return
        log.warning(
            "set aside the damaged checkpoint %s as %s: neither resume nor keep_last counts it", path, aside.name
        )

    def due(self, step: int, max_steps: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every_steps == 0 or step == max_steps)

    # ------------------------------------------------------------------ save
    def _defers(self, optimizer: Any) -> bool:
        """Whether the save of the export just started may return before the export is filled: an async save of
        a background export into pooled buffers (``optim.state_dict_offload_background`` with
        ``state_dict_offload_reuse_buffers``), for a caller that calls :meth:`wait_export` before ``step()``
        (``waits_before_step``). The stager then passes those buffers through uncopied, so nothing
        reads them before the export has filled them; without reuse the export's fresh host tensors would be
        copied at staging, so the save waits for the export as a synchronous one does."""
        # From the options alone, never from this rank's export (a rank with nothing to stream has none pending):
        # every rank must take the same path, whose collectives differ. DCP takes a stager's Future from torch 2.9.
        return (
            self.waits_before_step
            and self.cfg.async_save
            and _STAGER_FUTURES
            and isinstance(optimizer, OffloadedStateDict)
            and optimizer.state_dict_offload_background
            and optimizer.state_dict_offload_reuse_buffers
        )

    def _export(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict, dict, float, float | None, str | None, bool]:
        """Export model and optimizer: (model sd, optimizer sd, export seconds, GPU peak MiB, the failure of a
        background export in one line or None, deferred). A background export is waited for here, so its time
        and GPU peak are counted and the state dicts are final, unless the save defers it (:meth:`_defers`):
        then the seconds and the peak are those of the export call, which returns before the export is filled."""
        on_cuda = self.device.type == "cuda"
        deferred = self._defers(optimizer)
        if on_cuda:
            if not deferred:  # the export's own seconds; a deferred save returns at once and never waits here
                torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        # a background export returns unfilled here: waited for below (its failure recorded, not raised) or, deferred,
        # before the next step() (wait_export) and by the stager
        with optimizer.deferred_state_dict() if isinstance(optimizer, OffloadedStateDict) else contextlib.nullcontext():
            osd = get_optimizer_state_dict(model, optimizer, options=self.options)
        export_error = None if deferred else _export_failure(optimizer)
        if on_cuda and not deferred:
            torch.cuda.synchronize(self.device)
        export_s = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20 if on_cuda else None
        msd = get_model_state_dict(model, options=self.options)
        return msd, osd, export_s, peak, export_error, deferred

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> ExportReport:
        """Export and save a checkpoint for ``step`` (async if configured). Returns the export report.

        A deferred export (:meth:`_defers`) returns before the optimizer's export is filled: the model and every
        tensor that is not a pooled export buffer are copied here, the rest (wait, finite check) runs in the
        background, and :meth:`wait` refuses the save on every rank if the export failed or holds non-finite
        values. Call :meth:`wait_export` before the next ``optimizer.step()``."""
        self.wait()  # one save in flight at most; its buffers are never touched by the next export
        held_since = time.perf_counter()  # this checkpoint holds the loop from here (the wait above: the previous)
        path = self.root / f"step_{step:08d}"
        msd, osd, export_s, peak, export_error, deferred = self._export(model, optimizer)
        try:
            self.on_phase("export", step, path)
            self._check_before_writing(step, msd, osd, export_error, deferred)  # before anything on disk changes
        except CheckpointError:
            _release(optimizer, osd)
            raise
        except BaseException:
            if deferred:
                _export_failure(optimizer)  # nothing stages it: its failure must not reach the next step()
            _release(optimizer, osd)
            raise
        self._clear_in_the_way(step, path)
        nbytes = state_bytes(osd)
        state = {"model": msd, "optim": osd, "trainer": trainer_state}
        t0 = time.perf_counter()
        in_flight = False
        stager = None
        writer = ChecksumFileSystemWriter(path)
        try:
            if self.cfg.async_save:
                stager = ExportBufferStager(optimizer, deferred=deferred, host_copies=self._host_copies)
                future = dcp.async_save(
                    state,
                    checkpoint_id=str(path),
                    storage_writer=writer,
                    async_stager=stager,
                    process_group=self._save_group,
                )
                # a stager that returns a Future makes async_save return an AsyncSaveResponse (torch >= 2.9)
                future = future if isinstance(future, Future) else future.upload_completion
                in_flight = True
            else:
                dcp.save(state, checkpoint_id=str(path), storage_writer=writer)
        except _DCP_ERRORS as exc:  # the previous checkpoint is complete and untouched; this one gets no marker
            raise CheckpointError(self._write_failure(f"saving {path} failed", path, exc)) from exc
        finally:
            if not in_flight:  # written (sync) or failed: nothing reads the export buffers any more
                if deferred and (stager is None or stager.filled is None):
                    _export_failure(optimizer)  # never staged: its failure must not reach the next step()
                _release(optimizer, osd)
        save_s = time.perf_counter() - t0
        report = ExportReport(
            step=step,
            path=str(path),
            export_s=export_s,
            export_bytes=nbytes,
            export_gbps=nbytes / export_s / 1e9 if export_s > 0 else 0.0,
            gpu_peak_mib=peak,
            save_s=save_s,
            async_save=self.cfg.async_save,
            flatten=self.cfg.flatten_optimizer_state_dict,
        )
        self.reports.append(report)
        if self.cfg.async_save:  # in flight from here (on_phase may look at it)
            pending = _InFlight(future, step, path, report, optimizer, osd, writer, 0.0, stager if deferred else None)
            pending.export_t0, self._pending = held_since, pending
            self.on_phase("write", step, path)
            pending.held_s = time.perf_counter() - held_since  # the save call's share; wait_export and wait add theirs
        else:
            self.on_phase("write", step, path)
            self._finalize(step, path, report, self._gather_checksums(writer), held_since)
        return report

    @property
    def export_filling(self) -> bool | None:
        """None when no async save with a deferred export is in flight; else whether its export is still being
        filled (the loop runs meanwhile; :meth:`wait_export` waits for it)."""
        pending = self._pending
        if pending is None or pending.stager is None:
            return None
        return not pending.stager.filled.done()

    def wait_export(self) -> None:
        """Call before ``optimizer.step()``: wait until the in-flight save's deferred export is filled (``step()``
        would wait for it anyway). The wait is counted in that checkpoint's ``blocking_s``. Returns at once when
        no deferred export is pending. A failure is not raised here: :meth:`wait` refuses the save on every rank."""
        pending = self._pending
        if pending is None or pending.stager is None or pending.export_waited:
            return
        t0 = time.perf_counter()
        pending.stager.filled.result()
        pending.held_s += time.perf_counter() - t0
        pending.export_waited = True

    def _check_before_writing(self, step: int, msd: dict, osd: dict, export_error: str | None, deferred: bool) -> None:
        """Refuse to save a state holding NaN or inf, or whose background export failed, or that cannot fit in
        the free space of ``checkpoint.dir`` (rank 0 judges the space; all ranks agree: one all-reduce). A
        deferred save has no collective in the save call: its export is checked once filled (:meth:`wait`), and
        a write that runs out of space says so."""
        if deferred:
            return
        space = self._space_problem(msd, osd) if self.rank == 0 else None
        if export_error is not None:
            verdict = EXPORT_FAILED
        elif not all_finite(local_tensors({"model": msd, "optim": osd})):
            verdict = NON_FINITE
        else:
            verdict = NO_SPACE if space else FINITE
        self._agree(step, verdict, export_error, space=space)

    def _space_problem(self, msd: dict, osd: dict) -> str | None:
        """Rank 0: ``"<dir>: N bytes free, the save needs about M"`` when this save cannot fit: M is the previous
        save's bytes (this launch's, else the files of the checkpoint it resumed from), else every rank's share
        estimated as this rank's state bytes."""
        previous = next((r.written_bytes for r in reversed(self.reports) if r.written_bytes), None)
        if previous is None and self.verified is not None and self.verified.is_dir():
            previous = sum(p.stat().st_size for p in self.verified.iterdir() if p.is_file())
        world = dist.get_world_size() if dist.is_initialized() else 1
        needed = previous or world * state_bytes({"model": msd, "optim": osd})
        free = free_bytes(self.root)
        if needed <= free:
            return None
        return f"{self.root}: {free} bytes free, the save needs about {needed}"

    def _write_failure(self, what: str, path: Path, exc: BaseException) -> str:
        """The line of a failed write; out of space, rank 0 first removes this save's partial files (they hold
        the space an older checkpoint's next save or the user needs; older checkpoints are untouched)."""
        if not disk_full(exc):
            return f"{what}: {one_line(exc)}"
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        free = free_bytes(self.root)
        return f"disk full: {what}, its partial files removed ({free} bytes free in {self.root}): {one_line(exc)}"

    def _agree(
        self, step: int, verdict: int, export_error: str | None, path: Path | None = None, space: str | None = None
    ) -> None:
        """All ranks agree on the worst ``verdict`` (one all-reduce); unless all are FINITE every rank raises the
        same one-line CheckpointError, after rank 0 removed ``path`` (a deferred save's written directory)."""
        bad = torch.tensor([verdict])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() == FINITE:
            return
        if path is not None:
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            if dist.is_initialized():
                dist.barrier()  # every rank raises once the directory is gone
        if bad.item() == NO_SPACE:
            raise CheckpointError(
                f"not saving step {step}: no room for it ({space or 'on another rank'}); nothing was deleted, "
                f"the newest good checkpoint is {self.verified or 'none'}"
            )
        if bad.item() == EXPORT_FAILED:
            raise CheckpointError(
                f"not saving step {step}: the optimizer's background export failed "
                f"({export_error or 'on another rank'}); the newest good checkpoint is {self.verified or 'none'}"
            )
        raise CheckpointError(
            f"not saving step {step}: the model or optimizer state holds non-finite values (NaN/inf); "
            f"the newest good checkpoint is {self.verified or 'none'}"
        )

    def _gather_checksums(self, writer: ChecksumFileSystemWriter) -> dict[str, dict[str, Any]] | None:
        """Every rank's file checksums, merged on rank 0 (None elsewhere). All ranks call it after the save."""
        mine = writer.checksums()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return None
        return {name: record for part in gathered for name, record in part.items()}

    def _finalize(
        self, step: int, path: Path, report: ExportReport, files: dict | None, held_since: float, held_s: float = 0.0
    ) -> None:
        """Mark the finished save of ``step`` complete, apply keep_last, and report it. The loop is held by this
        checkpoint ``held_s`` seconds before ``held_since`` (an async save's call) and from ``held_since`` on."""
        self.on_phase("marker", step, path)
        if self.rank == 0:
            on_disk = {p.name for p in path.iterdir() if p.name == METADATA or p.suffix == ".distcp"}
            unrecorded = sorted(on_disk - set(files or {}))
            if unrecorded:  # a torch that writes around ChecksumFileSystem: fail loudly, never unverifiable
                raise CheckpointError(f"saving {path} failed: no checksum was recorded for {', '.join(unrecorded)}")
            report.written_bytes = sum(int(r["size"]) for r in files.values())
            record = asdict(report)
            del record["blocking_s"]  # not known yet: it ends after the marker and keep_last (metrics.jsonl has it)
            manifest = {
                "step": step,
                "time": time.time(),
                **record,
                "checksum": ALGORITHM,
                "files": files,
                "config": self.run_config,
            }
            marker = path / MARKER
            tmp = path / (MARKER + ".tmp")
            tmp.write_text(seal_manifest(manifest))
            os.replace(tmp, marker)
        self.verified = path
        if self.rank == 0:
            self._retain()
        report.blocking_s = held_s + (time.perf_counter() - held_since)
        peak = "n/a (CPU)" if report.gpu_peak_mib is None else f"{report.gpu_peak_mib:.1f} MiB"
        written = "" if report.written_bytes is None else f", wrote {report.written_bytes / 1e6:.2f} MB"
        log.info(
            "checkpoint step %d: optimizer export %.3f s, %.2f MB, %.3f GB/s, GPU peak %s; save %.3f s%s; "
            "blocked training %.3f s%s -> %s",
            step,
            report.export_s,
            report.export_bytes / 1e6,
            report.export_gbps,
            peak,
            report.save_s,
            " (async staging)" if report.async_save else "",
            report.blocking_s,
            written,
            path,
        )
        if self.on_report is not None:
            self.on_report(report)

    def wait(self) -> None:
        """Wait for an in-flight async save; mark it complete. A failed save raises here, never silently; so does,
        on every rank, a deferred export that failed or holds non-finite values on any rank (no marker, the
        directory removed)."""
        if self._pending is None:
            return
        waited_since = time.perf_counter()
        p = self._pending
        self._pending = None
        try:
            p.future.result()
        except _DCP_ERRORS as exc:
            raise CheckpointError(self._write_failure(f"async save of {p.path} failed", p.path, exc)) from exc
        finally:
            _release(p.optimizer, p.osd)  # the save is over: the next export may reuse them
        if p.stager is not None:
            filled_at = p.stager.filled.result()
            p.report.export_s = filled_at - p.export_t0  # from the export call until its tensors were filled
            p.report.export_gbps = p.report.export_bytes / p.report.export_s / 1e9 if p.report.export_s > 0 else 0.0
            try:
                self._agree(p.step, p.stager.verdict, p.stager.failure, path=p.path)
            except CheckpointError:
                self.reports.remove(p.report)  # never complete: not this launch's checkpoint
                raise
        self._finalize(p.step, p.path, p.report, self._gather_checksums(p.writer), waited_since, p.held_s)

    def _retain(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        done = self.complete()
        for step, path in done[: max(0, len(done) - self.cfg.keep_last)]:
            if self.verified is not None and path.resolve() == self.verified.resolve():
                log.info("keep_last=%d: keeping %s, the newest verified checkpoint", self.cfg.keep_last, path)
                continue
            log.info("keep_last=%d: deleting checkpoint %s (step %d)", self.cfg.keep_last, path, step)
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        self._host_copies.close()

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model, optimizer, trainer_state: dict[str, Any]) -> dict[str, Any]:
        """Load ``path`` into model, optimizer and a copy of ``trainer_state``; return the loaded trainer state.

        A config change that ``recipes.resume.RESUME_RULES`` refuses raises first (one line); the checkpoint is
        then verified (:meth:`verify`). DCP reads into host copies of the state dicts;
        only a complete read is set into the live model and optimizer, so a damaged or mismatched checkpoint
        leaves them untouched.
        """
        from recipes import resume  # builds on this module (CheckpointError, read_manifest)

        changes = resume.check_config(path, self.run_config)  # a refused change: one line, nothing read yet
        self.verify(path)
        msd, osd = get_state_dict(model, optimizer, options=self.options)
        state = _host_copy({"model": msd, "optim": osd, "trainer": dict(trainer_state)})
        del msd, osd
        masters = resume.align_template(state, path)  # saved dtypes: DCP never casts, the optimizer does
        hyperparameters = resume.capture_hyperparameters(optimizer)
        try:
            dcp.load(state, checkpoint_id=str(path))
        except _DCP_ERRORS as exc:  # DCP's errors are long: name the checkpoint and the first rank's error
            raise CheckpointError(f"checkpoint {path} cannot be loaded into this run: {one_line(exc)}") from exc
        resume.finish_masters(state, masters)  # from the loaded parameters
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=self.options
        )
        resume.restore_hyperparameters(optimizer, hyperparameters)  # the config's, not the checkpoint's
        self.resume_changes = changes  # logged by the caller once it accepts them (recipes.resume.log_changes)
        self.verified = Path(path)
        return state["trainer"]

    def verify(self, path: Path) -> None:
        """Check ``path`` against its manifest: every file present, with the recorded size and hash.

        The files (sorted by name) are dealt out to the ranks round-robin, so each byte is read once by one
        rank whatever the world size (the checkpoint's files do not depend on it); the verdicts are shared
        (one all_gather_object), so all ranks raise the same CheckpointError or none does. A checkpoint
        written before checksums were recorded (no ``files`` in its manifest) is loaded with a warning.
        """
        manifest = read_manifest(path)
        files = manifest.get("files")
        world = dist.get_world_size() if dist.is_initialized() else 1
        problem = None
        named = STEP_DIR.match(Path(path).name)
        if named is not None and int(named.group(1)) != manifest.get("step"):
            # renamed: resume=auto and keep_last go by the name, the run by the manifest's step
            problem = f"its name says step {int(named.group(1))}, its {MARKER} step {manifest.get('step')} (renamed?)"
        elif files is None:
            if self.rank == 0:
                log.warning(
                    "checkpoint %s has no checksums (written before they were recorded): loading it unverified", path
                )
        else:
            for name in sorted(files)[self.rank :: world]:
                try:
                    problem = file_problem(Path(path), name, files[name])
                except OSError as exc:
                    problem = f"{name}: unreadable ({exc.strerror or exc})"
                if problem:
                    break
        if world > 1:
            verdicts = [None] * world
            dist.all_gather_object(verdicts, problem)
            problem = next((v for v in verdicts if v), None)
        if problem:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: {problem}; {FALLBACK_HINT}")


class ExportBufferStager(AsyncStager):
    """Staging for ``dcp.async_save``: host copies of every tensor (as DCP's default stager makes), except the
    optimizer's leased export buffers, which are passed through: nothing writes them until they are released,
    which :class:`CheckpointManager` does only after this save has finished.

    Why not DCP's own stager (``DefaultStager`` / ``BlockingAsyncStager``): it copies *every* tensor into its
    own (pinned) host memory, so the pooled export buffers, already on the host and owned by this save, would be
    copied a second time (twice the host memory and a second full memcpy per checkpoint). It has no hook to
    skip some tensors, so this stager does the part of its job that is needed: host copies of the rest (the model
    state and tensors that are not pooled), into the manager's :class:`HostCopies` (pinned buffers reused across
    saves, filled on a side stream). See docs/design.md, "Checkpoints".

    ``deferred=True`` (a background export into pooled buffers, still being filled): :meth:`stage` starts the
    copies and returns a Future that completes on a thread of its own once the copies are complete, the export is
    filled (the next ``step()`` changes the model and the optimizer: the loop waits for :attr:`filled` before it)
    and the staged state checked for non-finite values. The
    Future never raises (a failure on one rank would leave the others in DCP's collectives): it records the
    outcome in :attr:`verdict` and :attr:`failure`, for the manager to agree on across ranks.
    """

    _synchronize_after_execute = False

    def __init__(self, optimizer: Any, *, deferred: bool = False, host_copies: HostCopies | None = None):
        self.optimizer = optimizer
        self.deferred = deferred
        self.host_copies = host_copies if host_copies is not None else HostCopies()
        self.filled: Future | None = None  # deferred: perf_counter() when the export was filled (never raises)
        self.verdict = FINITE  # deferred: FINITE, NON_FINITE or EXPORT_FAILED, set before the staging completes
        self.failure: str | None = None  # deferred: the export's failure in one line

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """Host copies for DCP. Not deferred: once a background export has filled its tensors (a failed export
        raises here and nothing is written). Deferred: a Future of them, see the class docstring."""
        offloads = isinstance(self.optimizer, OffloadedStateDict)
        if offloads and not self.deferred:
            self.optimizer.wait_state_dict()
        leased = self.optimizer.is_leased_export_buffer if offloads else None
        staged, copied = self.host_copies.copy(state_dict, keep=leased)
        if not self.deferred:
            copied()
            return staged
        self.filled, done = Future(), Future()
        # the caller's GPU current on the thread: a new thread's is 0, and its first CUDA call (the copies'
        # event) would create a context on GPU 0 for a rank on another GPU
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        threading.Thread(
            target=self._finish, args=(staged, copied, done, device), name="checkpoint-stager", daemon=True
        ).start()
        return done

    def _finish(self, staged: dict[str, Any], copied, done: Future, device: int | None) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            copied()  # the model's copies (a side stream): the next step() changes the model too
            # finished first, then its outcome taken (once): a step() that waits meanwhile still finds it pending
            self.optimizer.state_exporter.join()
            failure = _export_failure(self.optimizer)
            if failure is not None:
                self.failure, self.verdict = failure, EXPORT_FAILED
            self.filled.set_result(time.perf_counter())  # the loop's next step() may run from here
            if self.verdict == FINITE and not all_finite(local_tensors(staged)):
                self.verdict = NON_FINITE
        except BaseException as exc:  # noqa: BLE001  (never raise into DCP's upload thread on one rank)
            self.failure, self.verdict = one_line(exc), EXPORT_FAILED
        finally:
            if not self.filled.done():
                self.filled.set_result(time.perf_counter())
            done.set_result(staged)

    def synchronize_staging(self) -> None:
        """Staging is synchronous (or, deferred, a Future that DCP's upload thread waits for)."""

    def close(self) -> None:
        """Nothing to free."""


def _export_failure(optimizer: Any) -> str | None:
    """Wait for a background export (``state_dict_offload_background``); its failure in one line, or None."""
    if isinstance(optimizer, OffloadedStateDict):
        try:
            optimizer.wait_state_dict()
        except Exception as exc:  # noqa: BLE001  (any failure of the export thread: nothing of it is saved)
            return one_line(exc)
    return None


def _release(optimizer: Any, osd: Any) -> None:
    """Give an export's pooled host buffers back to the optimizer (only our FusedAdams have any)."""
    if isinstance(optimizer, OffloadedStateDict):
        optimizer.release_state_dict(osd)


def _host_copy(obj: Any, keep=None) -> Any:
    """The same nested state dict with every tensor copied to host memory (DTensors stay DTensors, with a host
    local tensor); tensors for which ``keep(tensor)`` is true are passed through uncopied."""
    if isinstance(obj, torch.Tensor):
        return obj if keep is not None and keep(obj) else obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v, keep) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_host_copy(v, keep) for v in obj]
    return obj
