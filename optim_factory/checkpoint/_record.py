"""One async save through ``AsyncSaveStager``: its record, from the staging to the buffers given back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optim_factory.errors import SaveRefused

if TYPE_CHECKING:
    from optim_factory.checkpoint._finite_check import FiniteCheck


@dataclass
class StagedSave:
    """One staged save: the caller's state dict (its export buffers go back once written), what its verdict reads
    (the staged dict, the wait for its copies, its finite check, the caller's GPU), its completions and upload."""

    state_dict: dict[str, Any]
    filled: Future = field(default_factory=Future)  # the copies are done and the exports filled (or failed)
    staged: Future = field(default_factory=Future)  # handed to DCP: the staged dict, or SaveRefused on every rank
    verdict: Future = field(default_factory=Future)  # this rank's refusal line, or None (GatedPlanner waits for it)
    refused: SaveRefused | None = None  # gated: the ranks' refusal, raised by the planning's last step
    upload: Future | None = None  # DCP's upload, when the save was started by AsyncSaveStager.async_save
    over: threading.Event = field(default_factory=threading.Event)  # written or failed, and its buffers given back
    stuck: bool = False  # an export did not fill in time: its buffers stay with it
    host_bytes: int | None = None  # the host memory it held at its peak, once it is over (the stager's)
    host_check: list | None = None  # the staged host tensors the writer process checks for NaN/inf before it writes
    # what the verdict reads (_verdict.py), set when the save is staged
    host_dict: Any = None  # the staged dict DCP's writer reads, or the exception that staging it raised
    copied: Callable[[], None] | None = None  # returns once its copies are complete
    finite: FiniteCheck | None = None  # its NaN/inf check (StagerOptions.refuse_non_finite)
    # the caller's GPU: a new thread's is 0, and its first CUDA call would create a context there
    device: int | None = None
