"""A save of a checkpoint, owned from its export to its sealed manifest by one :class:`Saver` (docs/design.md,
"Checkpoints"). Every save goes through the library's :class:`~optim_factory.checkpoint.AsyncSaveStager`, kept
from save to save on a gloo group of the run's own: the export inside ``stager.exporting()`` (timed; on CUDA its
GPU peak), then the stager's save, which every rank's checks refuse on every rank before DCP writes anything (a
failed background export, NaN/inf, and this saver's free-space check); sync: ``stager.save``, waited for; async:
``stager.async_save``, waited for before the next save or at the end. Either way one record (:class:`InFlight`)
and one wait (:meth:`Saver.wait`) seal it: the manifest with every file's checksum, ``keep_last``, the report.

An async save of a background export into pooled buffers is *deferred*: the save returns before the export is
filled, the stager completes it (the copies, the export's outcome, the NaN/inf check agreed by every rank), the loop
calls :meth:`Saver.wait_export` before the next ``step()``, and a failed or non-finite export refuses the checkpoint
on every rank before DCP writes anything (:meth:`Saver.wait` raises it).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse  # torch >= 2.9

from optim_factory.checkpoint import (
    AsyncSaveStager,
    SaveRefused,
    StagerOptions,
    defers_export,
)
from optim_factory.tree import state_bytes
from recipes.checkpoint.checksums import ALGORITHM, ChecksumFileSystemWriter, writer_options
from recipes.checkpoint.layout import (
    DCP_ERRORS,
    CheckpointError,
    checkpoint_key,
    free_bytes,
    interrupted,
    is_complete,
    recorded_files,
    retain,
    step_dirs,
    write_failure,
    write_manifest,
)
from recipes.checkpoint.report import ExportReport
from recipes.distributed import all_ranks, world_size

log = logging.getLogger(__package__)  # recipes.checkpoint: one logger for the package

SAVE_PHASES = ("export", "write", "marker")  # the points of a save at which the saver's on_phase runs
PhaseCallback = Callable[[str, int, Path], None]


@dataclass
class InFlight:
    """The saver's one record of a save, from its :meth:`Saver.save` call to its sealed manifest in
    :meth:`Saver.wait` (a sync save is written when its call returns and sealed at once; an async one when the next
    save or the end waits for it)."""

    step: int
    path: Path
    report: ExportReport
    export_t0: float  # when the save call started (its export first); a background export_s ends when filled
    deferred: bool  # an async save that returns before its export is filled (Saver.defers)
    # the stager's response to an async save: staging_completion (the copies done, the export filled),
    # upload_completion (written, or SaveRefused on every rank); None for a sync save, written by its call
    response: AsyncSaveResponse | None = None
    held_s: float = 0.0  # how long this checkpoint has held the loop so far
    export_waited: bool = False  # wait_export() ran (later calls return at once)


class Saver:
    """Every save of one run's checkpoints into ``checkpoint.dir``, each from its export to its sealed manifest
    and ``keep_last``; at most one in flight (:class:`InFlight`)."""

    def __init__(
        self,
        cfg,
        *,
        rank: int,
        device: torch.device,
        options: StateDictOptions,
        write_threads: int,
        save_group: Any,
        run_config: dict[str, Any] | None,
        waits_before_step: bool,
        on_report: Callable[[ExportReport], None] | None,
        on_phase: PhaseCallback | None = None,
    ):
        """``save_group``: the saves' gloo group (None: one process); ``run_config``: in every manifest;
        ``on_phase``: called with (phase, step, path) at each point of ``SAVE_PHASES`` of every save (for tests that
        observe saves: ``tests/fault/fault_train.py`` kills the process there). ``"export"``: the optimizer is
        exported (deferred: its export started), nothing of ``path`` is written; ``"write"``: the save is written
        (sync) or in flight (async), no marker yet; ``"marker"``: the save finished (async: inside :meth:`wait`)
        and the completion marker is about to be written."""
        self.cfg, self.rank, self.device, self.options = cfg, rank, device, options
        self.root = Path(cfg.dir)
        self.write_threads, self.save_group = write_threads, save_group
        self.run_config, self.waits_before_step = run_config, waits_before_step
        self.on_report, self.on_phase = on_report, on_phase or (lambda phase, step, path: None)
        self.key = checkpoint_key(cfg)  # checkpoint.key_env's: every file and the manifest signed with it
        self.reports: list[ExportReport] = []
        # the newest checkpoint known good: the last saved, or the one the manager loaded; never deleted
        self.verified: Path | None = None
        self._pending: InFlight | None = None
        self._stager: AsyncSaveStager | None = None  # the saves' staging, kept from save to save
        # DCP's writer of every save of the stager's optimizer, with its options (writer_options): kept from save to
        # save, each save's directory its checkpoint_id (DCP's reset, which also clears the last save's checksums,
        # read by wait() before the next save starts)
        self._writer: ChecksumFileSystemWriter | None = None
        # the stager's optimizer's export, from its options (so every save of it, on every rank, the same): filled
        # after the export call returns (a background export), and then into pooled buffers (defers_export)
        self._filled_later = self._pooled = False
        self._needed = 0  # the bytes the save being staged needs in checkpoint.dir (rank 0's space check)
        self._in_the_way: set[str] | None = None  # step directories of earlier launches, rank 0's (_clear_in_the_way)

    def _clear_in_the_way(self, step: int, path: Path) -> None:
        """Rank 0 removes a directory of this step from an earlier launch (incomplete, or complete from before a
        resume at an earlier step) before any rank writes into it, behind a barrier. Only a directory that existed
        at the first save can be in the way: the first save learns rank 0's list (one collective), later ones cost
        no collective unless their step is on it. On the gloo save group if any (NCCL's waits for the device)."""
        if self._in_the_way is None:
            names = [p.name for _, p in step_dirs(self.root)] if self.rank == 0 else None
            self._in_the_way = set(all_ranks(names, self.save_group)[0])
        if path.name not in self._in_the_way:
            return
        self._in_the_way.discard(path.name)
        if self.rank == 0 and path.exists():
            kind = "complete" if is_complete(path) else "incomplete"
            log.warning("removing %s checkpoint %s before saving step %d again", kind, path, step)
            shutil.rmtree(path)
        if dist.is_initialized():
            dist.barrier(group=self.save_group)

    @property
    def defers(self) -> bool:
        """Whether an async save of a background export into pooled buffers (``defers_export``: the stager passes
        them through uncopied) returns before the export is filled: for a caller that calls :meth:`wait_export`
        before ``step()`` (else the save call waits for the fill itself). From the options alone, so that every
        rank takes the same path (a rank with nothing to stream has no export pending)."""
        return self.waits_before_step and self.cfg.async_save

    def export(self, model, optimizer) -> tuple[dict, dict, float, float | None]:
        """(model sd, optimizer sd, export seconds, GPU peak MiB): one ``get_state_dict`` of both (DCP checks the
        model and its options once, not once per state dict; the seconds include the model's, a walk of its
        parameters without a copy) inside the stager's ``exporting()``: a background
        export returns unfilled (the stager fills it; its failure is the save's refusal on every rank; its seconds
        end when it is filled: :meth:`wait`), an export within the host budget holds placeholders, filled as the
        save writes them. On CUDA the device is synchronized around an export that is not in the background, so
        that its seconds are its own."""
        stager, on_cuda = self._stager_for(optimizer), self.device.type == "cuda"
        background = self._filled_later
        if on_cuda:
            if not background:
                torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        with stager.exporting():
            msd, osd = get_state_dict(model, optimizer, options=self.options)
        if on_cuda and not background:
            torch.cuda.synchronize(self.device)
        export_s = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20 if on_cuda else None
        return msd, osd, export_s, peak

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> ExportReport:
        """Export and save a checkpoint for ``step`` (async if configured). Returns the export report.

        A deferred export (:attr:`defers`) returns before the optimizer's export is filled: the stager copies the
        model here and completes the rest (the export, the finite check, every rank's agreement) in the
        background; :meth:`wait` raises its refusal. Call :meth:`wait_export` before the next ``optimizer.step()``."""
        self.wait()  # one save in flight at most; its buffers are never touched by the next export
        held_since = time.perf_counter()  # this checkpoint holds the loop from here (the wait above: the previous)
        path = self.root / f"step_{step:08d}"
        msd, osd, export_s, peak = self.export(model, optimizer)
        state = {"model": msd, "optim": osd, "trainer": trainer_state}
        pooled = self._pooled  # a background export into pooled buffers, returned unfilled
        try:
            self.on_phase("export", step, path)
            self._clear_in_the_way(step, path)
            export_bytes = state_bytes(osd)
            report = ExportReport(
                step=step,
                path=str(path),
                export_s=export_s,
                export_bytes=export_bytes,
                gpu_peak_mib=peak,
                save_s=0.0,  # set once the save call returns
                async_save=self.cfg.async_save,
                flatten=self.cfg.flatten_optimizer_state_dict,
                deferred=pooled and self.defers,
            )
            save = InFlight(step, path, report, held_since, deferred=report.deferred)
            self._needed = self._needed_bytes(export_bytes + state_bytes(msd))
        except BaseException:
            self._stager.discard(osd)  # nothing staged it: its buffers back, its failure taken
            raise
        t0 = time.perf_counter()
        self._write(save, state)
        report.save_s = time.perf_counter() - t0
        self.reports.append(report)
        self._pending = save  # in flight (async) or written (sync) from here; on_phase may look at it
        self.on_phase("write", step, path)
        save.held_s = time.perf_counter() - held_since  # the save call's share; wait_export and wait add theirs
        if not self.cfg.async_save:
            self.wait()
        elif pooled and not save.deferred:  # nobody waits before step(): the fill is waited here
            save.response.staging_completion.result()
            save.held_s = time.perf_counter() - held_since
        return report

    def _stager_for(self, optimizer) -> AsyncSaveStager:
        """The saves' stager, kept from save to save (a new one for another optimizer): a NaN/inf state, a failed
        background export and this saver's space check refuse a save on every rank before anything is written."""
        if self._stager is None or self._stager.optimizers != [optimizer]:
            if self._stager is not None:
                self._stager.close()
            options = StagerOptions(
                refuse_non_finite=True, check=self._space_check, write_in_process=self.cfg.write_in_process
            )
            self._stager = AsyncSaveStager(optimizer, options, process_group=self.save_group)
            self._filled_later, self._pooled = self._stager.export_filled_later, defers_export(optimizer)
            options = writer_options(optimizer, self.write_threads)  # the optimizer's, for every save
            self._writer = ChecksumFileSystemWriter(self.root, key=self.key, **options)
        return self._stager

    def _write(self, save: InFlight, state: dict) -> None:
        """The stager's save of ``state``: ``stager.save`` (sync, written when it returns) or ``stager.async_save``,
        whose response ``save`` holds from here on. The stager gives the export's buffers back once written, or
        once it refused or failed the save."""
        stager, where = self._stager, dict(checkpoint_id=str(save.path), storage_writer=self._writer)
        try:
            if self.cfg.async_save:
                save.response = stager.async_save(state, process_group=self.save_group, **where)
            else:
                stager.save(state, process_group=self.save_group, **where)
        except (SaveRefused, *DCP_ERRORS) as exc:
            raise self._failure(save, exc) from exc

    @property
    def export_filling(self) -> bool | None:
        """None when no async save with a deferred export is in flight; else whether its export is still being
        filled (the loop runs meanwhile; :meth:`wait_export` waits for it)."""
        pending = self._pending
        if pending is None or not pending.deferred:
            return None
        return not pending.response.staging_completion.done()

    def wait_export(self) -> None:
        """Call before ``optimizer.step()``: wait until the in-flight save's deferred export is filled (``step()``
        would wait for it anyway). The wait is counted in that checkpoint's ``blocking_s``. Returns at once when
        no deferred export is pending. A failure is not raised here: :meth:`wait` refuses the save on every rank."""
        pending = self._pending
        if pending is None or not pending.deferred or pending.export_waited:
            return
        t0 = time.perf_counter()
        pending.response.staging_completion.result()
        pending.held_s += time.perf_counter() - t0
        pending.export_waited = True

    def _space_check(self, staged: dict) -> str | None:
        """``StagerOptions.check`` of every save (on the stager's thread, before DCP writes): rank 0's refusal of a
        save that cannot fit in the free space of ``checkpoint.dir``, agreed by every rank with the stager's other
        refusals; a write that runs out of space anyway says so (``write_failure``)."""
        problem = self._space_problem(self._needed) if self.rank == 0 else None
        return None if problem is None else f"no room for it ({problem})"

    def _needed_bytes(self, estimate: int) -> int:
        """What the next save needs in ``checkpoint.dir``: the previous save's bytes (this launch's, else the files
        of the checkpoint it resumed from), else every rank's share estimated as this rank's (``estimate``)."""
        previous = next((r.written_bytes for r in reversed(self.reports) if r.written_bytes), None)
        if previous is None and self.verified is not None and self.verified.is_dir():
            previous = sum(p.stat().st_size for p in self.verified.iterdir() if p.is_file())
        return previous or world_size() * estimate

    def _space_problem(self, needed: int) -> str | None:
        """``"<dir>: N bytes free, the save needs about M"`` when ``needed`` bytes do not fit, else None."""
        free = free_bytes(self.root)
        return None if needed <= free else f"{self.root}: {free} bytes free, the save needs about {needed}"

    def first_save_space_problem(self, estimate: int) -> str | None:
        """Every rank, before the first step: rank 0's line when the run's next save cannot fit in ``checkpoint.dir``
        (the checkpoint resumed from, else ``estimate``, this rank's share of a fresh run's), else None; a launch
        refused here trains no interval for a save known not to fit (one ``all_ranks``)."""
        return all_ranks(self._space_problem(self._needed_bytes(estimate)) if self.rank == 0 else None)[0]

    def _failure(self, save: InFlight, exc: BaseException) -> BaseException:
        """What a failed save raises: every rank's refusal (the stager's :class:`SaveRefused`) or a write's failure
        as one line (``CheckpointError``; the previous checkpoint is complete and untouched, this one gets no
        marker), or the stop at once a second Ctrl-C during the write asks for."""
        if isinstance(exc, SaveRefused):
            if save.report in self.reports:
                self.reports.remove(save.report)  # never complete: not this launch's checkpoint
            reasons = "; ".join(exc.reasons)
            return CheckpointError(
                f"not saving step {save.step}: {reasons}; the newest good checkpoint is {self.verified or 'none'}"
            )
        if interrupted(exc):
            return KeyboardInterrupt()
        what = f"async save of {save.path}" if self.cfg.async_save else f"saving {save.path}"
        return CheckpointError(write_failure(f"{what} failed", save.path, self.root, self.rank, exc))

    def _finalize(self, save: InFlight, waited_since: float) -> None:
        """Mark the finished ``save`` complete (every rank's file checksums in the manifest), apply keep_last, and
        report it. The loop is held by this checkpoint ``save.held_s`` seconds before ``waited_since`` and from
        then on. All ranks call it once the save finished."""
        step, path, report = save.step, save.path, save.report
        parts = all_ranks(self._writer.checksums())  # merged on rank 0, which writes the manifest
        self.on_phase("marker", step, path)
        if self.rank == 0:
            files = recorded_files(path, parts)
            report.written_bytes = sum(int(r["size"]) for r in files.values())
            record = report.record()
            del record["blocking_s"]  # not known yet: it ends after the marker and keep_last (metrics.jsonl has it)
            manifest = {"step": step, "time": time.time(), **record, "checksum": ALGORITHM, "files": files}
            write_manifest(path, {**manifest, "config": self.run_config}, self.key)
        self.verified = path
        if self.rank == 0:
            retain(self.root, self.cfg.keep_last, self.verified)
        report.blocking_s = save.held_s + (time.perf_counter() - waited_since)
        log.info("%s", report.line())
        if self.on_report is not None:
            self.on_report(report)

    def wait(self) -> None:
        """Wait for the save in flight (an async one's write; a sync one is written) and mark it complete. A failed
        save raises here, never silently; so does, on every rank, a save the stager refused (an export that failed
        or holds non-finite values on any rank, no room for it) before DCP wrote anything."""
        if self._pending is None:
            return
        waited_since = time.perf_counter()
        save, self._pending = self._pending, None
        if save.response is not None:
            try:
                save.response.upload_completion.result()
            except (SaveRefused, *DCP_ERRORS) as exc:
                raise self._failure(save, exc) from exc
        filled_at = self._stager.export_filled_at  # a background export's: its seconds end when it was filled
        if filled_at is not None:
            save.report.export_s = filled_at - save.export_t0
        save.report.host_bytes = self._stager.save_host_bytes
        self._finalize(save, waited_since)

    def close(self) -> None:
        """Wait for an in-flight save (its failure raises) and free the stager's host copies."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
