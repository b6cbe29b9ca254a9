"""The NaN/inf check of an async save (``StagerOptions(refuse_non_finite=True)``): each floating-point tensor the
save writes is read where it lives, so that a GPU state is read on the GPU, not on the host. See docs/design.md,
"The async-save stager".

A plain CUDA tensor (not a subclass such as TE's ``Float8Tensor``, whose reduction would dequantize it into a
temporary) is reduced on the GPU (``all_finite``: its min and max, one sync per device) on a high-priority side
stream that waits for the caller's work queued before the save, before the staging completes: the next ``step()``
changes it. The pooled export buffers of an optimizer whose states are all plain CUDA tensors of at least two bytes
per value are checked through those states (the export copies them, widens BF16/FP16 ones and scales FP16 ones as
``step()`` reads them: a NaN or inf in one is one in the other, except an FP16 value scaled past FP32's largest,
which no Adam step stores). Any other tensor is checked on the host once staged (the copy, or the filled export,
where FP8 states are widened): by the stager's thread, or, with ``StagerOptions(write_in_process=True)``, by the
writer process before it writes (:func:`host_refusal`; the writer processes agree on it). ``all_finite`` does not
read one-byte tensors: an FP8 model tensor is not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from optim_factory.errors import first_line
from optim_factory.optimizers.export import all_finite, local_tensor
from optim_factory.tree import leaves, local_tensors

__all__ = ["NON_FINITE_LINE", "FiniteCheck", "host_refusal"]

NON_FINITE_LINE = "the model or optimizer state holds non-finite values (NaN/inf)"
"""The refusal of a save whose state holds NaN or inf."""


class FiniteCheck:
    """One save's check, planned on the caller's thread when the save is staged (the tensors to read, the point
    of each CUDA stream they are final at), run on the stager's completion thread: :meth:`device_refusal` before the
    staging completes, :meth:`refusal` after, which ends it."""

    def __init__(
        self,
        sources: Any,
        staged: Any,
        exported_by: Callable[[torch.Tensor], torch.optim.Optimizer | None],
        streams: dict[torch.device, Any] | None = None,
        host_here: bool = True,
    ) -> None:
        """``sources``: the state dict the caller saves; ``staged``: its host copy (the same structure, export
        buffers passed through); ``exported_by``: the optimizer a tensor is a pooled export buffer of, else None;
        ``streams``: the caller's side stream per device, kept from save to save (made here when missing: torch
        hands streams out of a small shared pool, round-robin, so a stream drawn per save would cycle through the
        streams other work, e.g. FSDP2's, drew from it); ``host_here=False``: :attr:`host`, the staged tensors
        read on the host, is left to the writer process (:func:`host_refusal`), :meth:`refusal` reads the GPU's."""
        self._streams = {} if streams is None else streams
        self._host_here = host_here
        self.device: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self._staged = staged  # what is written, searched for the tensor a refusal names
        exports: dict[int, tuple[torch.optim.Optimizer, list[torch.Tensor]]] = {}
        for source, copy in zip(local_tensors(sources), local_tensors(staged), strict=True):
            owner = exported_by(source)
            if owner is not None:
                exports.setdefault(id(owner), (owner, []))[1].append(copy)
            elif _on_gpu(source):
                self.device.append(source)
            else:
                self.host.append(copy)
        for optimizer, buffers in exports.values():
            states = list(local_tensors(list(optimizer.state.values())))  # each state's local tensor
            if states and all(_on_gpu(t) and t.element_size() > 1 for t in states):
                self.device += states
            else:
                self.host += buffers
        self._ready = {d: torch.cuda.current_stream(d).record_event() for d in {t.device for t in self.device}}
        # the host tensors the writer process checks before it writes (host_refusal); None: checked here
        self.left_to_writer: list[torch.Tensor] | None = None if host_here else self.host

    def on_device(self) -> bool:
        """Whether every CUDA tensor of the save is finite (blocks until the GPU has read them; then drops them)."""
        try:
            for device, ready in self._ready.items():
                side = self._streams.get(device)
                if side is None:  # high priority: its blocks before those of the training kernels queued meanwhile
                    side = self._streams[device] = torch.cuda.Stream(device, priority=-1)
                side.wait_event(ready)
                with torch.cuda.stream(side):
                    if not all_finite(t for t in self.device if t.device == device):
                        return False
            return True
        finally:
            self.device, self._ready = [], {}

    def device_refusal(self) -> str | None:
        """:meth:`on_device` as a verdict, before the staging completes: :data:`NON_FINITE_LINE`, a line saying the
        check failed (the caller still waits for the copies and exports), or None."""
        try:
            return None if self.on_device() else NON_FINITE_LINE
        except Exception as exc:  # noqa: BLE001
            return f"the finite check failed: {first_line(exc, named=True)}"

    def on_host(self) -> bool:
        """Whether every host tensor of the save is finite (the staged copies and filled exports)."""
        return all_finite(self.host)

    def refusal(self, on_device: str | None, earlier: str | None = None) -> str | None:
        """The save's verdict once staged, from :meth:`device_refusal`'s and the host's check (unless left to the
        writer process): None when every value is finite; a NaN/inf refusal names the first staged tensor that
        holds one (its keys joined by dots). ``earlier``: the save's refusal so far (a failed copy or export),
        returned as it is without reading the host. The check is over: its references are dropped, whatever it
        returns or raises (the CUDA tensors stay alive until :meth:`on_device` has read them)."""
        try:
            if earlier is not None:
                return earlier
            if on_device is None:
                return host_refusal(self.host, self._staged) if self._host_here else None
            if on_device != NON_FINITE_LINE:
                return on_device
            return _named(self._staged)
        finally:
            self.device, self.host, self._ready, self._staged, self.left_to_writer = [], [], {}, None, None


def host_refusal(host: list[torch.Tensor], staged: Any) -> str | None:
    """The host's part of the check: None when every tensor of ``host`` is finite, else the refusal naming the
    first tensor of ``staged`` (the save, whose tensors ``host`` are) that holds a NaN or inf."""
    return None if all_finite(host) else _named(staged)


def _named(staged: Any) -> str:
    where = next((".".join(map(str, path)) for path, t in _tensors(staged) if not all_finite([t])), None)
    return NON_FINITE_LINE if where is None else f"{NON_FINITE_LINE}: {where}"


def _on_gpu(t: torch.Tensor) -> bool:
    """A plain CUDA tensor (or parameter), which ``all_finite`` reduces without a temporary of its size."""
    return t.is_cuda and type(t) in (torch.Tensor, torch.nn.Parameter)


def _tensors(tree: Any) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, local tensor) of every tensor of ``tree``."""
    for path, v in leaves(tree):
        if isinstance(v, torch.Tensor):
            yield path, local_tensor(v)
