"""The twin's kernel arithmetic on CUDA: the GPU's approximate reciprocal and square root (Triton), and
PortableFusedAdam bitwise equal to TE's FusedAdam over every configuration of scripts/compare_backends.py."""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers import kernel_math
from scripts import compare_backends


def _inputs(n: int = 1 << 20) -> torch.Tensor:
    """Positive normal FP32 values over 2^-100 .. 2^100, on CUDA."""
    gen = torch.Generator().manual_seed(0)
    exponent = torch.randint(-100, 100, (n,), generator=gen).float()
    mantissa = 1 + torch.rand(n, generator=gen)
    return (mantissa * torch.exp2(exponent)).cuda()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in FP32 ulps between positive FP32 tensors (their bit patterns are ordered like the values)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@pytest.mark.cuda_only
@pytest.mark.parametrize("op", ["rcp", "sqrt"])
def test_hardware_approximations_are_within_one_ulp_and_not_ieee(op, record):
    if not kernel_math.hardware_approximations("cuda"):
        pytest.skip("Triton not importable: the twin uses correctly rounded values on CUDA")
    x = _inputs()
    approx = getattr(kernel_math, op)(x)
    exact = torch.reciprocal(x) if op == "rcp" else torch.sqrt(x)  # correctly rounded (torch's CUDA ops)
    ulps = _ulps(approx, exact)
    differ = (ulps > 0).float().mean().item()
    record(test="hardware_approximation", case=op, max_ulps=ulps.max().item(), fraction_differing=differ)
    assert ulps.max().item() <= 1, f"{op}: {ulps.max().item()} ulps from the correctly rounded value"
    # Ran the IEEE op, not the PTX approximation: the fraction would be 0 (measured on H200 in the results folder).
    assert differ > 0, f"{op}: identical to the correctly rounded values on 2^20 inputs: not the approximation"


@pytest.mark.parametrize("name", [c.name for c in compare_backends.CONFIGS])
def test_portable_on_cuda_is_bitwise_te(name, record):
    """Every configuration x normal/eps-dominated gradients x lr 1e-2/1e-4, 25 steps: every tensor bitwise."""
    if not kernel_math.hardware_approximations("cuda"):
        pytest.skip("Triton not importable: bitwise agreement needs the GPU's approximations")
    from transformer_engine.pytorch.optimizers import FusedAdam

    config = next(c for c in compare_backends.CONFIGS if c.name == name)
    failed = []
    for grads in compare_backends.GRAD_SCALES:
        for lr in compare_backends.LRS:
            r = compare_backends.run(
                config,
                grads,
                lr,
                cls_a=PortableFusedAdam,
                cls_b=FusedAdam,
                steps=25,
                shapes=compare_backends.SHAPES,
                device="cuda",
            )
            record(test="portable_vs_te_bitwise", case=f"{name}/{grads}/{lr:g}", max_rel=r["max_rel"])
            if not all(r["bitwise"].values()):
                failed.append((grads, lr, r["max_rel"]))
    assert not failed, failed
