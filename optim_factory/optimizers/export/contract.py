"""The load contract: what a state dict must look like to load (:func:`check_loadable`), and
``load_exported_state``, the inverse of the export (``plan.export_state``). See docs/design.md, "The export
contract".

Both work on any optimizer with Transformer Engine's FusedAdam state API (``set_scaled_state``,
``name_to_dtype_map``, ``store_param_remainders``): TE's own class and :class:`~optim_factory.PortableFusedAdam`.
Loading accepts BF16 or FP32 for any state, on CPU or the accelerator, plain or DTensor.
"""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any

import torch

from optim_factory.optimizers.export.formats import (
    MASTER,
    MasterConversion,
    check_not_cast,
    fp32_own,
    live_format,
    load_master,
    saved_format,
)
from optim_factory.optimizers.export.tensors import all_finite, all_non_negative, local_tensor
from optim_factory.rules.groups import GROUP_KEYS, check_group

__all__ = ["load_exported_state", "check_loadable", "param_index_map"]


def param_index_map(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> dict[Any, torch.Tensor]:
    """Map the parameter ids of a packed state dict (``saved_groups``) to the live parameters."""
    return dict(
        zip(
            chain.from_iterable(g["params"] for g in saved_groups),
            chain.from_iterable(g["params"] for g in optimizer.param_groups),
            strict=True,
        )
    )


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
    per device), a non-negative ``exp_avg_sq``, and masters that DCP's default planner did not cast from another
    format (``formats.check_not_cast``: int16 remainders read as an FP32 master, an FP32 master truncated into
    int16 remainders).
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
    checked: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (where, parameter, local tensor) of every state
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
                    checked.append((f"{_where(g, i, saved)}: {name}", param, local_tensor(value)))
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
    _check_values(optimizer, checked)


def _check_values(optimizer: Any, checked: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """The last checks of :func:`check_loadable`, on every state's (where, parameter, local tensor): finite values,
    a non-negative ``exp_avg_sq``, and masters that DCP's default planner did not cast into another format
    (:func:`~optim_factory.optimizers.export.formats.check_not_cast`)."""
    checked, masters = [(w, t) for w, _, t in checked], [c for c in checked if c[0].endswith(": " + MASTER)]
    if not all_finite(t for _, t in checked):
        where = next(where for where, t in checked if not all_finite([t]))
        raise ValueError(f"load_state_dict: {where} holds NaN or inf values (a diverged run's state): not loaded")
    second = [(where, t) for where, t in checked if where.endswith(": exp_avg_sq")]
    if not all_non_negative(t for _, t in second):  # loaded, they would make NaN weights after one step
        where = next(where for where, t in second if not all_non_negative([t]))
        raise ValueError(f"load_state_dict: {where} holds negative values (a second moment is >= 0): not loaded")
    check_not_cast(optimizer, masters)


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
    """Load a dictionary made by ``export_state`` (CPU or accelerator, plain tensors or DTensors).

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
