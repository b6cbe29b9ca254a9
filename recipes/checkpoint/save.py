"""A save of a checkpoint, owned from its export to its sealed manifest by one :class:`Saver` (docs/design.md,
"Checkpoints"): the export (timed; on CUDA its GPU peak), the checks agreed by all ranks before anything is written
(NaN/inf, a failed background export, free space), DCP's write (sync, or async through the library's
:class:`~optim_factory.checkpoint.AsyncSaveStager` on a gloo group of its own, as is a save within a host budget),
the wait for an async save, the manifest with every file's checksum, ``keep_last``, and the report.

An async save of a background export into pooled buffers is *deferred*: the save returns before the export is
filled, the stager completes it (the copies, the export's outcome, the NaN/inf check agreed by every rank), the loop
calls :meth:`Saver.wait_export` before the next ``step()``, and a failed or non-finite export refuses the checkpoint
on every rank before DCP writes anything (:meth:`Saver.wait` raises it).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from optim_factory.checkpoint import (
    EXPORT_FAILED_LINE,
    NON_FINITE_LINE,
    AsyncSaveStager,
    SaveRefused,
    StagerOptions,
    deferred_export,
    defers_export,
    export_failure,
    host_budget,
    release_export,
)
from optim_factory.errors import first_line
from optim_factory.optimizers.export import all_finite
from optim_factory.tree import host_storage_bytes, local_tensors, state_bytes
from recipes.checkpoint.checksums import ALGORITHM, ChecksumFileSystemWriter, writer_options
from recipes.checkpoint.in_flight import InFlight
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

SAVE_PHASES = ("export", "write", "marker")  # the points of a save at which Saver.on_phase runs
FINITE, NO_SPACE, NON_FINITE, EXPORT_FAILED = 0, 1, 2, 3  # a save's verdict, agreed by all ranks (the worst wins)


def failure_line(optimizer) -> str | None:
    """Wait for a background export (``state_dict_offload_background``); its failure in one line, or None."""
    failure = export_failure(optimizer)
    return None if failure is None else first_line(failure, named=True)


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
    ):
        """``save_group``: the async saves' gloo group (None: the default group); ``run_config``: in every manifest."""
        self.cfg, self.rank, self.device, self.options = cfg, rank, device, options
        self.root = Path(cfg.dir)
        self.write_threads, self.save_group = write_threads, save_group
        self.run_config, self.waits_before_step = run_config, waits_before_step
        self.on_report = on_report
        self.key = checkpoint_key(cfg)  # checkpoint.key_env's: every file and the manifest signed with it
        self.reports: list[ExportReport] = []
        # the newest checkpoint known good: the last saved, or the one the manager loaded; never deleted
        self.verified: Path | None = None
        self._pending: InFlight | None = None
        self._stager: AsyncSaveStager | None = None  # async saves' staging, kept from save to save
        self._in_the_way: set[str] | None = None  # step directories of earlier launches, rank 0's (_clear_in_the_way)

    def on_phase(self, phase: str, step: int, path: Path) -> None:
        """Called at each point of ``SAVE_PHASES`` of the save of ``step`` into ``path``; does nothing here.

        For subclasses that observe saves (``tests/fault/fault_train.py`` kills the process there): ``"export"``:
        the optimizer is exported (deferred: its export started), nothing of ``path`` is written; ``"write"``:
        ``dcp.save`` returned or the async save is in flight, no marker yet; ``"marker"``: the save finished
        (async: inside :meth:`wait`) and the completion marker is about to be written."""

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

    def defers(self, optimizer) -> bool:
        """Whether an async save may return before the export is filled: a background export into pooled buffers
        (``defers_export``: the stager passes them through uncopied; fresh ones it would copy unfilled), for a
        caller that calls :meth:`wait_export` before ``step()``. From the options alone, so that every rank takes
        the same path (a rank with nothing to stream has no export pending)."""
        return self.waits_before_step and self.cfg.async_save and defers_export(optimizer)

    def export(self, model, optimizer, deferred: bool) -> tuple[dict, dict, float, float | None, str | None]:
        """(model sd, optimizer sd, export seconds, GPU peak MiB, a background export's failure in one line or None);
        ``deferred``: the seconds and the peak of the export call, which returns before the export is filled."""
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            if not deferred:  # the export's own seconds; a deferred save returns at once and never waits here
                torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        # a background export returns unfilled (waited for below unless deferred); a budget's holds placeholders
        budget = self._stager_for(optimizer).exporting() if host_budget(optimizer) else contextlib.nullcontext()
        with deferred_export(optimizer), budget:
            osd = get_optimizer_state_dict(model, optimizer, options=self.options)
        export_error = None if deferred else failure_line(optimizer)
        if on_cuda and not deferred:
            torch.cuda.synchronize(self.device)
        export_s = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20 if on_cuda else None
        return get_model_state_dict(model, options=self.options), osd, export_s, peak, export_error

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any]) -> ExportReport:
        """Export and save a checkpoint for ``step`` (async if configured). Returns the export report.

        A deferred export (:meth:`defers`) returns before the optimizer's export is filled: the stager copies the
        model here and completes the rest (the export, the finite check, every rank's agreement) in the
        background; :meth:`wait` raises its refusal. Call :meth:`wait_export` before the next ``optimizer.step()``."""
        self.wait()  # one save in flight at most; its buffers are never touched by the next export
        held_since = time.perf_counter()  # this checkpoint holds the loop from here (the wait above: the previous)
        path = self.root / f"step_{step:08d}"
        deferred = self.defers(optimizer)
        msd, osd, export_s, peak, export_error = self.export(model, optimizer, deferred)
        try:
            self.on_phase("export", step, path)
            live = list(optimizer.state.values()) if host_budget(optimizer) else []  # checked for placeholders
            self._check_before_writing(step, msd, osd, export_error, deferred, live)
        except BaseException:
            if deferred:
                failure_line(optimizer)  # nothing stages it: its failure must not reach the next step()
            release_export(optimizer, osd)
            raise
        self._clear_in_the_way(step, path)
        nbytes = state_bytes(osd)
        t0 = time.perf_counter()
        writer = ChecksumFileSystemWriter(path, key=self.key, **writer_options(optimizer, self.write_threads))
        pending = InFlight(step, path, writer, held_since, deferred) if self.cfg.async_save else None
        state = {"model": msd, "optim": osd, "trainer": trainer_state}
        # the host memory a save that writes the state itself holds: the export's host buffers (the live states are
        # written as they are); a save through the stager holds what the stager counts, read once the save is over
        held = None
        if not self._through_stager(optimizer):  # an async save's call does none of this walk
            held = host_storage_bytes(state, excluding=(list(model.state_dict().values()), optimizer.state))
        self._write(state, path, writer, optimizer, pending)
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
            host_bytes=held,
        )
        self.reports.append(report)
        if pending is not None:  # in flight from here (on_phase may look at it)
            pending.report, self._pending = report, pending
            self.on_phase("write", step, path)
            pending.held_s = time.perf_counter() - held_since  # the save call's share; wait_export and wait add theirs
        else:
            self.on_phase("write", step, path)
            if report.host_bytes is None:  # a sync save within a budget, the stager's
                report.host_bytes = self._stager.save_host_bytes
            self._finalize(step, path, report, writer, held_since)
        return report

    def _through_stager(self, optimizer) -> bool:
        """Whether this run's saves go through the stager: async ones, and sync ones within a host budget."""
        return self.cfg.async_save or host_budget(optimizer) is not None

    def _stager_for(self, optimizer) -> AsyncSaveStager:
        """The async saves' stager, kept from save to save (a new one for another optimizer)."""
        if self._stager is None or self._stager.optimizers != [optimizer]:
            if self._stager is not None:
                self._stager.close()
            # a save that is not deferred was checked before writing (_check_before_writing): not read twice
            finite = self.defers(optimizer)
            self._stager = AsyncSaveStager(
                optimizer, StagerOptions(refuse_non_finite=finite), process_group=self.save_group
            )
        return self._stager

    def _write(self, state: dict, path: Path, writer, optimizer, pending: InFlight | None) -> None:
        """``dcp.save`` (``pending`` None), or the stager's ``dcp.async_save``, whose upload ``pending`` holds from
        here on and which gives the export's buffers back once written. A sync save's buffers go back here."""
        try:
            if self._through_stager(optimizer):  # a sync save within a budget: the stager's, waited for
                response = self._stager_for(optimizer).async_save(
                    state, checkpoint_id=str(path), storage_writer=writer, process_group=self.save_group
                )
                if pending is None:
                    response.upload_completion.result()
                    return
                pending.staged, pending.upload = response.staging_completion, response.upload_completion
                pending.staged.add_done_callback(lambda _: setattr(pending, "filled_at", time.perf_counter()))
            else:
                dcp.save(state, checkpoint_id=str(path), storage_writer=writer)
        except DCP_ERRORS as exc:  # the previous checkpoint is complete and untouched; this one gets no marker
            if interrupted(exc):  # a second Ctrl-C during the write: the stop at once it asks for
                raise KeyboardInterrupt from exc
            raise CheckpointError(write_failure(f"saving {path} failed", path, self.root, self.rank, exc)) from exc
        finally:
            if pending is None or pending.upload is None:  # written (sync) or never started
                if pending is not None and pending.deferred:
                    failure_line(optimizer)  # never staged: its failure must not reach the next step()
                release_export(optimizer, state["optim"])

    @property
    def export_filling(self) -> bool | None:
        """None when no async save with a deferred export is in flight; else whether its export is still being
        filled (the loop runs meanwhile; :meth:`wait_export` waits for it)."""
        pending = self._pending
        if pending is None or not pending.deferred:
            return None
        return not pending.staged.done()

    def wait_export(self) -> None:
        """Call before ``optimizer.step()``: wait until the in-flight save's deferred export is filled (``step()``
        would wait for it anyway). The wait is counted in that checkpoint's ``blocking_s``. Returns at once when
        no deferred export is pending. A failure is not raised here: :meth:`wait` refuses the save on every rank."""
        pending = self._pending
        if pending is None or not pending.deferred or pending.export_waited:
            return
        t0 = time.perf_counter()
        pending.staged.result()
        pending.held_s += time.perf_counter() - t0
        pending.export_waited = True

    def _check_before_writing(
        self, step: int, msd: dict, osd: dict, export_error: str | None, deferred: bool, live: list
    ) -> None:
        """Refuse to save a state holding NaN or inf, or whose background export failed, or that cannot fit in
        the free space of ``checkpoint.dir`` (rank 0 judges the space; all ranks agree: one ``all_ranks`` collective). A
        deferred save has no collective in the save call: the stager checks it (``refuse_non_finite``: its CUDA
        states before the fill, host tensors once filled; :meth:`wait` raises a refusal), and a write that runs out
        of space says so."""
        if deferred:
            return
        space = self._space_problem(msd, osd) if self.rank == 0 else None
        if export_error is not None:
            verdict = EXPORT_FAILED
        elif not all_finite(t for t in local_tensors({"model": msd, "optim": osd, "live": live}) if not t.is_meta):
            verdict = NON_FINITE
        else:
            verdict = NO_SPACE if space else FINITE
        self._agree(step, verdict, export_error, space=space)

    def _space_problem(self, msd: dict, osd: dict, estimate: int = 0) -> str | None:
        """Rank 0: ``"<dir>: N bytes free, the save needs about M"`` when this save cannot fit: M is the previous
        save's bytes (this launch's, else the files of the checkpoint it resumed from), else every rank's share
        estimated as this rank's (``estimate``, else its state bytes)."""
        previous = next((r.written_bytes for r in reversed(self.reports) if r.written_bytes), None)
        if previous is None and self.verified is not None and self.verified.is_dir():
            previous = sum(p.stat().st_size for p in self.verified.iterdir() if p.is_file())
        needed = previous or world_size() * (estimate or state_bytes({"model": msd, "optim": osd}))
        free = free_bytes(self.root)
        if needed <= free:
            return None
        return f"{self.root}: {free} bytes free, the save needs about {needed}"

    def first_save_space_problem(self, estimate: int) -> str | None:
        """Every rank, before the first step: rank 0's line when the run's next save cannot fit in ``checkpoint.dir``
        (the checkpoint resumed from, else ``estimate``, this rank's share of a fresh run's), else None; a launch
        refused here trains no interval for a save known not to fit (one ``all_ranks``)."""
        return all_ranks(self._space_problem({}, {}, estimate) if self.rank == 0 else None)[0]

    def _agree(self, step: int, verdict: int, export_error: str | None, space: str | None = None) -> None:
        """All ranks agree on the worst ``verdict`` (one collective); unless all are FINITE every rank raises the
        same one-line CheckpointError."""
        worst = max(all_ranks(verdict))
        if worst == FINITE:
            return
        why = {
            NO_SPACE: f"no room for it ({space or 'on another rank'}); nothing was deleted,",
            EXPORT_FAILED: f"{EXPORT_FAILED_LINE} ({export_error or 'on another rank'});",
            NON_FINITE: f"{NON_FINITE_LINE};",
        }[worst]
        raise CheckpointError(f"not saving step {step}: {why} the newest good checkpoint is {self.verified or 'none'}")

    def _finalize(
        self,
        step: int,
        path: Path,
        report: ExportReport,
        writer: ChecksumFileSystemWriter,
        held_since: float,
        held_s=0.0,
    ) -> None:
        """Mark the finished save of ``step`` complete (every rank's file checksums in the manifest), apply keep_last,
        and report it. The loop is held by this checkpoint ``held_s`` seconds before ``held_since`` (an async save's
        call) and from ``held_since`` on. All ranks call it once the save finished."""
        parts = all_ranks(writer.checksums())  # merged on rank 0, which writes the manifest
        self.on_phase("marker", step, path)
        if self.rank == 0:
            files = recorded_files(path, parts)
            report.written_bytes = sum(int(r["size"]) for r in files.values())
            record = asdict(report)
            del record["blocking_s"]  # not known yet: it ends after the marker and keep_last (metrics.jsonl has it)
            manifest = {"step": step, "time": time.time(), **record, "checksum": ALGORITHM, "files": files}
            write_manifest(path, {**manifest, "config": self.run_config}, self.key)
        self.verified = path
        if self.rank == 0:
            retain(self.root, self.cfg.keep_last, self.verified)
        report.blocking_s = held_s + (time.perf_counter() - held_since)
        log.info("%s", report.line())
        if self.on_report is not None:
            self.on_report(report)

    def wait(self) -> None:
        """Wait for an in-flight async save; mark it complete. A failed save raises here, never silently; so does,
        on every rank, a deferred export that failed or holds non-finite values on any rank (the stager refused
        it before DCP wrote anything)."""
        if self._pending is None:
            return
        waited_since = time.perf_counter()
        p = self._pending
        self._pending = None
        try:
            p.upload.result()
        except SaveRefused as exc:
            self.reports.remove(p.report)  # never complete: not this launch's checkpoint
            raise CheckpointError(
                f"not saving step {p.step}: {'; '.join(exc.reasons)}; the newest good checkpoint is "
                f"{self.verified or 'none'}"
            ) from exc
        except DCP_ERRORS as exc:
            line = write_failure(f"async save of {p.path} failed", p.path, self.root, self.rank, exc)
            raise CheckpointError(line) from exc
        if p.deferred:
            p.report.export_s = p.filled_at - p.export_t0  # from the export call until its tensors were filled
            p.report.export_gbps = p.report.export_bytes / p.report.export_s / 1e9 if p.report.export_s > 0 else 0.0
        p.report.host_bytes = self._stager.save_host_bytes
        self._finalize(p.step, p.path, p.report, p.writer, waited_since, p.held_s)

    def close(self) -> None:
        """Wait for an in-flight save (its failure raises) and free the stager's host copies."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
