"""PortableFusedAdam's update rule against torch.optim.AdamW and a float64 reference; TE's validation."""

from __future__ import annotations

import math

import pytest
import torch

from optim_factory import PortableFusedAdam
from tests.helpers import FP8, grads_for, make_params

STEPS = 20
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def reference_adam(params, steps, *, adam_w_mode=True, lr, betas, eps, weight_decay):
    """Adam/AdamW in float64, in the kernel's formulation, on the same (possibly low-precision) grads."""
    ps = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    b1, b2 = betas
    for step in range(steps):
        gs = [g.double() for g in grads_for(step, [p.shape for p in ps], params[0].dtype)]
        t = step + 1
        for p, m, v, g in zip(ps, ms, vs, gs):
            if not adam_w_mode:
                g = g + weight_decay * p
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
            if adam_w_mode:
                update = update + weight_decay * p
            p.sub_(lr * update)
    return ps


def run_portable(params, steps, **kw):
    opt = PortableFusedAdam(params, **kw)
    for step in range(steps):
        for p, g in zip(params, grads_for(step, [p.shape for p in params], params[0].dtype)):
            p.grad = g
        opt.step()
    return opt


def max_rel_err(got, ref):
    return max(((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref))


def test_fp32_matches_torch_adamw_and_float64():
    params = make_params(torch.float32)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = reference_adam(params, STEPS, **HP)
    run_portable(params, STEPS, **HP)
    adamw = torch.optim.AdamW(torch_params, foreach=False, **HP)
    for step in range(STEPS):
        for p, g in zip(torch_params, grads_for(step, [p.shape for p in torch_params], torch.float32)):
            p.grad = g
        adamw.step()
    for ours, theirs, r in zip(params, torch_params, ref):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.double(), r, rtol=1e-5, atol=1e-6)


def test_l2_mode_matches_torch_adam():
    params = make_params(torch.float32)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    run_portable(params, STEPS, adam_w_mode=False, **HP)
    adam = torch.optim.Adam(torch_params, foreach=False, **HP)
    for step in range(STEPS):
        for p, g in zip(torch_params, grads_for(step, [p.shape for p in torch_params], torch.float32)):
            p.grad = g
        adam.step()
    ref = reference_adam(make_params(torch.float32), STEPS, adam_w_mode=False, **HP)
    for ours, theirs, r in zip(params, torch_params, ref):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.double(), r, rtol=1e-5, atol=1e-6)


def test_no_bias_correction_and_capturable_match_plain():
    a, b = make_params(torch.float32), make_params(torch.float32)
    run_portable(a, 5, bias_correction=False, **HP)
    run_portable(b, 5, bias_correction=False, capturable=True, **HP)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


# Documented tolerances (README): max relative error of the parameters after 20 steps against float64,
# relative to the parameter's largest magnitude.
LOW_PRECISION = [
    ("bf16 moments", torch.float32, dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16), 5e-4),
    ("fp16 moments", torch.float32, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16), 5e-5),
    ("fp8 moments", torch.float32, dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8), 1e-2),
    ("bf16 params + fp32 master", torch.bfloat16, dict(master_weights=True), 5e-3),
    ("bf16 params + remainders", torch.bfloat16, dict(master_weights=True, store_param_remainders=True), 5e-3),
    ("bf16 params + fp16 master", torch.bfloat16, dict(master_weights=True, master_weight_dtype=torch.float16), 8e-3),
    ("bf16 params, no master", torch.bfloat16, {}, 5e-2),
]


@pytest.mark.parametrize("name,dtype,kw,tol", LOW_PRECISION, ids=[c[0] for c in LOW_PRECISION])
def test_low_precision_within_documented_tolerance(name, dtype, kw, tol):
    params = make_params(dtype)
    ref = reference_adam(make_params(dtype), STEPS, **HP)
    run_portable(params, STEPS, **HP, **kw)
    err = max_rel_err(params, ref)
    print(f"{name}: max relative error {err:.2e}")
    assert math.isfinite(err) and err < tol, f"{name}: {err:.2e} >= {tol:.0e}"


def test_remainders_reconstruct_fp32_master_exactly():
    """BF16 param + int16 remainder must carry exactly the FP32 master of an FP32-master run."""
    a, b = make_params(torch.bfloat16), make_params(torch.bfloat16)
    opt_a = run_portable(a, STEPS, master_weights=True, **HP)
    opt_b = run_portable(b, STEPS, master_weights=True, store_param_remainders=True, **HP)
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        master_a = opt_a.state[pa]["master_param"]
        rem = opt_b.state[pb]["master_param"]
        assert rem.dtype == torch.int16
        from optim_factory.optimizers.export import join_bf16_remainder

        assert torch.equal(join_bf16_remainder(pb.detach(), rem), master_a)
        assert torch.equal(master_a.bfloat16(), pb.detach())  # the param is the master rounded to nearest


INVALID = [
    (dict(amsgrad=True), "FusedAdam does not support the AMSGrad variant."),
    (dict(master_weights=True, master_weight_dtype=torch.bfloat16), "only supports fp32/fp16 master weights"),
    (dict(exp_avg_dtype=torch.float64), "only supports fp32/fp16/bf16/fp8 exp_avg."),
    (dict(exp_avg_sq_dtype=torch.int8), "only supports fp32/fp16/bf16/fp8 exp_avg_sq."),
    (
        dict(capturable=True, master_weights=True, master_weight_dtype=torch.float16),
        "Capturable mode only supports fp32 master weights.",
    ),
    (
        dict(capturable=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
        "Capturable mode requires exp_avg_dtype and exp_avg_sq_dtype",
    ),
    (dict(capturable=True, exp_avg_dtype=torch.bfloat16), "Capturable mode requires exp_avg_dtype"),
    (dict(capturable=True, exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8), "Capturable mode requires"),
    (
        dict(capturable=True, master_weights=True, store_param_remainders=True),
        "Capturable mode doesn't support storing param remainders",
    ),
]


@pytest.mark.parametrize("kw,message", INVALID)
def test_invalid_combinations_raise_te_errors(kw, message):
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(".", r"\.")):
        PortableFusedAdam(make_params(torch.float32), **kw)


def test_step_errors_match_te():
    p16 = torch.nn.Parameter(torch.randn(3).half())
    pbf = torch.nn.Parameter(torch.randn(3).bfloat16())
    opt = PortableFusedAdam([p16, pbf])
    p16.grad, pbf.grad = torch.ones(3).half(), torch.ones(3).bfloat16()
    with pytest.raises(RuntimeError, match="mix of float16 and bfloat16"):
        opt.step()
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        PortableFusedAdam([p]).step()


def test_decoupled_grad_and_deprecated_set_grad_none():
    a, b = make_params(torch.float32), make_params(torch.float32)
    run_portable(a, 3, **HP)
    opt = PortableFusedAdam(b, use_decoupled_grad=True, **HP)
    for step in range(3):
        for p, g in zip(b, grads_for(step, [p.shape for p in b], torch.float32)):
            p.decoupled_grad = g
        opt.step()
        opt.zero_grad()
        assert all(p.decoupled_grad is None for p in b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        opt2 = PortableFusedAdam(make_params(torch.float32), set_grad_none=False)
    with pytest.raises(ValueError, match="set_to_none=True"):
        opt2.zero_grad(set_to_none=True)
