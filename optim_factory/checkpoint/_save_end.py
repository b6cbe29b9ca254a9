"""The end of a save through ``AsyncSaveStager``: its buffers given back once it is written or failed (the filler's
end, each optimizer's export released), and its upload's outcome completed after that, so that a caller who waited
for ``upload_completion`` finds the buffers back."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from optim_factory.checkpoint._budget_rule import one_line_refusal
from optim_factory.checkpoint._record import StagedSave
from optim_factory.errors import first_line

__all__ = ["SaveEnd"]


class SaveEnd:
    """The stager's part that ends its saves: ``filler`` (the part that gave the save its host tensors) and
    ``optimizers`` (ours, whose exports the saves hold)."""

    def __init__(self, filler: Any, optimizers: list[Any]) -> None:
        self._filler, self._optimizers = filler, optimizers

    def previous(self, save: StagedSave | None) -> None:
        """The previous save over before the next is staged: waited for (an ``async_save``'s), else its buffers given
        back (one started by ``dcp.async_save`` directly, whose caller has waited for it)."""
        if save is None:
            return
        if save.upload is not None:
            save.over.wait()
        elif save.staged.done():
            self.give_back(save)

    def uploaded(self, save: StagedSave, done: Future) -> None:
        """DCP's upload is over (a gated one may fail in planning, before the fill): once this rank's verdict is in,
        the buffers go back (not those of an export that never filled), then ``upload_completion`` completes with
        DCP's outcome (a gated refusal as :class:`SaveRefused`, not the ``CheckpointException`` DCP wraps it in)."""
        save.verdict.add_done_callback(lambda _: self._upload_over(save, done))

    def _upload_over(self, save: StagedSave, done: Future) -> None:
        try:
            self.give_back(save)
            returned = None
        except Exception as exc:  # noqa: BLE001  (a callback's exception would be lost: the save's failure instead)
            returned = RuntimeError(f"giving the save's buffers back failed: {first_line(exc, named=True)}")
        failure = done.exception() or returned
        if isinstance(failure, CheckpointException):  # a budget's refusal as its one line
            failure = one_line_refusal(failure)
        if failure is None:
            save.upload.set_result(done.result())
        else:
            save.upload.set_exception(save.refused or failure)

    def give_back(self, save: StagedSave) -> None:
        """The save's buffers back, once (``save.over`` is set even where giving them back failed: a waiter never
        waits for it); an export that never filled keeps its buffers."""
        if save.over.is_set():
            return
        try:
            self._filler.end()
            save.host_bytes = self._filler.save_bytes
            if not save.stuck:
                for opt in self._optimizers:
                    opt.release_state_dict(save.state_dict)
        finally:  # a waiter never waits for a save whose return failed
            save.over.set()
