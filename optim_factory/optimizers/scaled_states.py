"""How PortableFusedAdam stores its states: TE FusedAdam's storage dtypes and scaling rules, in plain PyTorch
(:class:`ScaledStates`, a mixin of :class:`optim_factory.optimizers.portable.PortableFusedAdam`).

Storage, per state name (``exp_avg``, ``exp_avg_sq``, ``master_param``):

* FP32: the tensor itself; BF16: a ``bfloat16`` tensor, no scale (round-to-nearest from FP32).
* FP16: ``float16`` tensor holding ``x / scale`` with ``scale = absmax(x) / (65504 / 2)`` (FP32, per tensor).
* FP8 (``torch.uint8`` in TE's arguments, ``torch.float8_e4m3fn`` accepted too): E4M3 tensor holding
  ``x / scale`` with ``scale = absmax(x) / 448``, saturated to +-448.
* ``master_param`` with ``store_param_remainders`` and a BF16 parameter: the low 16 bits of the FP32 master
  (``int16``); the high 16 bits are the BF16 parameter itself, rounded to nearest.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.export import local_tensor, wrap_like

__all__ = ["ScaledStates", "FP8_STORAGE_DTYPE"]

FP8_STORAGE_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0
_FP16_RANGE = torch.finfo(torch.float16).max / 2.0


class ScaledStates:
    """TE's ``get_unscaled_state`` / ``set_scaled_state`` / ``initialize_state`` and the storage they read and
    write. The optimizer that mixes it in holds ``state``, ``name_to_dtype_map`` (state name -> the dtype asked
    for), ``_scales`` (param -> state name -> FP32 scale), ``master_weights`` and ``store_param_remainders``."""

    def _is_remainder(self, param: torch.Tensor, state_name: str) -> bool:
        return self.store_param_remainders and state_name == "master_param" and param.dtype == torch.bfloat16

    def _apply_scale(self, state_name: str, unscaled: torch.Tensor, scaled: torch.Tensor, scale: torch.Tensor) -> None:
        """Store FP32 ``unscaled`` into the low-precision ``scaled`` (local tensors), updating ``scale``."""
        if unscaled.dtype != torch.float32:
            raise TypeError(f"unscaled state must be float32, got {unscaled.dtype}")
        if scaled.dtype == torch.bfloat16:
            scaled.copy_(unscaled)  # converted where it is: a host state makes no device temporary
            return
        unscaled = unscaled.to(scaled.device)
        if unscaled.numel() == 0:
            return  # nothing to scale (TE's torch.aminmax would raise here)
        max_range = _FP8_MAX if self.name_to_dtype_map[state_name] == torch.uint8 else _FP16_RANGE
        lo, hi = torch.aminmax(unscaled)
        absmax = torch.maximum(-lo, hi).abs().to(torch.float32)  # abs: never a -0 scale
        # a tensor divisor, as TE's: CUDA divides by a Python number as a product with its rounded reciprocal,
        # one ulp off the quotient for 53 % of absmax values with 448 and 0.14 % with FP16's 32752 (2^20
        # uniform values, exact float32 products on CPU)
        divisor = torch.full_like(absmax, max_range)
        scale.copy_(torch.div(absmax, divisor).reshape(scale.shape))
        rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
        values = unscaled * rscale.reshape(unscaled.shape if unscaled.dim() == 0 else rscale.shape)  # a 0-d state
        if scaled.dtype == FP8_STORAGE_DTYPE:
            values = values.clamp_(-_FP8_MAX, _FP8_MAX)
            # TE's FP8 cast kernel stores scale_inv = __frcp_rn(1 / scale) (common/utils.cuh, reciprocal<float>),
            # and FP8 states unscale with it: the reciprocal of the reciprocal, at times one ulp off ``scale``
            scale.copy_(torch.where(rscale > 0, rscale.reciprocal(), scale))
        scaled.copy_(values)

    def get_unscaled_state(self, param: torch.Tensor, state_name: str, skip_unscale: bool = False) -> torch.Tensor:
        """The state as FP32 (int16 for remainder masters), as a local tensor on the parameter's device.

        FP32 and int16 states are returned as the live tensor (no copy), others as a new tensor. With
        ``skip_unscale``, BF16 states are returned as they are (TE's fused-unscale path).
        """
        stored = local_tensor(self.state[param][state_name])
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.float32:
            expected = torch.int16 if self._is_remainder(param, state_name) else torch.float32
            if stored.dtype != expected:
                raise RuntimeError(f"state {state_name!r} has dtype {stored.dtype}, expected {expected}")
            return stored
        if dtype == torch.bfloat16:
            return stored if skip_unscale else stored.float()
        if dtype in (torch.float16, torch.uint8):
            scale = self._scales[param][state_name]
            return stored.float().mul_(scale.reshape(()) if stored.dim() == 0 else scale)  # TE's FP8 takes 0-d too
        raise RuntimeError(f"Dtype of {state_name} can only be fp8/fp16/bf16/fp32.")

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store an FP32 state (int16 remainders for a remainder master), scaling it if needed."""
        remainder = self._is_remainder(param, state_name)
        expected = torch.int16 if remainder else torch.float32
        if unscaled_state.dtype != expected:
            raise TypeError(f"state {state_name!r} must be {expected}, got {unscaled_state.dtype}")
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False, remainder)
        local_state = local_tensor(self.state[param][state_name])
        unscaled_state = local_tensor(unscaled_state)
        if self.name_to_dtype_map[state_name] != torch.float32:
            self._apply_scale(state_name, unscaled_state, local_state, self._scales[param][state_name])
        else:
            local_state.copy_(unscaled_state)

    def _initialize_state(
        self, param: torch.Tensor, state_name: str, zero_buffer: bool, store_param_remainders: bool = False
    ) -> None:
        dtype = self.name_to_dtype_map[state_name]
        local_param = local_tensor(param)
        if store_param_remainders:
            data = torch.zeros_like(local_param, dtype=torch.int16)
        else:
            storage = FP8_STORAGE_DTYPE if dtype == torch.uint8 else dtype
            make = torch.zeros_like if zero_buffer or dtype == torch.uint8 else torch.empty_like
            data = make(local_param, dtype=storage)
        if isinstance(param, DTensor):
            data = wrap_like(data, param)
        self.state[param][state_name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones(
                [1], dtype=torch.float32, device=local_param.device
            )

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        """Create zeroed moments and (with ``master_weights``) the master copy of ``param``."""
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", False, store_param_remainders)  # zero_buffer=False
            if self.name_to_dtype_map["master_param"] == torch.float32 and not store_param_remainders:
                local_tensor(self.state[param]["master_param"]).copy_(local_tensor(param).detach())  # no temporary
            elif not store_param_remainders:  # scaled (FP16): through set_scaled_state, as TE sets it
                self.set_scaled_state(param, "master_param", local_tensor(param).detach().clone().float())
