"""``AsyncSaveStager``: the async save's staging, kept across saves, for any checkpointer that calls
``dcp.async_save`` (docs/export.md, "Async saves"; docs/design.md, "The async-save stager").

DCP's own stagers copy every tensor into host memory of their own when a save starts: for our optimizers' exports, a
second copy of what is already on the host. This stager passes the export's pooled buffers to DCP's writer uncopied
and gives them back once written, copies the rest (the model's tensors) into pinned host buffers kept from save to
save, and completes a background export (``state_dict_offload_background``) on a thread of its own while training
goes on. With any other optimizer it stages as DCP's stager does. An optimizer with ``state_dict_offload_host_budget``
is saved within it: nothing is copied when the save starts; its planner fills each tensor as the writer reaches it
(``optim_factory.checkpoint``), and the staging completes once what is left fits the budget.

A save is refused on every rank, before DCP writes anything, when an export failed or did not fill within
``export_timeout_s``, the state holds NaN or inf (``refuse_non_finite``), or ``check`` refuses it:
``upload_completion`` raises :class:`SaveRefused` in one line and the checkpoint directory is not written (nor, a
local one, left behind). DCP plans a save :meth:`AsyncSaveStager.async_save` starts at once; its planning ends by
waiting for the ranks' verdict (``optim_factory/checkpoint/_gated_planner.py``; docs/design.md says which saves).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse  # torch >= 2.9
from torch.distributed.checkpoint.stateful import Stateful

from optim_factory.checkpoint._export_waits import ExportWaits
from optim_factory.checkpoint._fillers import filler_for
from optim_factory.checkpoint._gated_planner import GatedPlanner
from optim_factory.checkpoint._options import FIELD_NAMES, StagerOptions
from optim_factory.checkpoint._record import StagedSave
from optim_factory.checkpoint._save_end import SaveEnd
from optim_factory.checkpoint._verdict import complete_staging
from optim_factory.checkpoint._writer_process import WriterProcess
from optim_factory.errors import SaveRefused, first_line
from optim_factory.optimizers.export import OffloadedStateDict, local_tensor


class AsyncSaveStager(AsyncStager):
    """DCP's ``AsyncStager`` for async saves of our optimizers' exports, kept across saves; ``close()`` frees it.

    ``optimizers``: the optimizer (or optimizers) whose exports the saved state dicts hold; any optimizer works, at
    most one with a host budget. ``options``: a :class:`StagerOptions` (a NaN/inf refusal, a ``check`` of the
    filled state, pinned copies, the background export's timeout, the write in a writer process; its defaults
    without). ``process_group``: the gloo group on which the ranks agree on a refusal (default: one of its own over
    the default group's ranks, made here or at the first save, so every rank builds and first uses its stager in the
    same order; none on a single process).

    Start a save with :meth:`async_save` (``dcp.async_save``'s arguments): at most one save is in flight, and its
    export buffers go back to the optimizer when its write is done. ``dcp.async_save(..., async_stager=stager)``
    works too (not with a budget); its buffers go back when the next save is staged (its caller has waited for the
    previous ``upload_completion`` by then, DCP's rule for any stager that reuses memory), the export in between
    taking a second set. Before the next ``optimizer.step()``, wait for the response's ``staging_completion`` (or
    :meth:`wait_staged`): the model's copies and a background export read what ``step()`` changes (our
    optimizers' ``step()`` waits for their own export and a budget's fills).
    """

    _synchronize_after_execute = False  # staging completes through the Future stage() returns

    def __init__(
        self,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
        options: StagerOptions | None = None,
        *,
        process_group: Any = None,
    ) -> None:
        given = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
        self.optimizers = list(given) if isinstance(given, Iterable) else [given]
        stray = [type(o).__name__ for o in self.optimizers if not isinstance(o, torch.optim.Optimizer)]
        if stray:
            raise TypeError(f"AsyncSaveStager(optimizers=...): expected torch optimizers, got {', '.join(stray)}")
        if options is not None and not isinstance(options, StagerOptions):
            raise TypeError(f"AsyncSaveStager(options=...): expected StagerOptions(...), got {options!r}")
        self.options = StagerOptions() if options is None else options
        # ours, resolved once: the stager calls their export API itself (others are staged as DCP stages them)
        self._ours = [opt for opt in self.optimizers if isinstance(opt, OffloadedStateDict)]
        self._exports = ExportWaits(self._ours, self.options.export_timeout_s)  # their background exports waited for
        # the one part that gives a save its host tensors: copies at its start, or fills within a budget
        self._filler = filler_for(self.optimizers, self.options.pinned, shared=self.options.write_in_process)
        self._ends = SaveEnd(self._filler, self._ours)  # a save's buffers given back, its upload completed
        for opt in self._ours if self.options.write_in_process else ():
            opt.share_export_memory()  # the writer process reads the export's pooled buffers where they are
        self._writer: WriterProcess | None = None  # write_in_process: the rank's writer process, from the first save
        self._check_streams: dict[torch.device, Any] = {}  # the finite check's side stream per device
        self._group = process_group
        self._own_group = False
        self._save: StagedSave | None = None
        self._closed = False
        self._gate_next: GatedPlanner | None = None  # async_save's: DCP's planning of the next save ends at its gate
        self._own_save = False  # inside async_save: the save's writer is built or checked here
        self._waited = False  # inside save(): nothing is copied (nothing changes the state until it is written)
        self._join_ranks()

    # ------------------------------------------------------------------ DCP's protocol
    def stage(self, state_dict: dict[str, Any]) -> Future:
        """Host copies of ``state_dict`` for DCP's writer: pooled export buffers passed through, every other tensor
        copied into the stager's buffers. Returns the Future DCP's upload waits for (see the module docstring)."""
        self._check_open()
        if self.options.write_in_process and not self._own_save:
            raise RuntimeError(
                "AsyncSaveStager(StagerOptions(write_in_process=True)): start its saves with stager.async_save; "
                "dcp.async_save(..., async_stager=stager) writes on DCP's own executor"
            )
        self._join_ranks()
        self._ends.previous(self._save)
        gated, self._gate_next = self._gate_next, None
        save = self._save = StagedSave(state_dict)
        if gated is not None:
            gated.save = save
        tests = [(opt, opt.is_leased_export_buffer) for opt in self._ours]
        here = not (self.options.write_in_process and self._own_save and not self._waited)  # else: a writer process

        def exported_by(t: torch.Tensor) -> torch.optim.Optimizer | None:
            return next((opt for opt, test in tests if test(t)), None)

        filling = None
        try:
            self._exports.begin(save, fill_fresh=not self._waited)
            # the export's pooled buffers are passed through (to a writer process only those in shared memory: pickling
            # would move one leased before share_export_memory() there in place); in a waited save every tensor is
            shared = (lambda _: True) if here else (lambda t: local_tensor(t).is_shared())
            keep = (lambda _: True) if self._waited else (lambda t: exported_by(t) is not None and shared(t))
            save.host_dict, save.copied, filling = self._filler.begin(state_dict, keep, self._own_save, here)
            save.host_bytes = self._filler.save_bytes
            if filling is not None:  # the filler completes it as the save is written
                filling.add_done_callback(lambda _: save.filled.set_result(None))
            if self.options.refuse_non_finite:  # the host's part in the writer process, where it writes
                streams = self._check_streams
                save.finite = self._filler.finite_check(state_dict, save.host_dict, exported_by, streams, here)
                save.host_check = save.finite.left_to_writer
        except Exception as exc:  # noqa: BLE001  (this rank's refusal must reach every rank's agreement)
            save.host_dict = exc
        save.device = torch.cuda.current_device() if torch.cuda.is_initialized() else None  # the caller's GPU
        exports = self._exports if filling is None else None  # else the filler's fills complete the staging
        threading.Thread(
            target=complete_staging,
            args=(save, exports, self.options.check, self._group, gated is not None),
            name="optim-factory-staging",
            daemon=True,
        ).start()
        # gated: DCP plans now, from the tensors' metadata (a failed copy's rank plans its own dict, refused later)
        if gated is not None:
            save.staged.set_result(state_dict if isinstance(save.host_dict, Exception) else save.host_dict)
        return save.staged

    def synchronize_staging(self) -> None:
        self.wait_staged()  # the last staged save's copies and exports filled

    def close(self) -> None:
        """Wait for a save :meth:`async_save` started (its failure is its response's), give every buffer back and
        free the host copies (and a budget's kept buffers); the stager saves nothing more. A save started by
        ``dcp.async_save`` directly must have been waited for by its caller. Its own group is destroyed and let go:
        its threads end with the last reference, not in the interpreter's exit (where one can abort it)."""
        if self._closed:
            return
        self._ends.previous(self._save)
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        self._filler.close()
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group, self._own_group = None, False

    # ------------------------------------------------------------------ the save's lifecycle
    def save(self, state_dict: dict[str, Any], **dcp_kwargs: Any) -> Any:
        """``dcp.save``'s counterpart: the save :meth:`async_save` starts, waited for. Nothing is copied (nothing
        changes the state until it returns): DCP's writer reads the caller's tensors and the export's buffers as
        they are. The same refusals, agreed by every rank before anything is written, the same budget, the buffers
        given back once written. Returns DCP's ``Metadata``; raises :class:`SaveRefused` or DCP's write failure
        (``CheckpointException``)."""
        self._waited = True
        try:
            response = self.async_save(state_dict, **dcp_kwargs)
        finally:
            self._waited = False
        return response.upload_completion.result()

    def async_save(self, state_dict: dict[str, Any], **dcp_kwargs: Any) -> AsyncSaveResponse:
        """``dcp.async_save(state_dict, async_stager=self, **dcp_kwargs)`` on a writer thread (with
        ``write_in_process``: staged here, written by the rank's writer process), once the previous save is over
        (:meth:`stage` waits for it); without a ``planner`` of the caller's DCP plans it at once with its
        default planner, whose last step waits for the filled state and the ranks' verdict (docs/design.md); the
        export buffers go back when its write is done.
        Returns DCP's ``AsyncSaveResponse``: ``staging_completion`` once the copies and exports are filled (the
        next ``step()`` may run), ``upload_completion`` once written (it raises :class:`SaveRefused` or DCP's write
        failure). DCP's collectives run on the stager's gloo group unless ``process_group`` is given."""
        self._check_open()
        mine = sorted(FIELD_NAMES.intersection(dcp_kwargs))
        if mine:
            raise TypeError(
                f"AsyncSaveStager.{self._called}({mine[0]}=...): a StagerOptions field, not the save's; give it to "
                f"the stager: AsyncSaveStager(optimizers, StagerOptions({mine[0]}=...))"
            )
        self._join_ranks()
        if self._group is not None and dcp_kwargs.get("process_group") is None:
            dcp_kwargs["process_group"] = self._group  # DCP's collectives off the default group training uses
        if dcp_kwargs.get("checkpoint_id") is None and dcp_kwargs.get("storage_writer") is None:
            where = "give checkpoint_id= (or storage_writer=), where it writes"
            raise ValueError(f"AsyncSaveStager.{self._called}: {where}")
        # gated or not from the arguments alone, the same on every rank: DCP's default planner, made here
        dcp_kwargs, self._own_save = self._filler.save_kwargs(dcp_kwargs), True
        previous = self._save
        try:
            if self.options.write_in_process and not self._waited:
                written = self._hand_over(state_dict, dcp_kwargs)
            else:
                written = self._dcp_async_save(state_dict, dcp_kwargs).upload_completion
        except BaseException:
            if self._save is not previous:  # staged, never written: nothing reads its buffers
                self._ends.give_back(self._save)
            else:
                self.discard(state_dict)
            raise
        finally:
            self._gate_next, self._own_save = None, False
        save = self._save
        save.upload = Future()
        written.add_done_callback(lambda done: self._ends.uploaded(save, done))
        return AsyncSaveResponse(staging_completion=save.filled, upload_completion=save.upload)

    def _dcp_async_save(self, state_dict: dict[str, Any], dcp_kwargs: dict[str, Any]) -> AsyncSaveResponse:
        """DCP's ``async_save`` through this stager, written on DCP's thread; gated where ``GatedPlanner.for_save``
        says (every rank's planning ends at the verdict's gate)."""
        planner = GatedPlanner.for_save(self._group, dcp_kwargs)
        if planner is not None:
            self._gate_next = dcp_kwargs["planner"] = planner
        with self.exporting():  # DCP exports a Stateful optimizer inside
            return dcp.async_save(
                state_dict, async_stager=self, async_checkpointer_type=AsyncCheckpointerType.THREAD, **dcp_kwargs
            )

    def _hand_over(self, state_dict: dict[str, Any], dcp_kwargs: dict[str, Any]) -> Future:
        """``write_in_process``: the save staged here (its verdict agreed by every rank), then written by this
        rank's writer process (``_writer_process.py``). Returns the write's Future."""
        if self._writer is None:
            self._writer = WriterProcess(self._group)
        self._writer.check(dcp_kwargs)
        with self.exporting():  # a Stateful's export, as DCP's async_save makes it
            state_dict = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        staged = self.stage(state_dict)
        kwargs, asks = self._filler.for_writer_process(dcp_kwargs)  # a budget's planner asks for its fills here
        return self._writer.write(staged, kwargs, self._save.host_check, asks)

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """``with stager.exporting(): sd = get_state_dict(model, opt)``: the export of a save through this stager,
        the one block a checkpointer writes around it. A background export into pooled buffers (``defers``)
        returns unfilled, so that the next forward and backward overlap it; the staging's completion and the next
        ``step()`` wait for it. A background export into fresh memory returns unfilled too and is filled when the
        save is staged (in the save call); a failed background export refuses the save on every rank. An export
        within the host budget holds placeholders, filled as the save writes them. :meth:`async_save` exports a
        ``Stateful`` inside it itself (within the budget, deferred)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._filler.exporting())
            for opt, _ in self._exports.background:
                stack.enter_context(opt.deferred_state_dict())
            yield

    def discard(self, state_dict: dict[str, Any]) -> None:
        """Let go of an export made inside :meth:`exporting` that is not saved (a save whose DCP call raised before
        staging it does so itself): a background export is waited for (at most ``export_timeout_s``; its failure is
        taken, so that no ``step()`` raises it) and its pooled buffers are given back (not those of an export still
        unfilled)."""
        for opt in self._ours:
            failure = self._exports.wait(opt)  # a failure is taken: nothing of this export is saved
            if failure is None or not failure[1]:  # filled, or failed: its buffers go back
                opt.release_state_dict(state_dict)

    def wait_staged(self) -> None:
        """Block until the last staged save's copies are done and its exports filled; the next ``step()`` may run."""
        if self._save is not None:
            self._save.filled.result()

    def wait(self) -> None:
        """Block until the save in flight (started by :meth:`async_save`) is written and its buffers given back;
        raise its failure (:class:`SaveRefused`, or DCP's) in one line. Returns at once when none is in flight."""
        save = self._save
        if save is None or save.upload is None:
            return
        save.over.wait()
        failure = save.upload.exception()
        if isinstance(failure, SaveRefused):
            raise failure
        if failure is not None:
            raise RuntimeError(f"the async save failed: {first_line(failure, named=True)}") from failure

    @property
    def process_group(self) -> Any:
        """The gloo group the ranks agree on and :meth:`async_save` runs DCP's collectives on (``None`` on one process):
        ``process_group=`` of your own ``dcp.async_save(..., async_stager=self)``, else beside training's (a hang)."""
        self._join_ranks()
        return self._group

    @property
    def writer_pid(self) -> int | None:
        """The pid of this rank's writer process (``StagerOptions.write_in_process``): None until the first save is
        handed over to it (its staging agreed; :meth:`wait` returns after), after :meth:`close`, and without the
        option."""
        return None if self._writer is None else self._writer.pid

    @property
    def export_filled_later(self) -> bool:
        """Whether an export inside :meth:`exporting` returns before it is filled (a background export of one of its
        optimizers): the save fills it, and :attr:`export_filled_at` says when."""
        return bool(self._exports.background)

    @property
    def export_filled_at(self) -> float | None:
        """``time.perf_counter()`` when the last save's background export was filled (None where none was pending
        when it was staged): with the export call's start, how long the export took, deferred or not."""
        return self._exports.filled_at

    @property
    def budget_peak_bytes(self) -> int | None:
        return self._filler.budget_peak_bytes  # the most a budgeted save held at once; None without a budget

    @property
    def save_host_bytes(self) -> int | None:
        """The host memory the last save held at its peak: its copies and the export's buffers (within a budget:
        the most its fills and the copies made at its start held at once, known once it is over); else None."""
        return None if self._save is None else self._save.host_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies (and a budgeted save's buffers) kept for the next save (not the exports')."""
        return self._filler.kept_bytes

    # ------------------------------------------------------------------ inside
    @property
    def _called(self) -> str:
        """The method the caller called, for its refusals: ``save`` runs inside ``async_save``."""
        return "save" if self._waited else "async_save"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("AsyncSaveStager: closed; build a new one for further saves")

    def _join_ranks(self) -> None:
        """The stager's own gloo group over the default group's ranks, made once that group exists with more than
        one rank (at construction or at the first save: collective), unless ``process_group`` was given."""
        if self._group is None and not self._closed and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
            self._own_group = True
