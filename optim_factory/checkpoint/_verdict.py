"""The completion of a save staged by ``AsyncSaveStager``, on a thread of its own (:func:`complete_staging`): this
rank's verdict (the GPU's finite check before ``step()`` can change what it reads, the copies, every background
export filled, the host's finite check, the options' ``check``), then every rank's (``_agreement.py``). It never
raises: a failure is the verdict, so that every rank reaches the agreement and a refusal is every rank's."""

from __future__ import annotations

from typing import Any

import torch

from optim_factory.checkpoint._agreement import agree
from optim_factory.checkpoint._export_waits import ExportNotFilled, ExportWaits
from optim_factory.checkpoint._options import Check
from optim_factory.checkpoint._record import StagedSave
from optim_factory.errors import SaveRefused, first_line

__all__ = ["complete_staging", "rank_verdict"]


def complete_staging(
    save: StagedSave, exports: ExportWaits | None, check: Check | None, group: Any, gated: bool
) -> None:
    """The staging's completion: this rank's verdict (:func:`rank_verdict`) in ``save.verdict``, then, unless
    ``gated`` (the ranks agree in DCP's planning, on its upload thread: ``GatedPlanner``), the ranks' agreement on
    ``group``: ``save.staged`` completes with the staged dict, or :class:`SaveRefused` on every rank."""
    failure = rank_verdict(save, exports, check)
    save.verdict.set_result(failure)
    if gated:
        return
    refusals = agree(failure, group)
    if refusals:
        save.staged.set_exception(SaveRefused(refusals))
    else:
        save.staged.set_result(save.host_dict)


def rank_verdict(save: StagedSave, exports: ExportWaits | None, check: Check | None) -> str | None:
    """This rank's refusal line of ``save``, or None. ``exports``: its background exports, waited for here and
    ``save.filled`` completed once they are (None: the filler's fills complete it); ``check``: the options' own."""
    finite = save.finite
    failure = on_device = None
    try:
        if isinstance(save.host_dict, Exception):
            raise save.host_dict
        if save.device is not None:
            torch.cuda.set_device(save.device)
        on_device = None if finite is None else finite.device_refusal()  # before step() changes what it reads
        save.copied()
        failure = None if exports is None else exports.failure(save)
    except BaseException as exc:  # noqa: BLE001  (one rank's failure must reach the agreement, not end it)
        failure = str(exc) if isinstance(exc, ExportNotFilled) else first_line(exc, named=True)
    finally:
        if exports is not None:
            save.filled.set_result(None)
    try:
        if finite is not None:  # the check ends here, whatever the verdict so far
            failure = finite.refusal(on_device, earlier=failure)
        if failure is None and check is not None:
            failure = check(save.host_dict)
        if failure is not None and not isinstance(failure, str):
            failure = f"AsyncSaveStager's check returned {failure!r}: a refusal line (str) or None saves"
    except BaseException as exc:  # noqa: BLE001
        failure = first_line(exc, named=True)
    return failure
