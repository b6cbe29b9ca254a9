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
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "export_state",
    "load_exported_state",
    "param_index_map",
    "join_bf16_remainder",
    "split_bf16_remainder",
    "local_tensor",
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


def export_state(optimizer: Any, *, cpu_offload: bool) -> dict[str, Any]:
    """Build the state dict of a FusedAdam-like optimizer (see the module docstring for the contract).

    Args:
        optimizer: TE's FusedAdam (or a subclass) or :class:`~optim_factory.PortableFusedAdam`.
        cpu_offload: stream each converted state to CPU, one at a time.

    Returns:
        ``{"state": {index: {name: tensor}}, "param_groups": [...]}`` like ``torch.optim.Optimizer``.
    """
    state_dict = torch.optim.Optimizer.state_dict(optimizer)
    id_map = param_index_map(optimizer, state_dict["param_groups"])
    for key, packed in state_dict["state"].items():
        param = id_map.get(key)
        if param is None:
            continue
        live_state = optimizer.state[param]
        exported = {}
        for name in packed:
            exported[name] = _export_one(optimizer, param, name, live_state[name], cpu_offload)
        state_dict["state"][key] = exported
    if cpu_offload:
        state_dict["param_groups"] = [
            {k: (v if k in ("params", "param_names") else _export_group_value(v)) for k, v in g.items()}
            for g in state_dict["param_groups"]
        ]
    return state_dict


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
