"""The completion of a save staged by ``AsyncSaveStager``, on a thread of its own (:func:`complete_staging`): this
rank's verdict (the GPU's finite check before ``step()`` can change what it reads, the copies, every background
export filled, the host's finite check, the options' ``check``), then every rank's (``_agreement.py``). It never
raises: a failure is the verdict, so that every rank reaches the agreement and a refusal is every rank's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from optim_factory.checkpoint._agreement import agree
from optim_factory.checkpoint._export_waits import ExportNotFilled, ExportWaits
from optim_factory.checkpoint._finite_check import FiniteCheck
from optim_factory.checkpoint._options import Check
from optim_factory.checkpoint._record import StagedSave
from optim_factory.errors import SaveRefused, first_line

__all__ = ["Staging", "complete_staging", "rank_verdict"]


@dataclass
class Staging:
    """What one save's verdict reads: ``staged``, the staged dict (or the exception that staging it raised);
    ``copied``, which waits for its copies; ``finite``, its NaN/inf check; ``device``, the caller's GPU (a new
    thread's is 0, and its first CUDA call would create a context there); ``exports``, its background exports,
    waited for here and ``save.filled`` completed once they are (None: the filler's fills complete it); ``check``,
    the options' own."""

    staged: Any
    copied: Callable[[], None] | None
    finite: FiniteCheck | None
    device: int | None
    exports: ExportWaits | None
    check: Check | None


def complete_staging(save: StagedSave, staging: Staging, group: Any, gated: bool) -> None:
    """The staging's completion: this rank's verdict (:func:`rank_verdict`) in ``save.verdict``, then, unless
    ``gated`` (the gate agrees, on DCP's upload thread: ``GatedPlanner``), the ranks' agreement on ``group``:
    ``save.staged`` completes with the staged dict, or :class:`SaveRefused` on every rank."""
    failure = rank_verdict(save, staging)
    save.verdict.set_result(failure)
    if gated:
        return
    refusals = agree(failure, group)
    if refusals:
        save.staged.set_exception(SaveRefused(refusals))
    else:
        save.staged.set_result(staging.staged)


def rank_verdict(save: StagedSave, staging: Staging) -> str | None:
    """This rank's refusal line of ``save``, or None."""
    finite, exports = staging.finite, staging.exports
    failure = on_device = None
    try:
        if isinstance(staging.staged, Exception):
            raise staging.staged
        if staging.device is not None:
            torch.cuda.set_device(staging.device)
        on_device = None if finite is None else finite.device_refusal()  # before step() changes what it reads
        staging.copied()
        failure = None if exports is None else exports.failure(save)
    except BaseException as exc:  # noqa: BLE001  (one rank's failure must reach the agreement, not end it)
        failure = str(exc) if isinstance(exc, ExportNotFilled) else first_line(exc, named=True)
    finally:
        if exports is not None:
            save.filled.set_result(None)
    try:
        if failure is None and finite is not None:
            failure = finite.refusal(on_device)
        if failure is None and staging.check is not None:
            failure = staging.check(staging.staged)
        if failure is not None and not isinstance(failure, str):
            failure = f"AsyncSaveStager's check returned {failure!r}: a refusal line (str) or None saves"
    except BaseException as exc:  # noqa: BLE001
        failure = first_line(exc, named=True)
    finally:
        if finite is not None:
            finite.release()
    return failure
