"""FusedAdam: Transformer Engine's FusedAdam with an opt-in ``state_dict_cpu_offload``.

TE is an optional dependency. Without it this module still imports, and constructing :class:`FusedAdam`
raises one :class:`ImportError` that says how to install TE and points to :class:`PortableFusedAdam`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from optim_factory.optimizers.amp import scaler_for_step
from optim_factory.optimizers.constructor import check_constructor
from optim_factory.optimizers.export import OffloadedStateDict, Pinning, local_tensor
from optim_factory.rules.groups import CheckedParamGroups

__all__ = ["FusedAdam", "TE_AVAILABLE", "te_import_error"]

try:  # TE can fail with ImportError, or with other errors from a broken install; report either.
    from transformer_engine.pytorch.optimizers import FusedAdam as _TEFusedAdam

    TE_AVAILABLE = True
    _TE_ERROR: BaseException | None = None
except Exception as exc:  # noqa: BLE001
    _TEFusedAdam = torch.optim.Optimizer  # type: ignore[assignment,misc]
    TE_AVAILABLE = False
    _TE_ERROR = exc

TE_INSTALL_HINT = (
    "optim_factory.FusedAdam needs NVIDIA Transformer Engine (a CUDA machine): "
    "pip install --no-build-isolation 'transformer_engine[pytorch]' "
    "(see https://github.com/NVIDIA/TransformerEngine); "
    "without TE, use optim_factory.PortableFusedAdam (pure PyTorch, same options) or backend=portable"
)


def te_import_error() -> str | None:
    """Why Transformer Engine could not be imported (``None`` when it was)."""
    return None if _TE_ERROR is None else f"{type(_TE_ERROR).__name__}: {_TE_ERROR}"


class FusedAdam(OffloadedStateDict, CheckedParamGroups, _TEFusedAdam):  # type: ignore[misc,valid-type]
    """``transformer_engine.pytorch.optimizers.FusedAdam`` plus the keyword-only export options.

    ``state_dict_cpu_offload`` (default ``False``: ``state_dict()`` is TE's own) exports to CPU, streamed in
    chunks of ``state_dict_offload_chunk_bytes`` (64 MiB by default; the GPU holds at most two, and conversion
    overlaps the device-to-host copies; ``0``: one converted FP32 state at a time);
    ``state_dict_offload_reuse_buffers`` exports into pooled host buffers that ``release_state_dict()`` gives
    back, pinned as ``state_dict_offload_pinning`` says; ``state_dict_offload_background`` fills a chunked export
    on a background thread, which ``step()`` waits for (see :mod:`optim_factory.optimizers.export`);
    ``state_dict_offload_host_budget`` bounds the host bytes of a save through :mod:`optim_factory.checkpoint`.
    Everything else, including the CUDA kernels of ``step()``, is TE's.

    The constructor also takes dtypes as strings (``bf16``, ``torch.bfloat16``, ``fp8`` ...) and sizes as
    ``"64MiB"``, and checks every option as :class:`PortableFusedAdam` does (see
    :mod:`optim_factory.rules`) before Transformer Engine is needed, so a Hydra ``_target_`` block
    that names this class builds it.

    Empty local shards (a parameter with fewer rows than FSDP2 ranks, or a 0-element parameter) step, export,
    load and continue in every state configuration. Read against TE 2.20.2's ``optimizers/fused_adam.py``:

    * ``_apply_scale`` (overridden): TE's ``min_val, max_val = torch.aminmax(unscaled_state)`` raises on an
      empty tensor. It is reached for FP16/FP8 states from ``step()``'s "Scaling" loop and from
      ``set_scaled_state`` (``initialize_state``'s FP16 master, ``load_state_dict``, ``load_exported_state``).
      An empty state has nothing to store: the override returns before TE's code, the state and its scale stay
      as they are (as in :class:`PortableFusedAdam`). Non-empty states run TE's code unchanged.
    * ``step()`` (not overridden): TE's ``multi_tensor_applier`` (``optimizers/multi_tensor_apply.py``,
      ``keep_slot = [tensor.numel() > 0 ...]``) drops zero-element slots from every tensor list before a
      kernel launch, as its ``multi_tensor_apply.cuh`` requires (``NVTE_CHECK(chunks_this_tensor > 0, ...)``).
    * FP8 states (not overridden): ``_initialize_state``'s ``quantizer.make_empty(...)`` / ``quantize_`` and
      ``get_unscaled_state``'s ``.float()`` take empty tensors (``Float8Quantizer::quantize`` and
      ``_FromFloat8Func`` return early for ``numel() == 0``).
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
        # TE 2.20's signature (the portable twin's too). Checked and converted before TE is needed: a bad
        # value gets its one-line reason on a machine without TE as well; TE then receives torch dtypes.
        options, export_options = check_constructor(locals())
        if not TE_AVAILABLE:
            raise ImportError(f"{TE_INSTALL_HINT} (import failed: {te_import_error()})")
        self.adam_options = options  # the checked constructor options (param groups are checked against them)
        self._init_export(export_options)
        super().__init__(params, **options.te_kwargs(), set_grad_none=set_grad_none)
        self._check_param_groups()
        self._warn_without_gpu()
        self._start_export_threads()

    def step(self, closure=None, grad_scaler=None):
        """TE's ``step()``, after a background export (``state_dict_offload_background``) has finished.

        TE's signature: ``torch.amp.GradScaler.step`` passes itself as ``grad_scaler`` only to a ``step`` that names
        that argument (to a ``step(*args, **kwargs)`` the scaler sets ``opt.grad_scale``, which TE never reads, so a
        capturable step would run on scaled gradients and not skip on overflow). Gradients that ``scaler.unscale_``
        already unscaled are not unscaled again (:mod:`optim_factory.optimizers.amp`)."""
        self._wait_and_settle()
        return super().step(closure, scaler_for_step(grad_scaler, self))

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool) -> None:
        """TE's ``initialize_state``, except that an FP32 master of a plain parameter is converted into its state
        directly: TE's ``set_scaled_state(param, ..., param.clone().detach().float())`` holds a temporary of 6 bytes
        per element of the parameter (the largest one sets the peak of a state initialisation). Bitwise the same:
        a BF16 or FP16 value converts to FP32 exactly."""
        local = local_tensor(param)
        plain = type(local) in (torch.Tensor, torch.nn.Parameter)  # TE's quantized parameters: TE's own path
        if not (plain and self.master_weights and not store_param_remainders) or (
            self.name_to_dtype_map["master_param"] != torch.float32
        ):
            return super().initialize_state(param, store_param_remainders)
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        self._initialize_state(param, "master_param", zero_buffer=False)
        local_tensor(self.state[param]["master_param"]).copy_(local.detach())

    def _on_device_state_dict(self) -> dict[str, Any]:
        return _TEFusedAdam.state_dict(self)

    def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
        """TE's ``_apply_scale``, except that an empty state (an empty local shard) is left as it is.

        Guards TE 2.20.2's ``torch.aminmax(unscaled_state)`` in ``_apply_scale``, which raises
        ``aminmax(): cannot compute aminmax over an empty dimension`` (see the class docstring).
        """
        if unscaled_state.numel() == 0:
            return
        super()._apply_scale(state_name, unscaled_state, scaled_state, scale)
