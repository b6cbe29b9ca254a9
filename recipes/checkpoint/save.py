"""The save of a checkpoint: sync, async, or async with a deferred export, with its checks agreed by all ranks
before anything is written, and its manifest once the save finished (docs/design.md, "Checkpoints").

The optimizer is exported with ``get_optimizer_state_dict`` (``flatten_optimizer_state_dict`` configurable); the
export is timed and, on CUDA, its GPU peak above the pre-export level is measured. A background export
(``optim.state_dict_offload_background``) is waited for within that time, and its failure on any rank refuses
the save on every rank before anything is written; except in an async save into reused buffers, which is
*deferred*: the save returns before the export is filled, the loop calls :meth:`Saves.wait_export` before the
next ``optimizer.step()``, and the NaN/inf check and a failed export refuse the checkpoint on every rank when the
save is finalised (:meth:`Saves.wait`; no marker, the directory removed). The report (seconds, bytes, GB/s,
peak), completed with the time the checkpoint held the training loop and the bytes written once the save is
complete (docs/recipe.md, "Export report"), is logged and handed to ``on_report``.

With ``optim.state_dict_offload_reuse_buffers`` the optimizer exports into pooled host buffers. They are handed
to DCP as they are (:class:`recipes.checkpoint.stager.ExportBufferStager` copies everything else), and given back
to the optimizer only once the save that reads them has finished (sync: when ``dcp.save`` returns; async: in
:meth:`Saves.wait`), so the next export can never overwrite a checkpoint that is still being written. A save that
would not fit in the free space of ``checkpoint.dir`` is refused before it writes; a write that runs out of space
says "disk full". With ``async_save`` the previous save is awaited before the next one starts and at exit, and
DCP's collectives for it run on a gloo group of their own, so that they never interleave with training's.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from optim_factory.checkpoint import deferred_export, defers_export, release_export
from optim_factory.optimizers.export import all_finite
from recipes.checkpoint.checksums import ALGORITHM, ChecksumFileSystemWriter, seal_manifest
from recipes.checkpoint.layout import (
    DCP_ERRORS,
    MARKER,
    METADATA,
    CheckpointError,
    disk_full,
    free_bytes,
    interrupted,
    is_complete,
    one_line,
    retain,
    step_dirs,
)
from recipes.checkpoint.report import ExportReport
from recipes.checkpoint.stager import (
    EXPORT_FAILED,
    FINITE,
    NO_SPACE,
    NON_FINITE,
    ExportBufferStager,
    export_failure_line,
)
from recipes.checkpoint.tree import local_tensors, state_bytes
from recipes.distributed import all_ranks

log = logging.getLogger(__package__)  # recipes.checkpoint: one logger for the package

SAVE_PHASES = ("export", "write", "marker")  # the points of a save at which CheckpointManager.on_phase runs
_STAGER_FUTURES = hasattr(dcp.state_dict_saver, "AsyncSaveResponse")  # async_save accepts a stager's Future


@dataclass
class InFlight:
    """An async save between its :meth:`Saves.save` call and its :meth:`Saves.wait`."""

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


class Saves:
    """The save half of :class:`recipes.checkpoint.manager.CheckpointManager` (its attributes are set there)."""

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
        later step), so the first save learns rank 0's list of them (one collective) and later saves cost no
        collective at all unless their step is on it: a barrier in the save call would hold every rank until the
        slowest arrives. The collectives run on the gloo save group when there is one (NCCL's would also wait for
        the device)."""
        if self._in_the_way is None:
            names = [p.name for _, p in step_dirs(self.root)] if self.rank == 0 else None
            self._in_the_way = set(all_ranks(names, self._save_group)[0])
        if path.name not in self._in_the_way:
            return
        self._in_the_way.discard(path.name)
        if self.rank == 0 and path.exists():
            kind = "complete" if is_complete(path) else "incomplete"
            log.warning("removing %s checkpoint %s before saving step %d again", kind, path, step)
            shutil.rmtree(path)
        if dist.is_initialized():
            dist.barrier(group=self._save_group)

    def due(self, step: int, max_steps: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every_steps == 0 or step == max_steps)

    def _defers(self, optimizer: Any) -> bool:
        """Whether the save of the export just started may return before the export is filled: an async save of
        a background export into pooled buffers (``optim.state_dict_offload_background`` with
        ``state_dict_offload_reuse_buffers``), for a caller that calls :meth:`wait_export` before ``step()``
        (``waits_before_step``). The stager then passes those buffers through uncopied, so nothing
        reads them before the export has filled them; without reuse the export's fresh host tensors would be
        copied at staging, so the save waits for the export as a synchronous one does."""
        # From the options alone, never from this rank's export (a rank with nothing to stream has none pending):
        # every rank must take the same path, whose collectives differ. DCP takes a stager's Future from torch 2.9.
        return self.waits_before_step and self.cfg.async_save and _STAGER_FUTURES and defers_export(optimizer)

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
        with deferred_export(optimizer):
            osd = get_optimizer_state_dict(model, optimizer, options=self.options)
        export_error = None if deferred else export_failure_line(optimizer)
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
            release_export(optimizer, osd)
            raise
        except BaseException:
            if deferred:
                export_failure_line(optimizer)  # nothing stages it: its failure must not reach the next step()
            release_export(optimizer, osd)
            raise
        self._clear_in_the_way(step, path)
        nbytes = state_bytes(osd)
        state = {"model": msd, "optim": osd, "trainer": trainer_state}
        t0 = time.perf_counter()
        in_flight = False
        stager = None
        writer = ChecksumFileSystemWriter(path, thread_count=self.write_threads)
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
        except DCP_ERRORS as exc:  # the previous checkpoint is complete and untouched; this one gets no marker
            if interrupted(exc):  # a second Ctrl-C during the write: the stop at once it asks for
                raise KeyboardInterrupt from exc
            raise CheckpointError(self._write_failure(f"saving {path} failed", path, exc)) from exc
        finally:
            if not in_flight:  # written (sync) or failed: nothing reads the export buffers any more
                if deferred and (stager is None or stager.filled is None):
                    export_failure_line(optimizer)  # never staged: its failure must not reach the next step()
                release_export(optimizer, osd)
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
            pending = InFlight(future, step, path, report, optimizer, osd, writer, 0.0, stager if deferred else None)
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
        the free space of ``checkpoint.dir`` (rank 0 judges the space; all ranks agree: one ``all_ranks`` collective). A
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
        needed = previous or self.world * state_bytes({"model": msd, "optim": osd})
        free = free_bytes(self.root)
        if needed <= free:
            return None
        return f"{self.root}: {free} bytes free, the save needs about {needed}"

    def resume_space_problem(self) -> str | None:
        """Every rank, before the first step of a resumed run: rank 0's line when the run's next save cannot fit
        (the bytes of the checkpoint it resumed from against the free space of ``checkpoint.dir``), else None; a
        launch refused here trains no interval for a save already known not to fit (one ``all_ranks``)."""
        return all_ranks(self._space_problem({}, {}) if self.rank == 0 else None)[0]

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
        """All ranks agree on the worst ``verdict`` (one collective); unless all are FINITE every rank raises the
        same one-line CheckpointError, after rank 0 removed ``path`` (a deferred save's written directory)."""
        worst = max(all_ranks(verdict))
        if worst == FINITE:
            return
        if path is not None:
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            if dist.is_initialized():
                dist.barrier()  # every rank raises once the directory is gone
        if worst == NO_SPACE:
            raise CheckpointError(
                f"not saving step {step}: no room for it ({space or 'on another rank'}); nothing was deleted, "
                f"the newest good checkpoint is {self.verified or 'none'}"
            )
        if worst == EXPORT_FAILED:
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
        parts = all_ranks(writer.checksums())
        return {name: record for part in parts for name, record in part.items()} if self.rank == 0 else None

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
            retain(self.root, self.cfg.keep_last, self.verified)
        report.blocking_s = held_s + (time.perf_counter() - held_since)
        log.info("%s", report.line())
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
        except DCP_ERRORS as exc:
            raise CheckpointError(self._write_failure(f"async save of {p.path} failed", p.path, exc)) from exc
        finally:
            release_export(p.optimizer, p.osd)  # the save is over: the next export may reuse them
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
