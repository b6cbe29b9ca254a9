"""The export path shared by both FusedAdam backends.

``export_state`` builds what ``optimizer.state_dict()`` returns; ``load_exported_state`` is its inverse.
Both work on any optimizer with Transformer Engine's FusedAdam state API (``get_unscaled_state``,
``set_scaled_state``, ``name_to_dtype_map``, ``store_param_remainders``): TE's own class and
:class:`~optim_factory.PortableFusedAdam`.

The export contract (see DESIGN.md):

* ``cpu_offload=False``: exactly TE's ``FusedAdam.state_dict()``: every state converted to FP32 (int16 for
  remainder masters) on the state's device, DTensor states re-wrapped as DTensors. FP32 states alias the live
  state, as in TE.
* ``cpu_offload=True``: the same keys, names, dtypes and bitwise-equal values, but each state is converted,
  wrapped as a DTensor *on the parameter's device* (``DTensor.from_local`` would move a CPU local tensor back
  to a CUDA mesh's device), copied to CPU, and its device temporary dropped before the next state is
  converted. At most one converted state lives on the accelerator at a time. Exported tensors never alias
  live state, and tensors in ``param_groups`` (a capturable ``lr``, ``step``) are exported as CPU copies;
  the live ``param_groups`` keep their objects and devices.
* ``cpu_offload=True`` with ``chunk_bytes``: the same result, bitwise, built by streaming (see
  :class:`HostExporter`): every state is converted in pieces of at most ``chunk_bytes`` of output, into two
  reusable device buffers, so the accelerator never holds more than two chunks of converted data whatever the
  tensor sizes. Conversion runs on the current stream, device-to-host copies on a side stream, ordered by
  events; host destinations are either fresh pageable tensors (huge pages) filled through two pinned staging
  buffers, or (``reuse_buffers``) tensors from a :class:`HostBufferPool`, handed back by
  :func:`release_exported_state` once nothing reads them any more and then pinned in place in the background,
  so that later exports copy into them directly (``OffloadedStateDict.prepare_state_dict`` readies them
  before the first export).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "export_state",
    "load_exported_state",
    "release_exported_state",
    "is_leased_export_buffer",
    "check_offload_options",
    "HostExporter",
    "OffloadedStateDict",
    "MIN_CHUNK_BYTES",
    "param_index_map",
    "join_bf16_remainder",
    "split_bf16_remainder",
    "local_tensor",
    "wrap_host_local",
]

_CPU = torch.device("cpu")


def param_index_map(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> dict[Any, torch.Tensor]:
    """Map the parameter ids of a packed state dict (``saved_groups``) to the live parameters."""
    return dict(
        zip(
            chain.from_iterable(g["params"] for g in saved_groups),
            chain.from_iterable(g["params"] for g in optimizer.param_groups),
            strict=True,
        )
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = local_tensor(a), local_tensor(b)
    if a.numel() == 0 or b.numel() == 0:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _wrap_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Wrap ``local`` as a DTensor with ``param``'s mesh, placements, global shape and stride."""
    return DTensor.from_local(
        local,
        device_mesh=param.device_mesh,
        placements=param.placements,
        run_check=False,
        shape=param.size(),
        stride=param.stride(),
    )


def _to_cpu_copy(t: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """A CPU tensor (or DTensor with a CPU local tensor) that never aliases ``live``."""
    if t.device.type != "cpu":
        return t.to(_CPU)
    if live is not None and (local_tensor(t).numel() == 0 or _aliases(t, live)):
        return t.clone()
    return t


def _export_one(optimizer: Any, param: torch.Tensor, name: str, live: Any, cpu_offload: bool) -> Any:
    """Export a single optimizer state of ``param``."""
    if name not in optimizer.name_to_dtype_map or not isinstance(live, torch.Tensor):
        # Not one of FusedAdam's states (e.g. added by a user): passed through, copied when offloading.
        if cpu_offload and isinstance(live, torch.Tensor):
            return _to_cpu_copy(live, live)
        return live
    converted = optimizer.get_unscaled_state(param, name)  # FP32 (int16 remainders), local, param's device
    if isinstance(param, DTensor):
        converted = _wrap_like(converted, param)  # on the parameter's device, before any copy
    if not cpu_offload:
        return converted
    return _to_cpu_copy(converted, live)


def _export_group_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(_CPU, copy=True)
    return value


def export_state(
    optimizer: Any, *, cpu_offload: bool, chunk_bytes: int | None = None, reuse_buffers: bool = False
) -> dict[str, Any]:
    """Build the state dict of a FusedAdam-like optimizer (see the module docstring for the contract).

    Args:
        optimizer: TE's FusedAdam (or a subclass) or :class:`~optim_factory.PortableFusedAdam`.
        cpu_offload: export to CPU: one state at a time, or streamed in chunks with ``chunk_bytes``.
        chunk_bytes: with ``cpu_offload``, stream in chunks of at most this many bytes of converted output.
        reuse_buffers: with ``chunk_bytes``, take host destinations from the optimizer's pool (pinned when the
            states are on CUDA); :func:`release_exported_state` gives them back.

    Returns:
        ``{"state": {index: {name: tensor}}, "param_groups": [...]}`` like ``torch.optim.Optimizer``.
    """
    check_offload_options(cpu_offload, chunk_bytes, reuse_buffers)
    state_dict = torch.optim.Optimizer.state_dict(optimizer)
    id_map = param_index_map(optimizer, state_dict["param_groups"])
    exporter = HostExporter.of(optimizer) if chunk_bytes is not None else None
    if exporter is not None:
        exporter.pool.wait_preparation()  # never race a background prepare for the same slots
    streamed: list[_Item] = []
    for key, packed in state_dict["state"].items():
        param = id_map.get(key)
        if param is None:
            continue
        live_state = optimizer.state[param]
        exported = {}
        for name in packed:
            live = live_state[name]
            item = exporter.item(optimizer, param, key, name, reuse_buffers) if exporter is not None else None
            if item is not None:
                streamed.append(item)
                exported[name] = item.result
            else:
                exported[name] = _export_one(optimizer, param, name, live, cpu_offload)
        state_dict["state"][key] = exported
    if streamed:
        exporter.stream(streamed, chunk_bytes)
    if cpu_offload:
        state_dict["param_groups"] = [
            {k: (v if k in ("params", "param_names") else _export_group_value(v)) for k, v in g.items()}
            for g in state_dict["param_groups"]
        ]
    return state_dict


MIN_CHUNK_BYTES = 64  # one aligned piece; real budgets are MiBs (the configs default to 64 MiB)
_ALIGN = 64  # byte offset alignment of the pieces packed into one chunk


def check_offload_options(cpu_offload: Any, chunk_bytes: Any, reuse_buffers: Any) -> None:
    """Raise ``ValueError`` (one line) for an impossible combination of the export options."""
    if not isinstance(cpu_offload, bool):
        raise ValueError(f"state_dict_cpu_offload={cpu_offload!r}: expected True or False")
    if chunk_bytes is not None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(
                f"state_dict_offload_chunk_bytes={chunk_bytes!r}: expected None (one state at a time) "
                f"or an int >= {MIN_CHUNK_BYTES} (bytes of converted data per chunk, e.g. 64 MiB = {64 << 20})"
            )
        if not cpu_offload:
            raise ValueError(
                f"state_dict_offload_chunk_bytes={chunk_bytes}: needs state_dict_cpu_offload=True "
                "(chunked streaming is a mode of the CPU-offloaded export)"
            )
    if not isinstance(reuse_buffers, bool):
        raise ValueError(f"state_dict_offload_reuse_buffers={reuse_buffers!r}: expected True or False")
    if reuse_buffers and chunk_bytes is None:
        raise ValueError(
            "state_dict_offload_reuse_buffers=True: needs state_dict_offload_chunk_bytes "
            "(reusable host buffers belong to the chunked export)"
        )


def release_exported_state(optimizer: Any, state_dict: Any) -> int:
    """Give the pooled host buffers of an exported ``state_dict`` back for reuse; return how many.

    Any nested structure works (the optimizer's own ``state_dict()`` or DCP's flattened one). Call it only
    when nothing reads those tensors any more (after the checkpoint that holds them is written): the next
    ``state_dict()`` overwrites them. Tensors that are not pooled export buffers are ignored; without a call
    the buffers are simply freed with the dictionary.
    """
    exporter = getattr(optimizer, _EXPORTER_ATTR, None)
    return 0 if exporter is None else exporter.pool.release(state_dict)


def is_leased_export_buffer(optimizer: Any, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local tensor) is a pooled export buffer not yet released: nothing
    but its holder reads or writes it until :func:`release_exported_state` gives it back."""
    exporter = getattr(optimizer, _EXPORTER_ATTR, None)
    return exporter is not None and exporter.pool.is_leased(local_tensor(tensor))


_EXPORTER_ATTR = "_optim_factory_host_exporter"


@dataclass
class _Item:
    """One state streamed to the host: ``source`` (flat, raw storage dtype) times ``scale`` into ``dst``."""

    source: torch.Tensor
    scale: torch.Tensor | None
    dst: torch.Tensor  # host, local shape, contiguous
    result: torch.Tensor  # ``dst``, or ``dst`` wrapped as a DTensor like the parameter
    staged: bool  # ``dst`` is filled through a staging buffer (pageable memory), not copied into directly

    @property
    def converts(self) -> bool:
        """Needs converting (BF16/FP16/FP8); FP32 states and int16 remainders are copied as they are."""
        return self.scale is not None or self.source.dtype != self.dst.dtype


@dataclass
class _Piece:
    item: _Item
    start: int  # element range of the item
    stop: int
    offset: int  # byte offset in the chunk buffers

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This piece's slot in a chunk buffer (uint8), typed like the destination."""
        nbytes = (self.stop - self.start) * self.item.dst.element_size()
        return buffer[self.offset : self.offset + nbytes].view(self.item.dst.dtype)

    def source(self) -> torch.Tensor:
        return self.item.source[self.start : self.stop]

    def dst(self) -> torch.Tensor:
        return self.item.dst.view(-1)[self.start : self.stop]


def _plan(items: list[_Item], chunk_bytes: int) -> list[list[_Piece]]:
    """Cut the items into pieces and pack them, in order, into chunks of at most ``chunk_bytes`` bytes."""
    chunks: list[list[_Piece]] = []
    current: list[_Piece] = []
    used = 0
    for item in items:
        esize = item.dst.element_size()
        start, n = 0, item.dst.numel()
        while start < n:
            room = (chunk_bytes - used) // esize
            if room <= 0:
                chunks.append(current)
                current, used = [], 0
                continue
            stop = min(n, start + room)
            current.append(_Piece(item, start, stop, used))
            used = -(-(used + (stop - start) * esize) // _ALIGN) * _ALIGN
            start = stop
    if current:
        chunks.append(current)
    return chunks


def _fp8_torch_dtype(te_fp8_dtype: Any) -> torch.dtype:
    name = str(getattr(te_fp8_dtype, "name", te_fp8_dtype)).lower()  # an IntEnum: str() is its number
    if "e5m2" in name:
        return torch.float8_e5m2
    if "e4m3" in name:
        return torch.float8_e4m3fn
    raise RuntimeError(f"unknown FP8 format {te_fp8_dtype!r}")


def _state_source(optimizer: Any, param: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The raw local storage of one state (flat) and the FP32 factor that unscales it, or ``None`` when the
    state cannot be streamed element by element (non-contiguous storage)."""
    stored = local_tensor(optimizer.state[param][name])
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


def wrap_host_local(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` (a host tensor) as a DTensor laid out like ``param``, without moving it to the mesh's device
    (what ``DTensor.to("cpu")`` returns; ``DTensor.from_local`` would copy it back to the accelerator)."""
    meta = TensorMeta(shape=param.size(), stride=param.stride(), dtype=local.dtype)
    spec = DTensorSpec(mesh=param.device_mesh, placements=tuple(param.placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


_PAGE = 4096
_MADV_HUGEPAGE = 14  # Linux
_HUGE = 2 << 20
try:
    _LIBC: Any = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # pragma: no cover - no libc symbol table
    _LIBC = None


def host_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A fresh pageable host tensor whose pages Linux is asked to back with transparent huge pages before they
    are first touched (one page fault per 2 MiB instead of per 4 KiB). Unsupported systems get a plain one."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if _LIBC is not None and nbytes >= _HUGE:
        start = -(-t.data_ptr() // _PAGE) * _PAGE
        end = (t.data_ptr() + nbytes) // _PAGE * _PAGE
        _LIBC.madvise(start, end - start, _MADV_HUGEPAGE)  # EINVAL where THP is off: harmless
    return t


PINNING = ("register", "alloc", "none")


class HostBufferPool:
    """Host tensors for the chunked export, reused across exports once released.

    A buffer handed out by :meth:`take` is *leased*: the pool keeps no reference to it, so a leased buffer is
    never handed out again; it comes back only through :meth:`release` (or is freed with its dictionary).

    Pinning (for CUDA states) says how the pool's buffers become page-locked, so that the device copies into
    them directly at the link's bandwidth:

    * ``register`` (default): a new buffer is pageable (huge pages, filled through the staging buffers), and
      is pinned in place with ``cudaHostRegister`` on a background thread once it is released, so the first
      export does not wait for pinning and later ones copy directly; unpinned when the tensor is freed.
    * ``alloc``: new buffers come pinned from torch's host allocator (``cudaHostAlloc``; slow to allocate).
    * ``none``: pageable buffers, always filled through the staging buffers.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._leased: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._pinner: ThreadPoolExecutor | None = None
        self._preparing: Future | None = None
        self._registered = [0]  # bytes pinned with cudaHostRegister and not yet unpinned

    @staticmethod
    def _new(key: tuple) -> torch.Tensor:
        """A new buffer for ``key`` = (slot, shape, dtype, pinning): pinned by allocation, or pageable."""
        _, shape, dtype, pinning = key
        if pinning == "alloc":
            buf = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            buf = host_empty(torch.Size(shape), dtype)
        buf._optim_factory_pool_key = key  # type: ignore[attr-defined]
        return buf

    def take(self, slot: Any, shape: torch.Size, dtype: torch.dtype, pinning: str) -> torch.Tensor:
        key = (slot, tuple(shape), dtype, pinning)
        free = self._free.get(key)
        buf = free.pop() if free else self._new(key)
        self._leased[id(buf)] = buf
        return buf

    @staticmethod
    def is_pinned(buf: torch.Tensor) -> bool:
        """Whether the device may copy into ``buf`` directly (pinned by allocation or registration)."""
        pinning = buf._optim_factory_pool_key[3]  # type: ignore[attr-defined]
        return pinning == "alloc" or getattr(buf, "_optim_factory_registered", False)

    def is_leased(self, tensor: torch.Tensor) -> bool:
        return self._leased.get(id(tensor)) is tensor

    def release(self, obj: Any) -> int:
        if isinstance(obj, DTensor):
            obj = obj._local_tensor
        if isinstance(obj, torch.Tensor):
            if not self.is_leased(obj):
                return 0
            del self._leased[id(obj)]
            key = obj._optim_factory_pool_key  # type: ignore[attr-defined]
            self._free.setdefault(key, []).append(obj)
            if key[3] == "register" and not hasattr(obj, "_optim_factory_registered"):
                obj._optim_factory_registered = False  # type: ignore[attr-defined]  # pinning scheduled
                self._background(self._register, obj)
            return 1
        if isinstance(obj, dict):
            return sum(self.release(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(self.release(v) for v in obj)
        return 0

    def _register(self, buf: torch.Tensor) -> None:
        """Pin ``buf`` in place (background thread); it is unpinned when the tensor is freed."""
        ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        if nbytes == 0 or int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) != 0:
            return  # stays pageable: exports keep filling it through the staging buffers
        self._registered[0] += nbytes
        finalizer = weakref.finalize(buf, _unregister, ptr, nbytes, self._registered)
        finalizer.atexit = False
        buf._optim_factory_registered = True  # type: ignore[attr-defined]

    def _background(self, fn, *args) -> Future:
        if self._pinner is None:
            self._pinner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-pin")
        return self._pinner.submit(fn, *args)

    def prepare(self, slots: list[tuple[Any, torch.Size, torch.dtype, str]]) -> Future:
        """Allocate, first-touch and pin (per the slot's pinning) a free buffer for every slot that has none,
        on the background thread; the next export then finds them ready (no page faults, no pinning)."""
        self._preparing = self._background(self._prepare, list(slots))
        return self._preparing

    def _prepare(self, slots: list[tuple[Any, torch.Size, torch.dtype, str]]) -> None:
        for slot, shape, dtype, pinning in slots:
            key = (slot, tuple(shape), dtype, pinning)
            if self._free.get(key):
                continue
            buf = self._new(key)
            if pinning != "alloc":
                buf.view(-1).view(torch.uint8).fill_(0)  # first touch, on all intra-op threads
            if pinning == "register":
                buf._optim_factory_registered = False  # type: ignore[attr-defined]
                self._register(buf)
            self._free.setdefault(key, []).append(buf)

    def wait_preparation(self) -> None:
        """Block until a running :meth:`prepare` is done (an export must not race it for the same slots). A
        failed preparation only costs speed: the export allocates what is missing."""
        if self._preparing is not None:
            preparing, self._preparing = self._preparing, None
            if preparing.exception() is not None:
                warnings.warn(f"preparing export buffers failed: {preparing.exception()!r}", stacklevel=3)

    def wait_pinning(self) -> None:
        """Block until the buffers released so far are pinned (benchmarks and tests)."""
        if self._pinner is not None:
            self._pinner.submit(lambda: None).result()

    def registered_bytes(self) -> int:
        return self._registered[0]

    def free_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)


def _unregister(ptr: int, nbytes: int, counter: list[int]) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
        counter[0] -= nbytes
    except Exception:  # noqa: BLE001  (CUDA already shut down)
        pass


class HostExporter:
    """Streams converted optimizer states into host tensors (the ``chunk_bytes`` mode of the export).

    Per chunk: the pieces that need converting (BF16/FP16/FP8 states) are converted into one of two device
    buffers on the current stream; a side stream copies every piece (converted, or straight from FP32/int16
    states) to the host. The current stream waits for the copy of chunk ``i - 2`` before it overwrites that
    chunk's buffer, so chunk ``i + 1`` is converted while chunk ``i`` is being copied. Pinned destinations
    (pool buffers) are copied into directly; pageable ones (fresh, or pool buffers not pinned yet) through
    one of two pinned staging buffers, which the host empties while the device fills the other. On CPU the
    same steps run synchronously. One exporter per optimizer (:meth:`of`).
    """

    def __init__(self) -> None:
        self.pool = HostBufferPool()
        self.pinning = "register"  # how pooled buffers of CUDA states get pinned (see HostBufferPool)
        self._staging: list[torch.Tensor] = []
        self._copy_streams: dict[torch.device, Any] = {}

    @classmethod
    def of(cls, optimizer: Any) -> HostExporter:
        exporter = getattr(optimizer, _EXPORTER_ATTR, None)
        if exporter is None:
            exporter = cls()
            setattr(optimizer, _EXPORTER_ATTR, exporter)
        return exporter

    def _streamable(self, optimizer: Any, param: torch.Tensor, name: str) -> tuple[torch.Tensor, Any, tuple] | None:
        """Source, scale and host slot (shape, dtype, pinning) of a state that streams; ``None``: it does not
        (not an optimizer state tensor, or not contiguous) and is exported per state."""
        live = optimizer.state[param][name]
        if name not in optimizer.name_to_dtype_map or not isinstance(live, torch.Tensor):
            return None
        found = _state_source(optimizer, param, name)
        if found is None:
            return None
        source, scale = found
        dtype = torch.int16 if source.dtype == torch.int16 else torch.float32
        pinning = self.pinning if source.device.type == "cuda" else "none"
        return source, scale, (local_tensor(live).shape, dtype, pinning)

    def item(self, optimizer: Any, param: torch.Tensor, key: Any, name: str, reuse: bool) -> _Item | None:
        """The streaming plan for one state, with its host destination; ``None``: export it per state."""
        found = self._streamable(optimizer, param, name)
        if found is None:
            return None
        source, scale, (shape, dtype, pinning) = found
        cuda = source.device.type == "cuda"
        # CUDA: pinned destinations are copied into directly, pageable ones through the pinned staging buffers.
        # CPU: reused destinations directly, fresh ones staged (the same steps, so CPU tests cover both paths).
        if reuse:
            dst = self.pool.take((key, name), shape, dtype, pinning)
            staged = cuda and not HostBufferPool.is_pinned(dst)
        else:
            dst, staged = host_empty(shape, dtype), True
        result = wrap_host_local(dst, param) if isinstance(param, DTensor) else dst
        return _Item(source, scale, dst, result, staged)

    def prepare(self, optimizer: Any) -> Future:
        """Get a ready pooled buffer for every state of ``optimizer`` (see :meth:`HostBufferPool.prepare`)."""
        packed = torch.optim.Optimizer.state_dict(optimizer)
        slots = []
        for key, param in param_index_map(optimizer, packed["param_groups"]).items():
            for name in optimizer.state.get(param, {}):
                found = self._streamable(optimizer, param, name)
                if found is not None:
                    slots.append(((key, name), *found[2]))
        return self.pool.prepare(slots)

    def stream(self, items: list[_Item], chunk_bytes: int) -> None:
        """Fill every item's destination; returns when all host tensors hold their final values."""
        by_device: dict[torch.device, list[_Item]] = {}
        for item in items:
            by_device.setdefault(item.source.device, []).append(item)
        for device, group in by_device.items():
            self._stream_device(device, _plan(group, chunk_bytes))

    def _stream_device(self, device: torch.device, chunks: list[list[_Piece]]) -> None:
        cuda = device.type == "cuda"
        compute = torch.cuda.current_stream(device) if cuda else None
        copy = self._copy_stream(device) if cuda else None
        if cuda:
            copy.wait_stream(compute)  # the states are final (the last step's kernels have run)
        need = max((_chunk_bytes(c) for c in chunks if any(p.item.converts for p in c)), default=0)
        buffers = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(2)] if need else []
        staged = [any(p.item.staged for p in c) for c in chunks]
        need_staging = max((_chunk_bytes(c) for c, st in zip(chunks, staged) if st), default=0)
        staging = self._staging_buffers(need_staging, pin=cuda) if need_staging else []
        freed: list[Any] = [None, None]  # copy-stream events after which buffers[i] / staging[i] may be reused
        pending: tuple[Any, list[_Piece], torch.Tensor] | None = None
        for i, chunk in enumerate(chunks):
            slot = i % 2
            converts = [p for p in chunk if p.item.converts]
            if converts:
                if freed[slot] is not None:
                    compute.wait_event(freed[slot])
                for piece in converts:
                    _convert(piece, piece.view(buffers[slot]))
                if cuda:
                    copy.wait_stream(compute)
            with torch.cuda.stream(copy) if cuda else contextlib.nullcontext():
                for piece in chunk:
                    src = piece.view(buffers[slot]) if piece.item.converts else piece.source()
                    target = piece.view(staging[slot]) if piece.item.staged else piece.dst()
                    target.copy_(src, non_blocking=cuda)
                freed[slot] = copy.record_event() if cuda else None
            if pending is not None:
                _unstage(*pending)
                pending = None
            if staged[i]:
                pending = (freed[slot], chunk, staging[slot])
        if pending is not None:
            _unstage(*pending)
        if cuda:
            copy.synchronize()  # every host tensor is final; the device buffers can go back to the allocator

    def _copy_stream(self, device: torch.device) -> Any:
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device)
        return stream

    def _staging_buffers(self, nbytes: int, pin: bool) -> list[torch.Tensor]:
        """Two staging buffers (pinned for CUDA) of at least ``nbytes``, kept for the next export."""
        if not self._staging or self._staging[0].numel() < nbytes or self._staging[0].is_pinned() != pin:
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        return self._staging


def _chunk_bytes(chunk: list[_Piece]) -> int:
    last = chunk[-1]
    return last.offset + (last.stop - last.start) * last.item.dst.element_size()


def _convert(piece: _Piece, out: torch.Tensor) -> None:
    """Exactly what ``get_unscaled_state`` computes, for one piece: widen to FP32, then times the scale."""
    out.copy_(piece.source())
    if piece.item.scale is not None:
        out.mul_(piece.item.scale)


def _unstage(done: Any, chunk: list[_Piece], staging: torch.Tensor) -> None:
    """Copy one chunk's staged pieces from its staging buffer into their (pageable) host destinations."""
    if done is not None:
        done.synchronize()
    for piece in chunk:
        if piece.item.staged:
            piece.dst().copy_(piece.view(staging))


class OffloadedStateDict:
    """``state_dict`` / ``load_state_dict`` / ``release_state_dict`` shared by both FusedAdam backends.

    Options (keyword-only constructor arguments, kept as attributes of the same names):

    * ``state_dict_cpu_offload`` (default ``False``): export to CPU instead of TE's on-device FP32 copies.
    * ``state_dict_offload_chunk_bytes`` (default ``None``: one whole state at a time): stream the export in
      chunks of at most this many bytes of converted data; the GPU holds at most two chunks.
    * ``state_dict_offload_reuse_buffers`` (default ``False``): export into pooled pinned host buffers that
      ``release_state_dict`` gives back for the next export (no page faults, no new pinned memory).
    """

    state_dict_cpu_offload: bool = False
    state_dict_offload_chunk_bytes: int | None = None
    state_dict_offload_reuse_buffers: bool = False

    def _set_offload_options(self, cpu_offload: Any, chunk_bytes: Any, reuse_buffers: Any) -> None:
        check_offload_options(cpu_offload, chunk_bytes, reuse_buffers)
        self.state_dict_cpu_offload = cpu_offload
        self.state_dict_offload_chunk_bytes = chunk_bytes
        self.state_dict_offload_reuse_buffers = reuse_buffers

    def _on_device_state_dict(self) -> dict[str, Any]:
        """The export with offload off (TE's own ``state_dict()``)."""
        return export_state(self, cpu_offload=False)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict, exported as the offload options say (see ``export_state``)."""
        if not self.state_dict_cpu_offload:
            return self._on_device_state_dict()
        return export_state(
            self,
            cpu_offload=True,
            chunk_bytes=self.state_dict_offload_chunk_bytes,
            reuse_buffers=self.state_dict_offload_reuse_buffers,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load CPU or GPU, plain or DTensor states, one state at a time (see ``load_exported_state``)."""
        load_exported_state(self, state_dict)

    def release_state_dict(self, state_dict: Any) -> int:
        """Hand an exported state dict's pooled host buffers back for reuse (see ``release_exported_state``)."""
        return release_exported_state(self, state_dict)

    def prepare_state_dict(self) -> Future | None:
        """With reused buffers: allocate, first-touch and pin the host buffers of the next export on a background
        thread (after the states exist, e.g. after the first step), so that even the first export streams at
        the link's bandwidth. Returns the background job's future (``None`` when buffers are not reused)."""
        if not (self.state_dict_cpu_offload and self.state_dict_offload_reuse_buffers):
            return None
        return HostExporter.of(self).prepare(self)


def load_exported_state(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """Load a dictionary made by :func:`export_state` (CPU or accelerator, plain tensors or DTensors).

    Unlike ``torch.optim.Optimizer.load_state_dict`` this never materialises every state at the parameter's
    dtype on its device first: each state is handed to ``set_scaled_state`` one at a time, which converts it
    to the optimizer's storage dtype (FP16/FP8 with a fresh scale, BF16, FP32, int16 remainders) in place.
    The caller's dictionary is not modified. Tensors in ``param_groups`` (a capturable ``lr``, ``step``) are
    put back on the device of their group's parameters.
    """
    saved_state = state_dict["state"]
    torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "state": {}})
    id_map = param_index_map(optimizer, state_dict["param_groups"])
    for key, values in saved_state.items():
        param = id_map.get(key)
        if param is None:
            continue
        optimizer.state[param] = {}
        for name, value in values.items():
            if value is None:
                continue
            if name not in optimizer.name_to_dtype_map or not isinstance(value, torch.Tensor):
                optimizer.state[param][name] = value
                continue
            local = local_tensor(value)
            master_of_bf16 = name == "master_param" and param.dtype == torch.bfloat16
            if master_of_bf16 and optimizer.store_param_remainders and local.dtype != torch.int16:
                # an FP32 master saved without remainders: keep its low 16 bits (the parameter holds the rest)
                remainder = torch.empty(local.shape, dtype=torch.int16, device=local.device)
                rounded = torch.empty(local.shape, dtype=torch.bfloat16, device=local.device)
                split_bf16_remainder(local.float(), rounded, remainder)
                local = remainder
            elif master_of_bf16 and local.dtype == torch.int16 and not optimizer.store_param_remainders:
                # int16 remainders saved, an FP32 (or FP16) master wanted: rebuild the exact FP32 master
                local = join_bf16_remainder(local_tensor(param).detach().to(local.device), local)
            elif local.dtype != torch.int16:
                local = local.float()
                if _aliases(local, value):
                    local = local.clone()  # set_scaled_state may scale its argument in place
            optimizer.set_scaled_state(param, name, local)
    _place_group_tensors(optimizer)


def _place_group_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Move tensors in ``param_groups`` (capturable ``lr`` and ``step``) to their parameters' device."""
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        device = local_tensor(group["params"][0]).device
        for k, v in group.items():
            if k != "params" and isinstance(v, torch.Tensor) and v.device != device:
                group[k] = v.to(device)


def join_bf16_remainder(param_bf16: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """FP32 master from a BF16 parameter (high bits, rounded) and int16 remainders (low bits)."""
    rem = remainder.to(torch.int32)
    high = param_bf16.view(torch.int16).to(torch.int32) - (rem < 0).to(torch.int32)  # undo the rounding
    bits = torch.bitwise_or(torch.bitwise_left_shift(high, 16), torch.bitwise_and(rem, 0xFFFF))
    return bits.view(torch.float32).clone()


def _to_int16_bits(x: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of an int32 tensor as a (two's complement) int16 tensor."""
    low = torch.bitwise_and(x, 0xFFFF)
    return (low - torch.where(low >= 0x8000, 0x10000, 0)).to(torch.int16)


def split_bf16_remainder(master: torch.Tensor, param_bf16: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write FP32 ``master`` as a BF16 parameter rounded to nearest plus int16 low-bit remainders."""
    bits = master.contiguous().view(torch.int32)
    rem = _to_int16_bits(bits)
    high = torch.bitwise_right_shift(bits, 16) + (rem < 0).to(torch.int32)  # round up
    remainder.copy_(rem)
    param_bf16.view(torch.int16).copy_(_to_int16_bits(high))
