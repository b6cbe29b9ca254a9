"""The choices of ``state_dict_offload_pinning``, in a module of their own: the config schemas
(``optim_factory.config``) name them without importing torch, so that a command line is checked before torch is."""

from __future__ import annotations

from enum import Enum

__all__ = ["Pinning"]


class Pinning(str, Enum):
    """How pooled host buffers of CUDA states become page-locked (see ``HostBufferPool``).

    * ``register``: allocated pageable, pinned in place (``cudaHostRegister``) in the background once released;
    * ``alloc``: allocated pinned (``cudaHostAlloc``; slow to allocate);
    * ``none``: pageable, always filled through the pinned staging buffers.
    """

    register = "register"
    alloc = "alloc"
    none = "none"
