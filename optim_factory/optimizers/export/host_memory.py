"""Host memory for the chunked export: fresh pageable tensors backed by huge pages, and the pool of reusable
export buffers with its background pinning thread. See docs/design.md, "Host memory".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import resource
import sys
import warnings
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.export.options import Pinning
from optim_factory.optimizers.export.threads import ProcessThreads

__all__ = [
    "host_empty",
    "fault_in",
    "give_pages_back",
    "register_host",
    "shared_empty",
    "unregister_host",
    "HostBufferPool",
    "Slot",
]

_HUGE = 2 << 20  # a transparent huge page; tensors at least this large get their own mapping
_MAPPED = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (<linux/mman.h>); Python's mmap module has no name for it before 3.13


def host_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A fresh pageable host tensor. On Linux, one of at least 2 MiB gets its own anonymous private mapping,
    aligned to 2 MiB and advised ``MADV_HUGEPAGE`` before it is first touched (one page fault per 2 MiB instead
    of per 4 KiB where transparent huge pages are ``always`` or ``madvise``); it is unmapped when the tensor is
    freed, so its memory goes back to the system at once (glibc would keep freed blocks below its mmap threshold,
    which grows to 32 MiB, in the heap). Smaller tensors, and other systems, get a plain ``torch.empty``."""
    t = torch.empty(0, dtype=dtype)
    nbytes = torch.Size(shape).numel() * t.element_size()
    if not _MAPPED or nbytes < _HUGE:
        return torch.empty(shape, dtype=dtype)
    # the mapping is 2 MiB larger so that the tensor can start on a 2 MiB boundary; untouched pages cost no memory
    mapping = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % _HUGE
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, -(-nbytes // _HUGE) * _HUGE)  # no-op where THP is "never"
    # the tensor's storage is exactly its bytes and holds the only reference to the mapping: freeing it unmaps
    return torch.frombuffer(mapping, dtype=dtype, count=nbytes // t.element_size(), offset=offset).view(shape)


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` (looked up once; ``None`` off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise  # a CDLL call releases the GIL
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def give_pages_back(t: torch.Tensor) -> bool:
    """Give the whole pages of contiguous host tensor ``t`` back to the system (reads afterwards see zeros, writes
    fault fresh pages in); False off Linux, or where the system refused, where nothing is given back. A tensor in
    shared memory (:func:`shared_empty`) has its pages removed from the shared file (``MADV_REMOVE``: for every
    process that maps it; ``MADV_DONTNEED`` would only unmap them here, the file keeping them), any other its pages
    dropped (``MADV_DONTNEED``)."""
    madvise = _madvise()
    if madvise is None:
        return False
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    return end <= start or madvise(start, end - start, 9 if t.is_shared() else 4) == 0  # MADV_REMOVE, MADV_DONTNEED


def fault_in(t: torch.Tensor, populate: bool = True) -> str:
    """Make every page of contiguous host tensor ``t`` resident and writable now (the first-touch faults, the
    kernel zeroing fresh pages, happen in the calling thread; threads may fault disjoint parts in parallel).
    ``madvise(MADV_POPULATE_WRITE)`` keeps the bytes; where the kernel lacks it (before Linux 5.14), or with
    ``populate=False``, one byte per page is written, so the contents are undefined afterwards: meant for fresh
    destinations. Returns how: ``"madvise"``, ``"touch"`` or ``"empty"``."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"fault_in: expected a contiguous host tensor, got {t.device} contiguous={t.is_contiguous()}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return "empty"
    ptr = t.data_ptr()
    madvise = _madvise() if populate else None
    if madvise is not None:
        start = ptr - ptr % _PAGE  # whole pages: populating never changes bytes, also those of a neighbour
        if madvise(start, -(-(ptr + nbytes - start) // _PAGE) * _PAGE, _MADV_POPULATE_WRITE) == 0:
            return "madvise"
        err = ctypes.get_errno()
        if err != 22:  # EINVAL: an older kernel or a mapping it refuses (this call only touches)
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {nbytes} bytes: {os.strerror(err)}")
    flat = t.reshape(-1).view(torch.uint8)
    flat[0] = 0  # the first page, which may start before the tensor
    flat[-ptr % _PAGE :: _PAGE].zero_()
    return "touch"


_SHM = "/dev/shm"  # where torch's shared memory lives on Linux (shm_open), a tmpfs of its own size


def shared_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A fresh host tensor in torch's shared memory (another process maps it by its handle), made there directly
    (torch's own constructor of shared storage, as its multiprocessing uses it): its room in ``/dev/shm`` is taken
    as it is made, and no private tensor is made and copied in (``Tensor.share_memory_()`` of a fresh tensor would,
    touching a private buffer's pages and leaving them to the allocator). Where ``/dev/shm`` has less room than it
    needs (a container's default is 64 MiB), a one-line ``OSError`` naming both instead of the bus error that
    touching a page beyond the room would raise."""
    t = torch.empty(0, dtype=dtype)
    nbytes = torch.Size(shape).numel() * t.element_size()
    if os.path.isdir(_SHM):
        room = os.statvfs(_SHM)
        free = room.f_bavail * room.f_frsize
        if nbytes > free:
            raise OSError(
                f"shared memory: {_SHM} has {free} bytes free, a buffer needs {nbytes} (a container's --shm-size, or "
                "save without write_in_process)"
            )
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)  # the sharing strategy's (a file descriptor's on Linux)
        return torch.empty(0, dtype=dtype).set_(storage, 0, torch.Size(shape))
    except RuntimeError as exc:  # torch's sharing keeps each buffer's file descriptor open in this process
        if "Too many open files" not in str(exc):
            raise
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise OSError(
            f"shared memory: too many open files (each shared buffer keeps one open; the limit is {soft}): raise it "
            "(ulimit -n), or save without write_in_process"
        ) from None


_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the calling thread's


def register_host(t: torch.Tensor) -> bool:
    """Pin the memory of host tensor ``t`` in place (``cudaHostRegister``, portable: whichever device is current
    in the calling thread, every device copies into it as pinned memory); ``False`` if CUDA refused. A refusal
    also leaves the calling thread's last CUDA error set, which the next kernel launch's check would raise: it
    is cleared here (:func:`_clear_last_cuda_error`)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return False
    if int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _REGISTER_PORTABLE)) == 0:
        return True
    _clear_last_cuda_error()
    return False


@functools.cache
def _cuda_get_last_error() -> Any:
    """``cudaGetLastError`` of the CUDA runtime library this process has loaded (torch links it dynamically;
    torch's bindings do not expose it), or ``None`` where none is found."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    return None


def _clear_last_cuda_error() -> None:
    get_last_error = _cuda_get_last_error()
    if get_last_error is not None:
        get_last_error()  # returns the error and resets it to cudaSuccess for this thread


def unregister_host(ptr: int, device: int | torch.device | None = None) -> None:
    """Undo :func:`register_host` for the memory starting at ``ptr`` (nothing once CUDA has shut down). Where CUDA
    refuses, its error is cleared from the calling thread, as :func:`register_host` clears its own: left set, the
    next CUDA call there would raise it as its own. ``device``: made current for the call (a finalizer runs on
    whichever thread lets the memory go, and on one that never set its device the call would create a context on
    GPU 0)."""
    try:
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            refused = int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0
    except Exception:  # noqa: BLE001  (CUDA already shut down)
        return
    if refused:
        _clear_last_cuda_error()


@dataclass(frozen=True)
class Slot:
    """What a pooled buffer is for: the state (``key``: param index and state name), its shape, dtype, pinning."""

    key: Any
    shape: tuple[int, ...]
    dtype: torch.dtype
    pinning: Pinning


@dataclass
class _Buffer:
    """The pool's record of one of its buffers (kept by the pool, keyed by the tensor's id, never on the tensor)."""

    slot: Slot
    shared: bool = False  # in shared memory (made after use_shared_memory)
    registered: bool = False  # pinned in place with cudaHostRegister
    registering: bool = False  # pinning scheduled or done


class HostBufferPool:
    """Host tensors for the chunked export, reused across exports once released.

    A buffer handed out by :meth:`take` is *leased*: the pool keeps no reference to it, so a leased buffer is
    never handed out again; it comes back only through :meth:`release` (or is freed with its dictionary).

    Pinning (for CUDA states; :class:`Pinning`) says how the pool's buffers become page-locked, so that the device
    copies into them directly at the link's bandwidth:

    * ``register`` (default): a new buffer is pageable (huge pages, filled through the staging buffers), and
      is pinned in place with ``cudaHostRegister`` on a background thread once it is released, so the first
      export does not wait for pinning and later ones copy directly; unpinned when the tensor is freed.
    * ``alloc``: new buffers come pinned from torch's host allocator (``cudaHostAlloc``; slow to allocate).
    * ``none``: pageable buffers, always filled through the staging buffers.

    After :meth:`use_shared_memory`, new buffers are in shared memory (torch's: another process maps them by their
    handle), ``register`` and ``alloc`` alike pinned in place with ``cudaHostRegister`` (shared memory cannot come
    from torch's pinned allocator; ``alloc``'s are pinned when made). A buffer leased before then is let go when it
    is released, not kept: handed to another process, it would be moved into shared memory in place, its pinned
    memory freed while still registered, and a later registration at that address refused.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        """``device``: the CUDA device its pinning thread makes current (default: the current device of the thread
        that starts it, which on a thread that never set one is GPU 0)."""
        self._device = device
        self._free: dict[Slot, list[torch.Tensor]] = {}
        self._leased: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._buffers: dict[int, _Buffer] = {}  # id(tensor) -> record, dropped when the tensor is freed
        self._pinner = ProcessThreads(1, "export-pin")
        self._preparing: Future | None = None
        self.shared = False  # new buffers in shared memory (use_shared_memory)

    def use_shared_memory(self) -> None:
        """Make every later buffer in shared memory; the free ones are dropped, the leased ones when released."""
        self.shared = True
        self.clear()

    def _new(self, slot: Slot) -> torch.Tensor:
        """A new buffer for ``slot``: pinned by allocation, or pageable; in shared memory with :attr:`shared`."""
        if self.shared:
            buf = shared_empty(slot.shape, slot.dtype)
        elif slot.pinning is Pinning.alloc:
            buf = torch.empty(slot.shape, dtype=slot.dtype, pin_memory=True)
        else:
            buf = host_empty(torch.Size(slot.shape), slot.dtype)
        self._buffers[id(buf)] = _Buffer(slot, shared=self.shared)
        weakref.finalize(buf, self._buffers.pop, id(buf), None).atexit = False
        if self.shared and slot.pinning is Pinning.alloc:
            self._buffers[id(buf)].registering = True
            self._register(buf)
        return buf

    def take(self, slot: Slot) -> torch.Tensor:
        """A buffer for ``slot``: a released one if there is one, else a new one. It is leased until released."""
        free = self._free.get(slot)
        buf = free.pop() if free else self._new(slot)
        self._leased[id(buf)] = buf
        return buf

    def is_pinned(self, buf: torch.Tensor) -> bool:
        """Whether the device may copy into pool buffer ``buf`` directly (pinned by allocation or registration)."""
        record = self._buffers[id(buf)]
        return (record.slot.pinning is Pinning.alloc and not self.shared) or record.registered

    def free_bytes(self) -> int:
        """Bytes of the released buffers the pool keeps for the next :meth:`take` (leased ones aside)."""
        return sum(b.numel() * b.element_size() for free in list(self._free.values()) for b in list(free))

    def clear(self) -> None:
        """Free the released buffers: on the pool's thread, once it has pinned those released before, as a pinned
        buffer is unpinned where it is freed (there, on the pool's device; not on a thread whose device is GPU 0)."""
        if self._pinner.started:
            self._background(self._free.clear).result()
        else:
            self._free.clear()

    def is_leased(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or a DTensor's local tensor) is one of this pool's buffers, not yet released."""
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        return self._leased.get(id(tensor)) is tensor

    def release(self, obj: Any) -> int:
        """Take back every leased buffer found in ``obj`` (any nesting of dicts, lists, tuples); return how many."""
        if isinstance(obj, DTensor):
            obj = obj._local_tensor
        if isinstance(obj, torch.Tensor):
            if not self.is_leased(obj):
                return 0
            del self._leased[id(obj)]
            record = self._buffers[id(obj)]
            if record.shared != self.shared:  # made before use_shared_memory: let go
                return 1
            self._free.setdefault(record.slot, []).append(obj)
            if record.slot.pinning is Pinning.register and not record.registering:
                record.registering = True
                self._background(self._register, obj)
            return 1
        if isinstance(obj, dict):
            return sum(self.release(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(self.release(v) for v in obj)
        return 0

    def _register(self, buf: torch.Tensor) -> None:
        """Pin ``buf`` in place (background thread); it is unpinned when the tensor is freed."""
        if not register_host(buf):
            return  # stays pageable: exports keep filling it through the staging buffers
        weakref.finalize(buf, unregister_host, buf.data_ptr(), torch.cuda.current_device()).atexit = False
        self._buffers[id(buf)].registered = True

    def _background(self, fn, *args) -> Future:
        # the pool's device, else the first caller's current one (the exporter's: the rank's GPU where the job set it)
        device = self._device
        if device is None and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
        return self._pinner.submit(device, fn, *args)

    def prepare(self, slots: Iterable[Slot]) -> Future:
        """Allocate, first-touch and pin (per the slot's pinning) a free buffer for every slot that has none,
        on the background thread; the next export then finds them ready (no page faults, no pinning). That one
        thread also pins the released buffers, in order: the future is done once those released before are
        pinned too. With no slots it only waits for that pinning: it is not the preparation that
        :meth:`wait_preparation` reports on, and where this process never started the thread (nothing to pin)
        the future is done at once."""
        slots = list(slots)
        if not slots and not self._pinner.started:
            done: Future = Future()
            done.set_result(None)
            return done
        future = self._background(self._prepare, slots)
        if slots:
            self._preparing = future
        return future

    def _prepare(self, slots: list[Slot]) -> None:
        for slot in slots:
            if self._free.get(slot):
                continue
            buf = self._new(slot)
            if slot.pinning is not Pinning.alloc:
                buf.view(-1).view(torch.uint8).fill_(0)  # first touch, on all intra-op threads
            if slot.pinning is Pinning.register:
                self._buffers[id(buf)].registering = True
                self._register(buf)
            self._free.setdefault(slot, []).append(buf)

    def wait_preparation(self) -> None:
        """Block until a running :meth:`prepare` is done (an export must not race it for the same slots). A
        failed preparation only costs speed: the export allocates what is missing."""
        if self._preparing is not None:
            preparing, self._preparing = self._preparing, None
            if preparing.exception() is not None:
                warnings.warn(f"preparing export buffers failed: {preparing.exception()!r}", stacklevel=3)
