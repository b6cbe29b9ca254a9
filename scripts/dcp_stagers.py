"""DCP's ``DefaultStager`` as ``scripts.bench_save`` keeps it across saves, on any torch it runs on.

torch >= 2.13's ``DefaultStager`` serves save after save: its deep-copier keeps the host storages it allocated (and
pinned) for the tensors it staged, and the next save copies into them. torch 2.11's closes that copier at the end
of every staging (``self._state_dict_stager.close()`` in ``DefaultStager._stage``): the cached storages are dropped
and the copier's dispatch table is cleared, so the second save fails with ``KeyError: <class 'type'>``
(pytorch/pytorch#183413). :class:`KeptStager` is 2.13's staging on such a torch: the same copies, without that
close, so one stager serves every save as it does for users of torch >= 2.13 (what torchtitan's
``async_with_pinned_mem`` keeps across saves). Its ``close()`` is ``DefaultStager``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

__all__ = ["KeptStager", "stager_reusable", "EMULATION"]

EMULATION = (
    "torch 2.13's, emulated: this torch's DefaultStager closes its deep-copier after every staging "
    "(pytorch/pytorch#183413), so the bench's KeptStager (scripts/dcp_stagers.py) stages as 2.13 does, the same "
    "copies without that close"
)
"""How the results name a stager kept across saves on a torch whose own stager serves one save."""


class KeptStager(DefaultStager):
    """``DefaultStager`` whose staging is torch 2.13's ``DefaultStager._stage``: copy (on the staging stream with
    non-blocking copies), wait for the copies, and keep the deep-copier and its cached host storages."""

    def _stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        copier, stream = self._state_dict_stager, self._staging_stream
        if not self._config.use_non_blocking_copy:
            return copier.stage(state_dict, non_blocking=False)
        if stream is None:  # synchronous staging: the copies on the current stream
            staged = copier.stage(state_dict, non_blocking=True)
            torch.accelerator.synchronize()
            return staged
        with stream:
            staged = copier.stage(state_dict, non_blocking=True)
        stream.synchronize()
        return staged


def stager_reusable(cls: type[DefaultStager] = DefaultStager) -> bool:
    """Whether one ``cls`` serves more than one save: tried on a small CPU state dict with the public API (a class
    object among its values, as torchtitan's and our optimizers' state dicts hold dtypes and configs). torch
    2.11's ``DefaultStager`` fails the second with ``KeyError: <class 'type'>``."""
    stager = cls(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"step": 1, "t": torch.zeros(4), "opt": {"lr": 0.1, "dtype": torch.float32, "cls": int}})
        return True
    except KeyError:
        return False
    finally:
        stager.close()
