"""Whether host memory is page-locked for CUDA, asked of the driver: also for memory that no tensor holds any more
(a freed export buffer must have been unpinned)."""

from __future__ import annotations

import ctypes
import functools

_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_HOST = 1  # CU_MEMORYTYPE_HOST


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def host_registered(ptr: int) -> bool:
    """Whether host address ``ptr`` lies in page-locked memory (from ``cudaHostAlloc`` or ``cudaHostRegister``):
    ``cuPointerGetAttribute`` calls it host memory; pageable memory is unknown to CUDA (an error). Uses the calling
    thread's CUDA context: call it after torch has used CUDA on this thread."""
    kind = ctypes.c_uint()
    rc = _driver().cuPointerGetAttribute(ctypes.byref(kind), _MEMORY_TYPE, ctypes.c_uint64(ptr))
    return rc == 0 and kind.value == _HOST
