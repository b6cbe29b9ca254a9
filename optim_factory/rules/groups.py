"""The rules of a FusedAdam parameter group, written once: its hyperparameters and flags by the constructor's
rules (:mod:`optim_factory.rules.adam`), its keys, its parameters' dtypes; both FusedAdam classes check every
group they add (:class:`CheckedParamGroups`), and a loaded state dict's groups pass the same rules."""

from __future__ import annotations

import difflib
from typing import Any

import torch

from optim_factory.errors import ConfigError
from optim_factory.rules.adam import ADAM_ARGUMENTS, AdamOptions, check_flags, check_hyperparameters, lookup_dtype

__all__ = ["GROUP_KEYS", "PARAM_DTYPES", "CheckedParamGroups", "check_group", "check_group_params", "own_lr_tensor"]


# the keys FusedAdam reads from a parameter group (``step`` is its own count; ``param_names`` torch's); any other
# key is the caller's (an LR scheduler's ``initial_lr``, a tag) and left alone, unless it is one of these misspelled
GROUP_KEYS = ("params", "param_names", "lr", "betas", "eps", "weight_decay", "bias_correction", "step")


def _check_step(step: Any) -> None:
    """A group's ``step``: a count >= 0 (an int, or the one-element tensor of capturable groups)."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
        count = float(step)
    elif isinstance(step, int) and not isinstance(step, bool):
        count = float(step)
    else:
        raise ConfigError("step", step, "expected the group's step count (an int >= 0)")
    if not (count >= 0 and count == int(count)):
        raise ConfigError("step", step, "expected the group's step count (an int >= 0)")


def check_group(group: dict[str, Any], options: AdamOptions | None = None) -> None:
    """A parameter group by the constructor's rules: :func:`check_hyperparameters` of its ``lr``, ``betas``, ``eps``
    and ``weight_decay``; ``bias_correction`` a ``bool``; ``step`` (a loaded group's) a count >= 0; an
    optimizer-wide option (``adam_w_mode``, ``amsgrad``, ``master_weights`` ...: FusedAdam reads them from its
    constructor only) only with the optimizer's own value (``options``; torch's AdamW groups carry
    ``amsgrad=False``, ``capturable=False``); no misspelling of a group key (``weight_decy``, ``bets``: a key no
    longer than the one it nearly matches; ``weight_decay_mult``, ``lrs`` and other keys of the caller's stay)."""
    check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    check_flags(bias_correction=group["bias_correction"])
    if "step" in group:
        _check_step(group["step"])
    for key in group:
        if key in GROUP_KEYS or not isinstance(key, str):
            continue
        if key in ADAM_ARGUMENTS:
            mine = None if options is None else getattr(options, key)
            if group[key] != mine and not (isinstance(mine, torch.dtype) and lookup_dtype(group[key]) == mine):
                raise ConfigError(
                    key,
                    group[key],
                    f"optimizer-wide in FusedAdam ({'unknown' if mine is None else repr(mine)} here): pass it to "
                    "the constructor, not in a param group",
                )
            continue
        near = [k for k in difflib.get_close_matches(key, GROUP_KEYS, n=3, cutoff=0.8) if len(key) <= len(k)]
        if near:
            raise ConfigError(key, group[key], f"not a FusedAdam param group key; did you mean {near[0]}?")


PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # TE's Float8Tensor reports one of these


def check_group_params(group: dict[str, Any], state_dtypes: dict[str, torch.dtype] | None) -> None:
    """The parameters of a group as FusedAdam's ``step()`` needs them, checked when the group is added (TE 2.20
    raises in ``step()``, after it has counted the step and made the states; the portable twin after it has updated
    the earlier parameters): FP32, FP16 or BF16 (FP8 tensors report one of these), not FP16 and BF16 in one group;
    and, once the state dtypes are known (``state_dtypes``: ``name_to_dtype_map``), no 0-dimensional parameter with
    FP16 states (their scale has shape [1], which TE 2.20.2's unscaling cannot multiply into a 0-d state on an
    H200; its FP8 states, Float8Tensors, take 0-d parameters, and so does the portable twin)."""
    dtypes = set()
    for i, p in enumerate(group["params"]):
        # (TE's step() makes every parameter's states, and checks dtypes only where there is a gradient)
        if p.requires_grad and p.dtype not in PARAM_DTYPES:
            raise ConfigError(
                "params", p.dtype, "expected fp32, fp16, bf16 (or TE's fp8) parameters",
                text=f"parameter {i} has dtype {p.dtype}: FusedAdam updates fp32, fp16, bf16 and fp8 parameters",
            )  # fmt: skip
        if p.requires_grad:
            dtypes.add(p.dtype)
        scaled = [n for n, d in (state_dtypes or {}).items() if d == torch.float16]
        if p.dim() == 0 and scaled:  # (with master_weights, TE keeps a master for FP32 parameters too)
            raise ConfigError(
                "params", tuple(p.shape), "expected a parameter with at least one dimension",
                text=f"parameter {i} is 0-dimensional: FusedAdam cannot unscale its FP16 states ({', '.join(scaled)}; "
                "TE's scale has shape [1]); reshape it to (1,) or keep those states in bf16/fp8/fp32",
            )  # fmt: skip
    if {torch.float16, torch.bfloat16} <= dtypes:
        raise ConfigError(
            "params", "fp16+bf16", "one of fp16 and bf16 per group",
            text="FusedAdam does not support a mix of float16 and bfloat16 model weights (in one param group)",
        )  # fmt: skip


def own_lr_tensor(group: dict[str, Any]) -> None:
    """A capturable group's ``lr`` as a tensor of its own on its parameters' device. On the CPU ``.to()`` without
    ``copy=True`` hands every group the defaults' tensor, so an LR scheduler's in-place update of one group would
    change them all; TE's ``add_param_group`` leaves an added group with the defaults' CPU tensor, which its
    capturable ``step()`` reads from the GPU: an illegal memory access (H200, TE 2.20.2)."""
    if group["params"]:
        lr_value = torch.as_tensor(group["lr"], dtype=torch.float32)
        group["lr"] = lr_value.to(device=group["params"][0].device, copy=True)


class CheckedParamGroups:
    """Both FusedAdam classes inherit this: every parameter group (the constructor's, and each
    ``add_param_group``) passes :func:`check_group` and :func:`check_group_params` once torch has filled its
    defaults; a refused group is not added (a group's ``lr=-0.1`` or ``lr=nan`` would train to NaN, and its
    checkpoint would then be refused at load, which checks the same rules). The constructors call
    :meth:`_check_param_groups` once their state dtypes are known (the 0-d rule needs them)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        index = len(self.param_groups) - 1  # type: ignore[attr-defined]
        try:
            check_group(self.param_groups[-1], getattr(self, "adam_options", None))  # type: ignore[attr-defined]
            check_group_params(self.param_groups[-1], self._state_dtypes())  # type: ignore[attr-defined]
        except ConfigError as exc:
            self.param_groups.pop()  # type: ignore[attr-defined]
            raise ConfigError(exc.key, exc.value, exc.allowed, text=f"param group {index}: {exc}") from None
        if getattr(self, "capturable", False):  # set after the constructor's groups, which __init__ gives theirs
            own_lr_tensor(self.param_groups[-1])  # type: ignore[attr-defined]

    def _state_dtypes(self) -> dict[str, torch.dtype] | None:
        """The dtype of each state this optimizer keeps (``None`` inside the constructor, before they are set)."""
        dtypes = getattr(self, "name_to_dtype_map", None)
        if dtypes is None or self.master_weights:  # type: ignore[attr-defined]
            return dtypes
        return {name: dtype for name, dtype in dtypes.items() if name != "master_param"}

    def _check_param_groups(self) -> None:
        """The end of both constructors: :func:`check_group_params` with the state dtypes, for every group."""
        for index, group in enumerate(self.param_groups):  # type: ignore[attr-defined]
            try:
                check_group_params(group, self._state_dtypes())
            except ConfigError as exc:
                raise ConfigError(exc.key, exc.value, exc.allowed, text=f"param group {index}: {exc}") from None
