"""The rules of FusedAdam's constructor options, written once: spellings, hyperparameters, flags, state dtypes
(a parameter group's rules build on these: :mod:`optim_factory.rules.groups`; the export options':
:mod:`optim_factory.rules.export`).

Both optimizers (:class:`optim_factory.PortableFusedAdam` and the TE subclass :class:`optim_factory.FusedAdam`)
run ``constructor.check_constructor`` (these rules and the export options) first thing in ``__init__``; the
factory's ``validate_optim_config`` runs :func:`check_hyperparameters` and :func:`check_state_dtypes` (the parts
that need no model), and shows their :class:`~optim_factory.errors.ConfigError` as a config key's
(``optim.<key>=<value>: <allowed>``). So a value is refused with the same reason whether it comes from a recipe
config, a Hydra ``_target_`` block or a direct call.

What the constructors accept, beyond TE's own argument types, so that a plain YAML block builds them:

* dtypes as strings: ``fp32|fp16|bf16|fp8``, ``float32``, ``bfloat16``, ``torch.bfloat16``, ``float8_e4m3fn``,
  ``uint8`` ... (any case), or ``torch.dtype`` objects. FP8 is E4M3, which TE spells ``torch.uint8``.
* sizes as ``64MiB`` / ``1GiB`` / ``4096B`` strings or ints (``rules.export.parse_bytes``).
* ``betas`` as any two-element sequence (a list, a tuple, OmegaConf's ``ListConfig``).

Hyperparameters are checked as ``torch.optim.Adam`` checks them, with its messages; the values torch lets
through but that cannot train (an infinite lr, eps or weight decay) are refused too. Flags must be ``bool``:
``master_weights="yes"`` is refused, not read as true.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from optim_factory.errors import ConfigError

__all__ = [
    "ADAM_ARGUMENTS",
    "AdamOptions",
    "parse_dtype",
    "check_hyperparameters",
    "check_flags",
    "check_state_dtypes",
    "check_adam_options",
    "lookup_dtype",
    "DTYPE_SPELLINGS",
]

# Every accepted spelling (lower case, without a "torch." prefix) -> the dtype TE's FusedAdam takes.
DTYPE_SPELLINGS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.uint8,  # TE spells FP8 (E4M3) torch.uint8 in FusedAdam's arguments
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.uint8,
    "fp8_e4m3": torch.uint8,
}
_MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
_MASTER_DTYPES = (torch.float32, torch.float16)
_SPELLINGS = "fp32|fp16|bf16|fp8 (also float32, bfloat16, torch.bfloat16, float8_e4m3fn, uint8, a torch.dtype)"
_MOMENT_ALLOWED = f"expected {_SPELLINGS}"
_MASTER_ALLOWED = "expected fp32|fp16 (also float32, float16, torch.float32, torch.float16, a torch.dtype)"


def lookup_dtype(value: Any) -> torch.dtype | None:
    """The dtype a spelling or a ``torch.dtype`` names (:data:`DTYPE_SPELLINGS`), or None."""
    if isinstance(value, torch.dtype):
        text = str(value)
    elif isinstance(value, str):
        text = value
    else:
        return None
    return DTYPE_SPELLINGS.get(text.strip().lower().removeprefix("torch."))


def parse_dtype(value: Any, key: str = "dtype") -> torch.dtype:
    """A dtype spelling (see :data:`DTYPE_SPELLINGS`) or a ``torch.dtype`` -> the dtype TE's FusedAdam takes
    (FP8 -> ``torch.uint8``). Raises :class:`ConfigError` naming ``key``."""
    dtype = lookup_dtype(value)
    if dtype is None:
        raise ConfigError(key, value, _MOMENT_ALLOWED)
    return dtype


# ------------------------------------------------------------------------------------------ hyperparameters
def _number(value: Any) -> float | None:
    """The float value of a real number or a one-element tensor; ``None`` for anything else (bool, str ...)."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and value.is_floating_point() else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _check_non_negative(key: str, value: Any, torch_text: str) -> float:
    """torch's ``not 0.0 <= x`` check (which also refuses NaN) with torch's message, plus finiteness."""
    x = _number(value)
    expected = "(expected a finite number >= 0)"
    if x is None:
        raise ConfigError(key, value, "expected a number", text=f"{torch_text}: {value!r} {expected}")
    if not 0.0 <= x:  # NaN fails here, as in torch
        raise ConfigError(key, value, "must be >= 0", text=f"{torch_text}: {value} {expected}")
    if not math.isfinite(x):
        raise ConfigError(key, value, "must be finite", text=f"{torch_text}: {value} {expected}")
    return x


def check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> tuple[Any, tuple[float, float]]:
    """Check ``lr``, ``betas``, ``eps``, ``weight_decay`` as ``torch.optim.Adam`` does (same messages, e.g.
    ``Invalid learning rate: -1.0``); also refuse infinite values. Return ``lr`` (a float, or the 1-element tensor
    given) and ``betas`` as a tuple of two floats."""
    _check_non_negative("lr", lr, "Invalid learning rate")
    if not isinstance(lr, torch.Tensor):
        lr = float(lr)
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Iterable):
        raise ConfigError("betas", betas, "expected two numbers (beta1, beta2), each in [0, 1)")
    pair = list(betas)
    if len(pair) != 2:
        raise ConfigError("betas", pair, "expected two numbers (beta1, beta2), each in [0, 1)")
    out = []
    for i, beta in enumerate(pair):
        b = _number(beta)
        if b is None or isinstance(beta, torch.Tensor) or not 0.0 <= b < 1.0:
            text = f"Invalid beta parameter at index {i}: {beta} (expected a number in [0, 1))"
            raise ConfigError(f"betas[{i}]", beta, "must be in [0, 1)", text=text)
        out.append(b)
    _check_non_negative("eps", eps, "Invalid epsilon value")
    _check_non_negative("weight_decay", weight_decay, "Invalid weight_decay value")
    return lr, (out[0], out[1])


def check_flags(**flags: Any) -> None:
    """Every flag is a ``bool``: ``master_weights="yes"`` or ``1`` is refused instead of read as true."""
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(key, value, "expected True or False")


# ------------------------------------------------------------------------------------------- state dtypes
@dataclass(frozen=True)
class StateDtypes:
    """The checked state dtypes; ``store_param_remainders`` is what takes effect (TE's rule)."""

    master_weight_dtype: torch.dtype
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    store_param_remainders: bool


def check_state_dtypes(
    *,
    master_weights: bool,
    master_weight_dtype: Any,
    exp_avg_dtype: Any,
    exp_avg_sq_dtype: Any,
    capturable: bool,
    store_param_remainders: bool,
) -> StateDtypes:
    """The dtype / capturable / master-weight rules of TE 2.20's FusedAdam, with TE's messages.

    Stricter than TE in two places, both values that could never take effect: ``master_weight_dtype`` must be
    fp32|fp16 even with ``master_weights=False`` (TE ignores it then), and ``capturable`` refuses
    ``store_param_remainders=True`` whether or not an FP32 master makes the remainders real. Remainders without
    an FP32 master have no effect (as in TE): that is a ``UserWarning``, not silence.
    """
    master = lookup_dtype(master_weight_dtype)
    if master not in _MASTER_DTYPES:
        raise ConfigError(
            "master_weight_dtype",
            master_weight_dtype,
            f"FusedAdam only supports fp32/fp16 master weights; {_MASTER_ALLOWED}",
        )
    m = lookup_dtype(exp_avg_dtype)
    if m not in _MOMENT_DTYPES:
        raise ConfigError(
            "exp_avg_dtype", exp_avg_dtype, f"FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg. {_MOMENT_ALLOWED}"
        )
    v = lookup_dtype(exp_avg_sq_dtype)
    if v not in _MOMENT_DTYPES:
        raise ConfigError(
            "exp_avg_sq_dtype",
            exp_avg_sq_dtype,
            f"FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg_sq. {_MOMENT_ALLOWED}",
        )
    if capturable:
        if master_weights and master != torch.float32:
            raise ConfigError(
                "master_weight_dtype",
                master_weight_dtype,
                "Capturable mode only supports fp32 master weights. (capturable=True needs fp32)",
            )
        if not (m == v == torch.float32 or m == v == torch.bfloat16):
            raise ConfigError(
                "exp_avg_dtype",
                f"{_spelled(exp_avg_dtype)}/{_spelled(exp_avg_sq_dtype)}",
                "Capturable mode requires exp_avg_dtype and exp_avg_sq_dtype to be both fp32 or both bf16",
            )
        if store_param_remainders:
            raise ConfigError(
                "store_param_remainders", True, "Capturable mode doesn't support storing param remainders"
            )
    if not master_weights and master != torch.float32:  # TE's default: only a chosen other dtype is reported
        warnings.warn(
            f"master_weight_dtype={_spelled(master_weight_dtype)} has no effect without master_weights=True",
            UserWarning,
            stacklevel=1,  # one location: shown once per process, however many callers check the same config
        )
    effective = store_param_remainders and master_weights and master == torch.float32
    if store_param_remainders and not effective:
        warnings.warn(
            "store_param_remainders=True has no effect without master_weights=True and master_weight_dtype=fp32",
            UserWarning,
            stacklevel=1,  # one location: shown once per process, however many callers check the same config
        )
    return StateDtypes(master, m, v, effective)


def _spelled(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


# ------------------------------------------------------------------------------------------- all together
@dataclass(frozen=True)
class AdamOptions:
    """Every FusedAdam constructor option, checked and converted (dtypes as TE takes them)."""

    lr: Any
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    amsgrad: bool
    bias_correction: bool
    adam_w_mode: bool
    capturable: bool
    master_weights: bool
    master_weight_dtype: torch.dtype
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    use_decoupled_grad: bool
    store_param_remainders: bool  # as given; TE and the portable twin derive the effective value themselves

    def te_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of TE's ``FusedAdam.__init__`` (after ``params``)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def check_adam_options(
    *,
    lr: Any,
    betas: Any,
    eps: Any,
    weight_decay: Any,
    amsgrad: Any,
    bias_correction: Any,
    adam_w_mode: Any,
    capturable: Any,
    master_weights: Any,
    master_weight_dtype: Any,
    exp_avg_dtype: Any,
    exp_avg_sq_dtype: Any,
    use_decoupled_grad: Any,
    store_param_remainders: Any,
) -> AdamOptions:
    """Every check a FusedAdam constructor makes before it allocates anything. Raises :class:`ConfigError`."""
    flags = dict(
        amsgrad=amsgrad,
        bias_correction=bias_correction,
        adam_w_mode=adam_w_mode,
        capturable=capturable,
        master_weights=master_weights,
        use_decoupled_grad=use_decoupled_grad,
        store_param_remainders=store_param_remainders,
    )
    check_flags(**flags)
    if amsgrad:
        raise ConfigError("amsgrad", True, "FusedAdam does not support the AMSGrad variant.")
    lr, betas = check_hyperparameters(lr, betas, eps, weight_decay)
    dtypes = check_state_dtypes(
        master_weights=master_weights,
        master_weight_dtype=master_weight_dtype,
        exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
        capturable=capturable,
        store_param_remainders=store_param_remainders,
    )
    return AdamOptions(
        lr=lr,
        betas=betas,
        eps=float(eps),
        weight_decay=float(weight_decay),
        master_weight_dtype=dtypes.master_weight_dtype,
        exp_avg_dtype=dtypes.exp_avg_dtype,
        exp_avg_sq_dtype=dtypes.exp_avg_sq_dtype,
        **flags,
    )


ADAM_ARGUMENTS = tuple(inspect.signature(check_adam_options).parameters)
