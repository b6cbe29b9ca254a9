"""The FP32 arithmetic of Transformer Engine's Adam kernels, in PyTorch (CPU and CUDA alike).

TE 2.20.2's ``multi_tensor/adam.cu`` is built with fast math (its sm_90 SASS in the ``transformer-engine-cu12``
wheel, see docs/te-bf16-moments.md): every FP32 operation flushes subnormals to zero (``.FTZ``), the
multiply-adds are fused (``FFMA``), ``x / bias_correction`` and ``m_hat / denom`` are multiplications by a
reciprocal (``MUFU.RCP``), and ``sqrtf`` is the hardware approximation (``MUFU.SQRT``). This module performs
the same operations in the same order with the same roundings. The two hardware approximations: on CUDA, where
Triton is importable, the same PTX instructions (``rcp.approx.ftz.f32``, ``sqrt.approx.ftz.f32``, which ptxas
turns into those ``MUFU`` instructions) run in a small Triton kernel, so the result is the hardware's; elsewhere
(CPU; CUDA without Triton) they are replaced by the correctly rounded values, each within one FP32 ulp of the
hardware's. Subnormals are kept (flushing them costs several passes per operation; they only occur below
1.2e-38).
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["adam_update", "bias_corrections", "hardware_approximations"]


def fma(a, b, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to FP32 (``FFMA.FTZ``); ``a``, ``b`` FP32 tensors or FP32-exact floats.

    The product of two FP32 values is exact in float64, so the float64 sum is the exact result rounded once.
    Rounding that to FP32 is a second rounding, which can only go wrong when the float64 sum is exactly an FP32
    midpoint (low 29 bits ``1 << 28``) and the float64 rounding was inexact: for those rare elements the exact
    error (TwoSum) breaks the tie.
    """
    c64 = c.double()
    prod = (a.double() if isinstance(a, torch.Tensor) else a) * (b.double() if isinstance(b, torch.Tensor) else b)
    prod = torch.as_tensor(prod, dtype=torch.float64, device=c.device).expand_as(c64)
    s = prod + c64
    tie = (s.view(torch.int64) & 0x1FFFFFFF) == 0x10000000
    if bool(tie.any()):
        ps, cs, ss = prod[tie], c64[tie], s[tie]
        bb = ss - ps
        err = (ps - (ss - bb)) + (cs - bb)
        s = s.clone()
        s[tie] = torch.where(err == 0, ss, torch.nextafter(ss, torch.where(err > 0, torch.inf, -torch.inf).double()))
    return s.float()


@functools.cache
def _triton_kernel():
    """The Triton kernel that applies ``rcp.approx.ftz.f32`` or ``sqrt.approx.ftz.f32`` element-wise (the PTX that
    nvcc emits for TE's fast-math divisions and ``sqrtf``); ``None`` without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def approx(x_ptr, y_ptr, n, SQRT: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask, other=1.0)
        if SQRT:
            y = tl.inline_asm_elementwise(
                "sqrt.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            y = tl.inline_asm_elementwise(
                "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
            )
        tl.store(y_ptr + offsets, y, mask=mask)

    return approx


def hardware_approximations(device: torch.device | str) -> bool:
    """Whether :func:`rcp` and :func:`sqrt` compute the GPU's approximations on ``device`` (CUDA with Triton)."""
    return torch.device(device).type == "cuda" and _triton_kernel() is not None


@functools.cache
def _warn_no_triton() -> None:
    warnings.warn(
        "PortableFusedAdam on CUDA without Triton: reciprocals and square roots are correctly rounded instead of "
        "the GPU's approximations that TE's kernel uses (within one FP32 ulp; results may differ from TE's "
        "FusedAdam by that). Install triton to compute them as TE does.",
        stacklevel=4,
    )


def _approx(x: torch.Tensor, sqrt: bool) -> torch.Tensor:
    if x.device.type == "cuda":
        kernel = _triton_kernel()
        if kernel is not None:
            src = x.detach().to(torch.float32).contiguous()
            out = torch.empty_like(src)
            n = src.numel()
            if n:
                block = 1024
                with torch.cuda.device(src.device):  # Triton launches on the current device
                    kernel[(-(-n // block),)](src, out, n, SQRT=sqrt, BLOCK=block)
            return out
        _warn_no_triton()
    return torch.sqrt(x) if sqrt else torch.reciprocal(x)


def rcp(x: torch.Tensor) -> torch.Tensor:
    """``MUFU.RCP`` (``rcp.approx.ftz.f32``): the hardware's on CUDA with Triton, else correctly rounded."""
    return _approx(x, sqrt=False)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """``MUFU.SQRT`` (``sqrt.approx.ftz.f32``): the hardware's on CUDA with Triton, else correctly rounded."""
    return _approx(x, sqrt=True)


def bias_corrections(beta1: float, beta2: float, step, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``1 - beta**step`` in float64 from the FP32 betas, rounded to FP32, as host and capturable kernels do.

    The host code calls ``std::pow(float, int)`` (double); the capturable kernels' ``pow`` also runs in
    double (``DADD``/``CALL`` in their SASS) before ``F2F.F32.F64``. ``step`` is an int or an int tensor.
    """
    step = torch.as_tensor(step, device=device).to(torch.float64)
    b = torch.tensor([beta1, beta2], dtype=torch.float32, device=device).double()
    out = (1.0 - torch.pow(b.reshape(2, *([1] * step.dim())), step)).float()
    return out[0], out[1]


def adam_update(g, p, m, v, *, beta1, beta2, bc1, bc2, eps, lr, decay, adam_w_mode: bool, capturable: bool = False):
    """One element-wise Adam step in FP32 as the kernel computes it; returns new ``(p, m, v)``.

    ``beta1``, ``beta2``, ``eps``, ``decay`` are FP32-exact floats; ``bc1``, ``bc2`` and ``lr`` FP32 floats or
    tensors. Operation by operation (kernel's ``AdamFunctor``/``AdamFunctorMaster``/``...ParamRemainder``/
    ``AdamCapturable...``, identical bodies):
    L2: ``g = fma(decay, p, g)``; ``m = fma(beta1, m, (1-beta1)*g)``; ``v = fma(beta2, v, ((1-beta2)*g)*g)``;
    ``denom = sqrt(v * rcp(bc2)) + eps``; ``u = (m * rcp(bc1)) * rcp(denom)``; AdamW: ``u = fma(decay, p, u)``;
    ``p = fma(-u, lr, p)``, except that the capturable kernels (``capturable=True``: ``lr`` read from memory)
    round ``lr * u`` first: ``p = p - lr * u`` (their SASS: ``FMUL.FTZ`` then ``FADD.FTZ``).
    """
    one_minus_b1 = 1.0 - beta1  # FADD.FTZ 1 - beta: exact for beta in [0.5, 1]; rounded like the kernel else
    one_minus_b2 = 1.0 - beta2
    one_minus_b1 = float(torch.tensor(one_minus_b1, dtype=torch.float32))
    one_minus_b2 = float(torch.tensor(one_minus_b2, dtype=torch.float32))
    if not adam_w_mode:
        g = fma(p, decay, g)
    m = fma(m, beta1, g * one_minus_b1)
    v = fma(v, beta2, (g * one_minus_b2) * g)
    if not isinstance(bc1, torch.Tensor):
        bc1 = torch.tensor(bc1, dtype=torch.float32, device=g.device)
        bc2 = torch.tensor(bc2, dtype=torch.float32, device=g.device)
    denom = sqrt(v * rcp(bc2)) + eps
    update = (m * rcp(bc1)) * rcp(denom)
    if adam_w_mode:
        update = fma(p, decay, update)
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device=g.device, dtype=torch.float32).reshape(())
    if capturable:  # the capturable kernels: FMUL.FTZ lr * u, then FADD.FTZ p - that (two roundings)
        p = p - update * lr
    else:  # the others: FFMA.FTZ (one rounding)
        p = fma(-update, lr, p)
    return p, m, v
