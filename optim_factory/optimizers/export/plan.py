"""An export, one object's plan: :class:`ExportPlan` builds what ``optimizer.state_dict()`` returns, deciding for
each state from one :class:`ExportOptions` how it is exported. See docs/design.md, "The export contract" and
"Streaming".

It works on any optimizer with Transformer Engine's FusedAdam state API (``get_unscaled_state``,
``name_to_dtype_map``): TE's own class and :class:`~optim_factory.PortableFusedAdam`.

* ``cpu_offload=False``: exactly TE's ``FusedAdam.state_dict()``: every state converted to FP32 (int16 for
  remainder masters) on the state's device, DTensor states re-wrapped as DTensors. FP32 states alias the live
  state, as in TE.
* ``cpu_offload=True``: the same keys, names, dtypes and bitwise-equal values, but each state is converted,
  wrapped as a DTensor *on the parameter's device*, copied to CPU, and its device temporary dropped before the
  next state is converted. At most one converted state lives on the accelerator at a time. Exported tensors
  never alias live state, and tensors in ``param_groups`` (a capturable ``lr``, ``step``) are exported as CPU
  copies; the live ``param_groups`` keep their objects and devices.
* ``keep_bf16``: BF16 states are exported as BF16 (the stored values, bitwise) instead of FP32, in every mode;
  everything else as above.
* ``cpu_offload=True`` with ``chunk_bytes``: the same result, bitwise, streamed in chunks by the optimizer's
  :class:`~optim_factory.optimizers.export.stream.StateExporter` (the accelerator holds at most two chunks).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.export.contract import param_index_map
from optim_factory.optimizers.export.host_memory import Slot, host_empty
from optim_factory.optimizers.export.options import ExportOptions
from optim_factory.optimizers.export.stream import StateExporter, StreamItem
from optim_factory.optimizers.export.tensors import aliases, local_tensor, wrap_host_local, wrap_like

__all__ = ["ExportPlan", "export_state"]

_CPU = torch.device("cpu")


def _to_cpu_copy(t: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """A CPU tensor (or DTensor with a CPU local tensor) that never aliases ``live``."""
    if t.device.type != "cpu":
        return t.to(_CPU)
    if live is not None and (local_tensor(t).numel() == 0 or aliases(t, live)):
        return t.clone()
    return t


def _export_group_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(_CPU, copy=True)
    return value


def _fp8_torch_dtype(te_fp8_dtype: Any) -> torch.dtype:
    name = str(getattr(te_fp8_dtype, "name", te_fp8_dtype)).lower()  # an IntEnum: str() is its number
    if "e5m2" in name:
        return torch.float8_e5m2
    if "e4m3" in name:
        return torch.float8_e4m3fn
    raise RuntimeError(f"unknown FP8 format {te_fp8_dtype!r}")


def _state_source(
    optimizer: Any, param: torch.Tensor, name: str, stored: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The raw local storage of one state (flat) and the FP32 factor that unscales it, or ``None`` when the
    state cannot be streamed element by element (non-contiguous storage). ``stored``: the state's local tensor.

    This reads the optimizers' storage as TE 2.20's ``get_unscaled_state`` does (TE's ``Float8Tensor`` data and
    ``_scale_inv``, the per-state ``_scales`` of FP16 states), so that each chunk is converted with the same
    arithmetic: see docs/design.md, "Streaming".
    """
    data = getattr(stored, "_data", None)
    if data is not None and hasattr(stored, "_scale_inv"):
        # TE's Float8Tensor: its float() is E4M3 -> FP32 times scale_inv, element by element
        source, scale = data.view(_fp8_torch_dtype(stored._fp8_dtype)), stored._scale_inv
    elif optimizer.name_to_dtype_map[name] in (torch.float16, torch.uint8):
        source, scale = stored, optimizer._scales[param][name]  # FP16 (both backends), FP8 (portable)
    else:
        source, scale = stored, None  # FP32, int16 remainders (copied as they are), BF16 (widened)
    if not source.is_contiguous():
        return None
    return source.reshape(-1), scale


class ExportPlan:
    """One export of an optimizer's states as ``options`` say, with ``exporter``'s pool and threads.

    Per state: streamed in chunks (:meth:`item`: a chunked export, an optimizer state tensor with contiguous
    storage) into a pooled host buffer (``reuse_buffers``) or fresh host memory, filled by ``exporter`` (on its
    background thread with ``background``); otherwise exported whole (:meth:`whole`). Either way a BF16 state
    stays BF16 with ``keep_bf16``. The optimizer makes one per export from the options and the exporter it
    owns; :meth:`start_threads` and :meth:`prepare` get the exporter ready for the exports these options make.
    Without an exporter (``export_state``) a chunked export uses a temporary one; reused buffers and a background
    export need the optimizer's own (a ``ValueError``).
    """

    def __init__(self, options: ExportOptions, exporter: StateExporter | None = None) -> None:
        self.options = options
        self.exporter = exporter

    def export(self, optimizer: Any, unfilled: list[StreamItem] | None = None) -> dict[str, Any]:
        """``{"state": {index: {name: tensor}}, "param_groups": [...]}`` like ``torch.optim.Optimizer``, exported
        (see the module docstring for the contract). ``unfilled``: the streamed states' items are appended to it
        and not streamed, each state a meta tensor in the dictionary (any reader fails loudly): the caller streams
        each into memory of its own (a save within a host budget, ``optim_factory.checkpoint``)."""
        o = self.options
        if (o.reuse_buffers or o.background) and self.exporter is None:
            raise ValueError(
                "reuse_buffers or background: needs the optimizer's own exporter (it owns the buffer pool)"
            )
        if o.chunk_bytes and self.exporter is None:
            with StateExporter() as temporary:  # its threads end with this export
                return ExportPlan(o, temporary).export(optimizer)
        state_dict = torch.optim.Optimizer.state_dict(optimizer)
        id_map = param_index_map(optimizer, state_dict["param_groups"])
        if o.chunk_bytes:
            self.exporter.pool.wait_preparation()  # never race a background prepare for the same slots
        streamed: list[StreamItem] = []
        for key, packed in state_dict["state"].items():
            param = id_map.get(key)
            if param is None:
                continue
            exported = {}
            for name in packed:
                item = self.item(optimizer, param, key, name, unfilled is not None) if o.chunk_bytes else None
                if item is not None:
                    streamed.append(item)
                exported[name] = self.whole(optimizer, param, name) if item is None else item.result
            state_dict["state"][key] = exported
        if unfilled is not None:
            unfilled.extend(streamed)
        elif streamed and o.background:
            self.exporter.stream_background(streamed, o.chunk_bytes)
        elif streamed:
            self.exporter.stream(streamed, o.chunk_bytes)
        if o.cpu_offload:
            state_dict["param_groups"] = [
                {k: (v if k in ("params", "param_names") else _export_group_value(v)) for k, v in g.items()}
                for g in state_dict["param_groups"]
            ]
        return state_dict

    def whole(self, optimizer: Any, param: torch.Tensor, name: str) -> Any:
        """One state of ``param`` exported whole: converted as TE's ``get_unscaled_state`` does (kept BF16 with
        ``keep_bf16``), wrapped like a DTensor parameter, copied to CPU with ``cpu_offload``."""
        live = optimizer.state[param][name]
        if name not in optimizer.name_to_dtype_map or not isinstance(live, torch.Tensor):
            # Not one of FusedAdam's states (e.g. added by a user): passed through, copied when offloading.
            if self.options.cpu_offload and isinstance(live, torch.Tensor):
                return _to_cpu_copy(live, live)
            return live
        if self.options.keep_bf16 and optimizer.name_to_dtype_map[name] == torch.bfloat16:
            converted = local_tensor(live)  # the stored BF16 tensor (aliases live state, as TE's FP32 states do)
        else:
            converted = optimizer.get_unscaled_state(param, name)  # FP32 (int16 remainders), local, param's device
        if isinstance(param, DTensor):
            converted = wrap_like(converted, param)  # on the parameter's device, before any copy
        if not self.options.cpu_offload:
            return converted
        return _to_cpu_copy(converted, live)

    def slot(self, optimizer: Any, param: torch.Tensor, key: Any, name: str) -> tuple[torch.Tensor, Any, Slot] | None:
        """Source, scale and pool slot of a state that streams; ``None``: it does not (not an optimizer state
        tensor, or not contiguous) and is exported whole."""
        live = optimizer.state[param][name]
        if name not in optimizer.name_to_dtype_map or not isinstance(live, torch.Tensor):
            return None
        stored = local_tensor(live)
        found = _state_source(optimizer, param, name, stored)
        if found is None:
            return None
        source, scale = found
        bf16 = source.dtype == torch.bfloat16 and scale is None
        kept = source.dtype == torch.int16 or (self.options.keep_bf16 and bf16)
        dtype = source.dtype if kept else torch.float32  # int16 remainders, kept BF16: copied as they are
        pinning = self.options.pinning_on(source.device.type)
        return source, scale, Slot((key, name), tuple(stored.shape), dtype, pinning)

    def item(self, optimizer: Any, param: torch.Tensor, key: Any, name: str, meta: bool = False) -> StreamItem | None:
        """The streaming plan for one state, with its host destination (``meta``: a meta tensor in its place, for a
        caller that streams into memory of its own); ``None``: export it whole."""
        found = self.slot(optimizer, param, key, name)
        if found is None:
            return None
        source, scale, slot = found
        # CUDA: pinned destinations are copied into directly, pageable ones through the pinned staging buffers.
        # CPU: reused destinations directly, fresh ones staged (the same steps, so CPU tests cover both paths).
        if meta:
            dst, staged = torch.empty(slot.shape, dtype=slot.dtype, device="meta"), True
        elif self.options.reuse_buffers:
            dst = self.exporter.pool.take(slot)
            staged = source.device.type == "cuda" and not self.exporter.pool.is_pinned(dst)
        else:
            dst, staged = host_empty(torch.Size(slot.shape), slot.dtype), True
        result = wrap_host_local(dst, param) if isinstance(param, DTensor) else dst
        return StreamItem(source, scale, dst, result, staged)

    def start_threads(self, devices: set[torch.device]) -> None:
        """For a chunked export: start the exporter's unstaging threads now, one set per device of ``devices``
        that stages (CUDA; CPU without reuse: reused CPU buffers are copied into directly, see :meth:`item`), so
        that no export waits for them; any other export: none."""
        o = self.options
        if not (o.cpu_offload and o.chunk_bytes):
            return  # nothing streams: no thread is needed
        staging = [d for d in devices if d.type == "cuda" or (d.type == "cpu" and not o.reuse_buffers)]
        for device in sorted(staging, key=str):
            self.exporter.unstage_workers(device)

    def prepare(self, optimizer: Any, params: dict[Any, torch.Tensor]) -> Future:
        """Get a ready pooled buffer for every state of ``params`` (packed index -> parameter) that streams, in the
        background (see :meth:`HostBufferPool.prepare`)."""
        slots = []
        for key, param in params.items():
            for name in optimizer.state.get(param, {}):
                found = self.slot(optimizer, param, key, name)
                if found is not None:
                    slots.append(found[2])
        return self.exporter.pool.prepare(slots)


def export_state(optimizer: Any, *, cpu_offload: bool, chunk_bytes: int = 0, keep_bf16: bool = False) -> dict[str, Any]:
    """Build the state dict of a FusedAdam-like optimizer (see the module docstring for the contract): an
    :class:`ExportPlan` of the :class:`ExportOptions` these arguments name, into fresh memory (a chunked export
    streams through a temporary :class:`StateExporter`).

    Args:
        optimizer: TE's FusedAdam (or a subclass) or :class:`~optim_factory.PortableFusedAdam`.
        cpu_offload: export to CPU: one state at a time (``chunk_bytes=0``), or streamed in chunks.
        chunk_bytes: with ``cpu_offload``, stream in chunks of at most this many bytes of converted output.
        keep_bf16: export BF16 states as they are stored (BF16) instead of converting them to FP32.

    Returns:
        ``{"state": {index: {name: tensor}}, "param_groups": [...]}`` like ``torch.optim.Optimizer``.
    """
    chunk = chunk_bytes if cpu_offload else None  # 0 for an export that stays on the device
    return ExportPlan(ExportOptions(cpu_offload, chunk, keep_bf16=keep_bf16)).export(optimizer)
