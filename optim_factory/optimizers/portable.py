"""PortableFusedAdam: Transformer Engine's FusedAdam semantics in plain PyTorch.

Same constructor (plus ``state_dict_cpu_offload``), validation errors, state names and storage dtypes,
scaling rules, ``get_unscaled_state`` / ``set_scaled_state`` / ``initialize_state`` and update rule as TE
2.20's ``transformer_engine.pytorch.optimizers.FusedAdam`` (whose CUDA kernels live in
``transformer_engine/common/multi_tensor/adam.cu``). It runs on CPU and CUDA, with plain tensors and with
DTensor parameters (FSDP2), and its checkpoints interchange with TE's: the exported format is FP32
(BF16 states stay BF16 with ``state_dict_keep_bf16``, which TE's own class cannot load).

Storage and scaling of the states: :mod:`optim_factory.optimizers.scaled_states`.

The update runs in FP32 with the kernel's operation order: bias corrections ``1 - beta**step`` rounded to
FP32; L2 mode adds ``weight_decay * p`` to the gradient, AdamW mode adds it to the update.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.amp import scaler_for_step
from optim_factory.optimizers.constructor import check_constructor
from optim_factory.optimizers.export import (
    OffloadedStateDict,
    Pinning,
    join_bf16_remainder,
    local_tensor,
    split_bf16_remainder,
)
from optim_factory.optimizers.scaled_states import ScaledStates
from optim_factory.optimizers.updates import Update, run_updates
from optim_factory.rules.groups import PARAM_DTYPES, CheckedParamGroups, own_lr_tensor

__all__ = ["PortableFusedAdam"]

_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


class PortableFusedAdam(OffloadedStateDict, ScaledStates, CheckedParamGroups, torch.optim.Optimizer):
    """Adam/AdamW with TE FusedAdam's low-precision states, in pure PyTorch.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate (a tensor on the parameters' device when ``capturable``).
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator.
        weight_decay: weight decay (decoupled in ``adam_w_mode``, L2 otherwise).
        amsgrad: not supported (raises, as TE).
        bias_correction: apply Adam's bias correction.
        adam_w_mode: decoupled weight decay (AdamW) when true, L2 regularisation otherwise.
        capturable: keep ``lr`` and ``step`` as tensors on the parameters' device; accepts ``grad_scaler``.
        master_weights: keep master weights for FP16/BF16 parameters.
        master_weight_dtype: ``torch.float32`` or ``torch.float16`` (or a string: ``fp32``, ``"torch.float16"`` ...).
        exp_avg_dtype: ``torch.float32``, ``torch.float16``, ``torch.bfloat16`` or ``torch.uint8`` (FP8), or a
            string (``fp32|fp16|bf16|fp8``, ``bfloat16``, ``torch.bfloat16``, ``float8_e4m3fn``; see
            :mod:`optim_factory.rules`).
        exp_avg_sq_dtype: as ``exp_avg_dtype``.
        use_decoupled_grad: read gradients from ``param.decoupled_grad`` instead of ``param.grad``.
        store_param_remainders: with BF16 parameters and an FP32 master, store only the master's low 16 bits.
        set_grad_none: deprecated (as in TE); use ``zero_grad(set_to_none=...)``.
        state_dict_cpu_offload: make ``state_dict()`` export to CPU, streamed in chunks.
        state_dict_offload_chunk_bytes: the chunks' size in bytes (an int or a size string such as ``"64MiB"``;
            ``None``: 64 MiB; ``0``: one whole state at a time).
        state_dict_offload_reuse_buffers: export into pooled host buffers (see ``release_state_dict``).
        state_dict_offload_pinning: how pooled buffers of CUDA states are pinned: ``register`` | ``alloc`` | ``none``.
        state_dict_keep_bf16: export BF16 states as BF16 instead of FP32 (half the bytes; TE's class cannot load it).
        state_dict_offload_background: with chunks, fill the export on a background thread (``step()`` waits).
        state_dict_offload_host_budget: the most host bytes a save through ``optim_factory.checkpoint`` holds.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype | str = torch.float32,
        exp_avg_dtype: torch.dtype | str = torch.float32,
        exp_avg_sq_dtype: torch.dtype | str = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
        state_dict_cpu_offload: bool = False,
        state_dict_offload_chunk_bytes: int | str | None = None,
        state_dict_offload_reuse_buffers: bool = False,
        state_dict_offload_pinning: Pinning | str = Pinning.register,
        state_dict_keep_bf16: bool = False,
        state_dict_offload_background: bool = False,
        state_dict_offload_host_budget: int | str | None = None,
    ):
        # TE's checks (same messages) and torch.optim.Adam's, from the one rule module; dtype and size strings.
        o, export_options = check_constructor(locals())
        self.adam_options = o  # the checked constructor options (param groups are checked against them)
        self._init_export(export_options)
        lr, betas, eps, weight_decay = o.lr, o.betas, o.eps, o.weight_decay
        master_weight_dtype, exp_avg_dtype = o.master_weight_dtype, o.exp_avg_dtype
        exp_avg_sq_dtype = o.exp_avg_sq_dtype

        defaults = {
            "lr": torch.as_tensor(lr, dtype=torch.float32).clone() if capturable else lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self._device = local_tensor(first).device if first is not None else torch.device("cpu")
        if capturable:
            for group in self.param_groups:
                own_lr_tensor(group)
            self._step_supports_amp_scaling = True
        self._dummy_overflow_buf = torch.zeros([1], dtype=torch.int, device=self._device)

        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders and master_weights and master_weight_dtype == torch.float32
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn(
                "set_grad_none kwarg in FusedAdam constructor is deprecated. "
                "Use set_to_none kwarg in zero_grad instead.",
                DeprecationWarning,
                stacklevel=2,
            )
        self._check_param_groups()
        self._warn_without_gpu()
        self._start_export_threads()

    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Reset gradients (``param.decoupled_grad`` with ``use_decoupled_grad``)."""
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(
                    f"Called zero_grad with set_to_none={set_to_none}, "
                    f"but FusedAdam was initialized with set_grad_none={self.set_grad_none}"
                )
            set_to_none = self.set_grad_none
        if set_to_none is None:
            set_to_none = True
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Perform one optimisation step (``grad_scaler`` is used in capturable mode, as in TE)."""
        self._wait_and_settle()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        self._check_step_inputs()
        grad_scaler = scaler_for_step(grad_scaler, self)  # gradients scaler.unscale_ already unscaled: scale 1
        for group in self.param_groups:
            if "step" in group:
                group["step"] += 1 if not self.capturable else (self._dummy_overflow_buf != 1).to(torch.int)
            else:
                device = local_tensor(group["params"][0]).device if group["params"] else self._device
                group["step"] = 1 if not self.capturable else torch.ones([1], dtype=torch.int, device=device)
            if not group["params"]:
                continue
            device = local_tensor(group["params"][0]).device
            inv_scale = None
            if self.capturable:
                found_inf = (
                    grad_scaler._check_inf_per_device(self)[device]
                    if grad_scaler is not None
                    else torch.zeros((1,), device=device)
                )
                self._dummy_overflow_buf.copy_(found_inf)
                if grad_scaler is not None:
                    inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
                if bool(self._dummy_overflow_buf.item() == 1):
                    continue  # the capturable kernels return early on overflow
            updates = (self._begin_update(p, remainder, inv_scale) for p, remainder in self._params_with_grads(group))
            run_updates(
                group,
                (u for u in updates if u is not None),
                self._end_update,
                adam_w_mode=self.adam_w_mode == 1,
                capturable=self.capturable,
            )
        return loss

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    def _check_step_inputs(self) -> None:
        """TE's refusals of a step's inputs (its messages), all before anything changes: TE collects a group's
        tensors before its kernels run; checked while updating, a refusal would come after earlier parameters
        were stepped, the step counted and states made."""
        for group in self.param_groups:
            has_fp16 = has_bf16 = False
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients.")
                if isinstance(p, DTensor) != isinstance(grad, DTensor):
                    raise RuntimeError(f"[FusedAdam DTensor Disparity] Parameter {p} and Gradient {grad} do not match!")
                if p.dtype not in PARAM_DTYPES:
                    raise RuntimeError("FusedAdam only support model weights in fp32, fp16, bf16 and fp8")
                has_fp16 = has_fp16 or p.dtype == torch.float16
                has_bf16 = has_bf16 or p.dtype == torch.bfloat16
                if has_fp16 and has_bf16:
                    if self.store_param_remainders:
                        raise RuntimeError(
                            "FusedAdam doesn't support a mix of FP16/BF16 weights + Store param remainder."
                        )
                    raise RuntimeError("FusedAdam does not support a mix of float16 and bfloat16 model weights.")

    def _params_with_grads(self, group: dict):
        """``(param, stores remainders)`` for each parameter of ``group`` with a gradient, its state created at
        its first step."""
        for p in group["params"]:
            remainder = self.store_param_remainders and p.dtype == torch.bfloat16
            if len(self.state[p]) == 0:
                self.initialize_state(p, remainder)
            if self._grad(p) is not None:
                yield p, remainder

    def _begin_update(self, p: torch.Tensor, remainder: bool, inv_scale: torch.Tensor | None) -> Update | None:
        """The FP32 tensors one parameter's update reads and writes: ``g`` and FP32 copies (or the live FP32
        tensors) of the parameter or master, ``exp_avg`` and ``exp_avg_sq``; ``None`` for an empty shard."""
        local_p = local_tensor(p)
        if local_p.numel() == 0:
            return None
        grad = local_tensor(self._grad(p))
        g = grad.float()
        if inv_scale is not None:
            g = g * inv_scale
            grad.copy_(g)
        m = self.get_unscaled_state(p, "exp_avg")
        v = self.get_unscaled_state(p, "exp_avg_sq")
        use_master = self.master_weights and p.dtype != torch.float32
        if use_master and remainder:
            r_p = join_bf16_remainder(local_p, local_tensor(self.state[p]["master_param"]))
        elif use_master:
            r_p = self.get_unscaled_state(p, "master_param")
            if r_p.data_ptr() == local_tensor(self.state[p]["master_param"]).data_ptr():
                r_p = r_p.clone()
        else:
            r_p = local_p.float()
        return Update(p, local_p, remainder, use_master, (g, r_p, m, v))

    def _end_update(self, work: Update) -> None:
        """Store the updated FP32 values in the parameter (and its master or remainder) and the moments."""
        p, local_p = work.param, work.local
        new_p, m, v = work.tensors[1:]
        if work.use_master and work.remainder:
            split_bf16_remainder(new_p, local_p, local_tensor(self.state[p]["master_param"]))
        else:
            local_p.copy_(new_p)
            if work.use_master:
                self.set_scaled_state(p, "master_param", new_p)
        self._store_moment(p, "exp_avg", m)
        self._store_moment(p, "exp_avg_sq", v)

    def _store_moment(self, p: torch.Tensor, name: str, value: torch.Tensor) -> None:
        stored = local_tensor(self.state[p][name])
        if value.data_ptr() != stored.data_ptr():
            self.set_scaled_state(p, name, value)
