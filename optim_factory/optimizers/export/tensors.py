"""Tensor helpers shared by the export and the portable backend: DTensor local shards and re-wrapping, and the
bit arithmetic of BF16 parameters with int16 remainders (the low half of an FP32 master).

See docs/design.md, "Tensors".
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

# torch has no public way to wrap a host tensor as a DTensor of an accelerator mesh without copying it to the
# mesh's device (``DTensor.from_local`` moves it); ``DTensor.to("cpu")`` builds its result this way too.
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "local_tensor",
    "aliases",
    "wrap_like",
    "wrap_host_local",
    "join_bf16_remainder",
    "split_bf16_remainder",
    "all_finite",
    "all_non_negative",
    "all_per_device",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the local tensors of ``a`` and ``b`` share storage (empty tensors never alias)."""
    a, b = local_tensor(a), local_tensor(b)
    if a.numel() == 0 or b.numel() == 0:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def wrap_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Wrap ``local`` as a DTensor with ``param``'s mesh, placements, global shape and stride."""
    return DTensor.from_local(
        local,
        device_mesh=param.device_mesh,
        placements=param.placements,
        run_check=False,
        shape=param.size(),
        stride=param.stride(),
    )


def wrap_host_local(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` (a host tensor) as a DTensor laid out like ``param``, without moving it to the mesh's device
    (what ``DTensor.to("cpu")`` returns; ``DTensor.from_local`` would copy it back to the accelerator)."""
    mesh = param.device_mesh
    key = (id(mesh), tuple(param.placements), param.size(), param.stride(), local.dtype)
    spec = _HOST_SPECS.get(key)
    # the mesh object itself, never an equal one: equal meshes (DeviceMesh.__eq__) may differ in this rank's
    # coordinate, e.g. after the process group was made again, and the coordinate places the shard
    if spec is None or spec.mesh is not mesh:
        if len(_HOST_SPECS) >= _HOST_SPECS_MAX:
            _HOST_SPECS.clear()
        meta = TensorMeta(shape=key[2], stride=key[3], dtype=key[4])
        spec = _HOST_SPECS[key] = DTensorSpec(mesh=mesh, placements=key[1], tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


# One spec per layout, shared by the host DTensors of every export (torch builds new specs rather than change
# one): building a spec took 3-4 times as long as the DTensor itself (13.6 against 3.8 us per wrap on the CPU
# machine), and a checkpoint wraps every state and model tensor. Bounded: cleared when full.
_HOST_SPECS: dict[tuple, DTensorSpec] = {}
_HOST_SPECS_MAX = 4096


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


def all_finite(tensors) -> bool:
    """Whether every floating-point value in ``tensors`` (local tensors) is finite: per tensor its min and max (NaN
    propagates into both, +-inf shows in one; no temporaries), one sync per device. FP8 bytes (one-byte
    storage) are not read. The one finite check of the project: the recipe's save and the load check use it."""
    floats = (t for t in tensors if t.is_floating_point() and t.element_size() > 1)
    return all_per_device(floats, lambda t: torch.aminmax(t.detach()), torch.isfinite)


def all_non_negative(tensors) -> bool:
    """Whether no value in ``tensors`` (local tensors) is negative: per tensor its min, one sync per device."""
    return all_per_device(tensors, lambda t: [t.detach().min()], lambda mins: mins >= 0)


def all_per_device(tensors, reduce, test) -> bool:
    """``test`` holds for the stacked ``reduce`` results (a list of 0-d tensors per tensor) of every non-empty
    tensor: one sync per device."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            per_device.setdefault(t.device, []).extend(reduce(t))
    return all(bool(test(torch.stack(values)).all()) for values in per_device.values())
