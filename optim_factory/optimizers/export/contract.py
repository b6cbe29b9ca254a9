"""The TE-matching export contract: ``export_state`` builds what ``optimizer.state_dict()`` returns and
``load_exported_state`` is its inverse. See docs/design.md, "The export contract".

Both work on any optimizer with Transformer Engine's FusedAdam state API (``get_unscaled_state``,
``set_scaled_state``, ``name_to_dtype_map``, ``store_param_remainders``): TE's own class and
:class:`~optim_factory.PortableFusedAdam`.

* ``cpu_offload=False``: exactly TE's ``FusedAdam.state_dict()``: every state converted to FP32 (int16 for
  remainder masters) on the state's device, DTensor states re-wrapped as DTensors. FP32 states alias the live
  state, as in TE.
* ``cpu_offload=True``: the same keys, names, dtypes and bitwise-equal values, but each state is converted,
  wrapped as a DTensor *on the parameter's device*, copied to CPU, and its device temporary dropped before the
  next state is converted. At most one converted state lives on the accelerator at a time. Exported tensors
  never alias live state, and tensors in ``param_groups`` (a capturable ``lr``, ``step``) are exported as CPU
  copies; the live ``param_groups`` keep their objects and devices.
* ``keep_bf16``: BF16 states are exported as BF16 (the stored values, bitwise) instead of FP32, in every mode;
  everything else as above. Loading accepts BF16 or FP32 for any state.
* ``cpu_offload=True`` with ``chunk_bytes``: the same result, bitwise, streamed in chunks by a
  :class:`~optim_factory.optimizers.export.stream.StateExporter` (the accelerator holds at most two chunks).
"""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.export.formats import (
    MASTER,
    MasterConversion,
    fp32_own,
    live_format,
    load_master,
    saved_format,
)
from optim_factory.optimizers.export.options import ExportOptions
from optim_factory.optimizers.export.stream import StateExporter, StreamItem
from optim_factory.optimizers.export.tensors import (
    aliases,
    all_finite,
    all_non_negative,
    local_tensor,
    wrap_like,
)
from optim_factory.rules.groups import GROUP_KEYS, check_group

__all__ = ["export_state", "load_exported_state", "check_loadable", "param_index_map"]

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


def _to_cpu_copy(t: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """A CPU tensor (or DTensor with a CPU local tensor) that never aliases ``live``."""
    if t.device.type != "cpu":
        return t.to(_CPU)
    if live is not None and (local_tensor(t).numel() == 0 or aliases(t, live)):
        return t.clone()
    return t


def _export_one(optimizer: Any, param: torch.Tensor, name: str, live: Any, cpu_offload: bool, keep_bf16: bool) -> Any:
    """Export a single optimizer state of ``param``."""
    if name not in optimizer.name_to_dtype_map or not isinstance(live, torch.Tensor):
        # Not one of FusedAdam's states (e.g. added by a user): passed through, copied when offloading.
        if cpu_offload and isinstance(live, torch.Tensor):
            return _to_cpu_copy(live, live)
        return live
    if keep_bf16 and optimizer.name_to_dtype_map[name] == torch.bfloat16:
        converted = local_tensor(live)  # the stored BF16 tensor (aliases live state, as TE's FP32 states do)
    else:
        converted = optimizer.get_unscaled_state(param, name)  # FP32 (int16 remainders), local, param's device
    if isinstance(param, DTensor):
        converted = wrap_like(converted, param)  # on the parameter's device, before any copy
    if not cpu_offload:
        return converted
    return _to_cpu_copy(converted, live)


def _export_group_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(_CPU, copy=True)
    return value


def export_state(
    optimizer: Any,
    *,
    cpu_offload: bool,
    chunk_bytes: int = 0,
    reuse_buffers: bool = False,
    keep_bf16: bool = False,
    exporter: StateExporter | None = None,
    background: bool = False,
) -> dict[str, Any]:
    """Build the state dict of a FusedAdam-like optimizer (see the module docstring for the contract).

    Args:
        optimizer: TE's FusedAdam (or a subclass) or :class:`~optim_factory.PortableFusedAdam`.
        cpu_offload: export to CPU: one state at a time (``chunk_bytes=0``), or streamed in chunks.
        chunk_bytes: with ``cpu_offload``, stream in chunks of at most this many bytes of converted output.
        reuse_buffers: with ``chunk_bytes``, take host destinations from ``exporter``'s pool (pinned when the
            states are on CUDA); the optimizer's ``release_state_dict`` gives them back.
        keep_bf16: export BF16 states as they are stored (BF16) instead of converting them to FP32.
        exporter: the optimizer's own :class:`StateExporter` (needed with ``reuse_buffers``; a temporary one is
            used for a chunked export without it).
        background: with ``chunk_bytes``, return once the host tensors are allocated; ``exporter`` fills them on
            its background thread (``exporter.wait()`` waits and re-raises its failure).

    Returns:
        ``{"state": {index: {name: tensor}}, "param_groups": [...]}`` like ``torch.optim.Optimizer``.
    """
    chunk = chunk_bytes if cpu_offload else None  # 0 for an export that stays on the device
    options = ExportOptions(cpu_offload, chunk, reuse_buffers, keep_bf16=keep_bf16, background=background)
    if (reuse_buffers or background) and exporter is None:
        raise ValueError("reuse_buffers or background: needs the optimizer's own exporter (it owns the buffer pool)")
    if chunk_bytes and exporter is None:
        with StateExporter(options) as temporary:  # its threads end with this export
            return export_state(
                optimizer, cpu_offload=cpu_offload, chunk_bytes=chunk_bytes, keep_bf16=keep_bf16, exporter=temporary
            )
    state_dict = torch.optim.Optimizer.state_dict(optimizer)
    id_map = param_index_map(optimizer, state_dict["param_groups"])
    if chunk_bytes:
        exporter.pool.wait_preparation()  # never race a background prepare for the same slots
    streamed: list[StreamItem] = []
    for key, packed in state_dict["state"].items():
        param = id_map.get(key)
        if param is None:
            continue
        live_state = optimizer.state[param]
        exported = {}
        for name in packed:
            live = live_state[name]
            item = None
            if chunk_bytes:
                item = exporter.item(optimizer, param, key, name, reuse_buffers, keep_bf16)
            if item is not None:
                streamed.append(item)
                exported[name] = item.result
            else:
                exported[name] = _export_one(optimizer, param, name, live, cpu_offload, keep_bf16)
        state_dict["state"][key] = exported
    if streamed and background:
        exporter.stream_background(streamed, chunk_bytes)
    elif streamed:
        exporter.stream(streamed, chunk_bytes)
    if cpu_offload:
        state_dict["param_groups"] = [
            {k: (v if k in ("params", "param_names") else _export_group_value(v)) for k, v in g.items()}
            for g in state_dict["param_groups"]
        ]
    return state_dict


_LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def present(values: dict[str, Any]) -> dict[str, Any]:
    """A parameter's saved states without the empty dicts that stand for a missing one: DCP's
    ``set_optimizer_state_dict`` gives each state the live optimizer has but its flat dictionary lacks (a
    ``master_param`` that :class:`~optim_factory.checkpoint.ExactLoadPlanner` left out of the read) as ``{}``."""
    return {k: v for k, v in values.items() if not (isinstance(v, dict) and not v)}


def _where(g: int, i: int, group: dict) -> str:
    names = group.get("param_names")
    name = f" ({names[i]})" if isinstance(names, (list, tuple)) and i < len(names) else ""
    return f"group {g}, parameter {i}{name}"


def check_loadable(optimizer: Any, state_dict: Any) -> None:
    """Check a whole state dict against ``optimizer`` before anything is loaded; raise one ``ValueError`` line
    naming the group, the parameter (index, and name where the dictionary has ``param_names``) and the mismatch.

    Checked: the dictionary's structure; group count and sizes; the keys FusedAdam's groups need, and the groups by
    the constructor's rules (``rules.groups.check_group``: hyperparameters, ``bias_correction``, ``step``, no
    optimizer-wide keys); a non-zero ``step`` in every group that has states (without it the bias correction would
    restart at step 1 under moments of a later step); no states for an index no group lists (they would be dropped); the
    parameter names where both sides have them (the states would otherwise land on other parameters of the same
    shape); state names (``exp_avg``, ``exp_avg_sq``, ``master_param``); every state's local shape against its
    parameter's local shape; dense tensors with data (not sparse, not on the meta device); dtypes that convert
    (FP32, BF16, FP16; int16 remainders only for the master of a BF16 parameter); last, finite values (NaN or
    inf in a state is a diverged run's: loading it would train on NaN; one min/max pass per state, one sync
    per device) and a non-negative ``exp_avg_sq``.
    """
    required = [k for k in GROUP_KEYS if k not in ("param_names", "step")]

    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"load_state_dict: expected a dict with 'state' and 'param_groups', got {keys}")
    saved_groups, live_groups = state_dict["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(live_groups):
        raise ValueError(
            f"load_state_dict: the state dict has {len(saved_groups)} parameter group(s), the optimizer "
            f"{len(live_groups)}"
        )
    state = state_dict["state"]
    if not isinstance(state, dict):
        raise ValueError(
            f"load_state_dict: 'state' is a {type(state).__name__}, expected a dict (parameter index -> its states)"
        )
    checked: list[tuple[str, torch.Tensor]] = []  # (where, local tensor) of every state, for the finite check
    for g, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        missing = [k for k in required if k not in saved]
        if missing:
            raise ValueError(
                f"load_state_dict: group {g} lacks {', '.join(map(repr, missing))}: not a FusedAdam state dict "
                "(e.g. torch.optim.AdamW's)"
            )
        if len(saved["params"]) != len(live["params"]):
            raise ValueError(
                f"load_state_dict: group {g} has {len(saved['params'])} parameter(s) in the state dict, "
                f"{len(live['params'])} in the optimizer"
            )
        try:
            check_group(saved, getattr(optimizer, "adam_options", None))
        except ValueError as exc:
            raise ValueError(f"load_state_dict: group {g}: {exc}") from None
        _check_names(g, saved.get("param_names"), live.get("param_names"), len(live["params"]))
        has_states = any(isinstance(v, dict) and v for v in map(state.get, saved["params"]))
        if has_states and ("step" not in saved or float(saved["step"]) == 0):
            raise ValueError(
                f"load_state_dict: group {g} has states but {'no' if 'step' not in saved else 'a zero'} 'step': "
                "the bias correction would restart at step 1"
            )
        for i, (key, param) in enumerate(zip(saved["params"], live["params"])):
            values = state.get(key, {})
            if not isinstance(values, dict):
                raise ValueError(f"load_state_dict: {_where(g, i, saved)}: expected a dict of states")
            values = present(values)
            for name, value in values.items():
                _check_state(optimizer, f"{_where(g, i, saved)}: {name}", name, value, param)
                if value is not None:
                    checked.append((f"{_where(g, i, saved)}: {name}", local_tensor(value)))
            moments = [n for n in ("exp_avg", "exp_avg_sq") if values.get(n) is not None]
            if len(moments) == 1:
                raise ValueError(f"load_state_dict: {_where(g, i, saved)}: has {moments[0]} but not the other moment")
    listed = set(chain.from_iterable(g["params"] for g in saved_groups))
    stray = [key for key in state if key not in listed]
    if stray:  # dropped silently with the group's step kept, the next update would not be the saved run's
        raise ValueError(
            f"load_state_dict: the state dict has states for {', '.join(map(repr, stray[:3]))}"
            f"{' ...' if len(stray) > 3 else ''}, which no parameter group lists (they would be dropped)"
        )
    if not all_finite(t for _, t in checked):
        where = next(where for where, t in checked if not all_finite([t]))
        raise ValueError(f"load_state_dict: {where} holds NaN or inf values (a diverged run's state): not loaded")
    second = [(where, t) for where, t in checked if where.endswith(": exp_avg_sq")]
    if not all_non_negative(t for _, t in second):  # loaded, they would make NaN weights after one step
        where = next(where for where, t in second if not all_non_negative([t]))
        raise ValueError(f"load_state_dict: {where} holds negative values (a second moment is >= 0): not loaded")


# the parts of a parameter name that wrappers add (DDP, torch.compile, FSDP1, activation checkpointing)
_WRAPPER_PARTS = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _unwrapped(name: Any) -> Any:
    if not isinstance(name, str):
        return name
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _check_names(g: int, names: Any, live_names: Any, count: int) -> None:
    """Where both sides name their parameters: a name (without wrapper parts such as ``module.``) at another
    index than the optimizer's is refused (the states would load into another parameter); names that differ
    otherwise load by position, as torch's optimizers load, with a warning."""
    if names is None or live_names is None or list(names) == list(live_names):
        return
    if len(names) != count:
        raise ValueError(f"load_state_dict: group {g} has {len(names)} param_names for {count} parameters")
    where = {_unwrapped(n): i for i, n in enumerate(live_names)}
    for i, name in enumerate(names):
        j = where.get(_unwrapped(name))
        if j is not None and j != i:
            raise ValueError(
                f"load_state_dict: group {g}, parameter {i} is {name!r} in the state dict, parameter {j} "
                f"({live_names[j]!r}) in the optimizer: the states would load into another parameter"
            )
    i = next(i for i, (a, b) in enumerate(zip(names, live_names)) if a != b)
    warnings.warn(
        f"load_state_dict: group {g} names its parameters differently (parameter {i}: {names[i]!r} in the state "
        f"dict, {live_names[i]!r} in the optimizer): loaded by position",
        UserWarning,
        stacklevel=5,  # the caller of load_state_dict
    )


def _check_state(optimizer: Any, where: str, name: str, value: Any, param: torch.Tensor) -> None:
    if name not in optimizer.name_to_dtype_map:
        known = ", ".join(optimizer.name_to_dtype_map)
        raise ValueError(f"load_state_dict: {where}: unknown state (FusedAdam's states are {known})")
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"load_state_dict: {where}: expected a tensor, got {type(value).__name__}")
    local, live = local_tensor(value), local_tensor(param)
    if local.layout != torch.strided or local.is_meta:
        raise ValueError(
            f"load_state_dict: {where} is {local.layout} on {local.device}: expected a dense tensor with data"
        )
    if local.shape != live.shape:
        raise ValueError(
            f"load_state_dict: {where} has shape {tuple(local.shape)}, the parameter's (local) shape is "
            f"{tuple(live.shape)}"
        )
    if name == MASTER and local.dtype == torch.int16 and param.dtype != torch.bfloat16 and optimizer.master_weights:
        raise ValueError(
            f"load_state_dict: {where} is saved as {saved_format(local)}, which only a BF16 parameter's master "
            f"can be; this parameter is {str(param.dtype).removeprefix('torch.')}, its master "
            f"{live_format(optimizer, param)}: not convertible"
        )
    if local.dtype not in _LOADABLE_DTYPES and not (name == MASTER and local.dtype == torch.int16):
        raise ValueError(
            f"load_state_dict: {where} has dtype {local.dtype}; loadable: float32, bfloat16, float16 "
            "(int16 remainders for the master of a BF16 parameter)"
        )


def load_exported_state(optimizer: Any, state_dict: dict[str, Any]) -> list[MasterConversion]:
    """Load a dictionary made by :func:`export_state` (CPU or accelerator, plain tensors or DTensors).

    The whole dictionary is checked first (:func:`check_loadable`): a mismatch raises one ``ValueError`` line
    and leaves the optimizer exactly as it was.

    Unlike ``torch.optim.Optimizer.load_state_dict`` this never materialises every state at the parameter's
    dtype on its device first: each state is handed to ``set_scaled_state`` one at a time, which converts it
    to the optimizer's storage dtype (FP16/FP8 with a fresh scale, BF16, FP32, int16 remainders) in place.
    The caller's dictionary is not modified. Tensors in ``param_groups`` (a capturable ``lr``, ``step``) are
    put back on the device of their group's parameters.

    A master saved in another format than the optimizer stores is converted by
    :func:`~optim_factory.optimizers.export.formats.load_master`; the conversions that depend on the parameter
    are returned, to be applied again (:meth:`MasterConversion.apply`) once the model is loaded: our optimizers
    do that themselves before their next ``step()`` or ``state_dict()``.
    """
    check_loadable(optimizer, state_dict)
    saved_state = state_dict["state"]
    torch.optim.Optimizer.load_state_dict(optimizer, {**state_dict, "state": {}})
    id_map = param_index_map(optimizer, state_dict["param_groups"])
    conversions = []
    for key, values in saved_state.items():
        param = id_map.get(key)
        if param is None:
            continue
        optimizer.state[param] = {}
        values = present(values)
        for name, value in values.items():
            if value is None or name == MASTER:
                continue
            if name not in optimizer.name_to_dtype_map or not isinstance(value, torch.Tensor):
                optimizer.state[param][name] = value
                continue
            optimizer.set_scaled_state(param, name, fp32_own(value))
        if values:
            conversion = load_master(optimizer, param, values.get(MASTER))
            if conversion is not None:
                conversions.append(conversion)
    _place_group_tensors(optimizer)
    return conversions


def _place_group_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Move tensors in ``param_groups`` (capturable ``lr`` and ``step``) to their parameters' device."""
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        device = local_tensor(group["params"][0]).device
        for k, v in group.items():
            if k != "params" and isinstance(v, torch.Tensor) and v.device != device:
                group[k] = v.to(device)
