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


# Documented tolerances (docs/testing.md): max relative error of the parameters after 20 steps against float64,
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
    (  # refused without master weights too (stricter than TE: the value could never take effect)
        dict(capturable=True, store_param_remainders=True),
        "Capturable mode doesn't support storing param remainders",
    ),
]


@pytest.mark.parametrize("kw,message", INVALID)
def test_invalid_combinations_raise_te_errors(kw, message):
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(".", r"\.")):
        PortableFusedAdam(make_params(torch.float32), **kw)


def test_step_errors_match_te():
    p16 = torch.nn.Parameter(torch.randn(3).half())
    pbf = torch.nn.Parameter(torch.randn(3).half())
    opt = PortableFusedAdam([p16, pbf])  # a group of FP16 and BF16 is refused here; a cast after it is step()'s
    pbf.data = pbf.data.bfloat16()
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


# ---------------------------------------------------------------- the parts of the update rule, one at a time
# An independent float64 reference of the kernel's rule: hyperparameters are FP32 kernel arguments (rounded to
# FP32), the bias corrections 1 - beta**step are rounded to FP32, everything else is exact (float64).


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def kernel_rule(
    p0,
    grads,
    *,
    lr,
    betas,
    eps,
    weight_decay=0.0,
    adam_w_mode=True,
    bias_correction=True,
    round_bias_corrections=True,
    fp64_betas_in_bias_corrections=False,
):
    """Parameters (float64) after ``len(grads)`` steps of the kernel's rule from ``p0`` (float64 tensors)."""
    b1, b2 = (f32(b) for b in betas)
    c1, c2 = betas if fp64_betas_in_bias_corrections else (b1, b2)
    lr, eps, wd = f32(lr), f32(eps), f32(weight_decay)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if not adam_w_mode:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - c1**t, 1 - c2**t) if bias_correction else (1.0, 1.0)
        if round_bias_corrections:
            bc1, bc2 = f32(bc1), f32(bc2)
        update = (m / bc1) / ((v / bc2).sqrt() + eps)
        if adam_w_mode:
            update = update + wd * p
        p = p - lr * update
    return p


def steps_of(opt, params, grads_per_step):
    for gs in grads_per_step:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def test_eps_is_added_to_sqrt_of_v_hat_with_eps_dominated_gradients():
    """Gradients ~1e-10: sqrt(v_hat) ~ 1e-10 << eps = 1e-8, so the step is m_hat / eps (~1e-2 lr)."""
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(64, generator=gen) * 1e-10] for _ in range(5)]
    p = torch.nn.Parameter(torch.zeros(64))  # the parameter is minus the accumulated update: no cancellation
    steps_of(PortableFusedAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), [p], grads)
    ref = kernel_rule(
        torch.zeros(64, dtype=torch.float64), [g[0] for g in grads], lr=1e-3, betas=(0.9, 0.999), eps=1e-8
    )
    assert ref.abs().max() > 1e-6  # eps dominates: each step moves by ~lr * |g| / eps ~ 1e-5
    err = rel_err(p, ref)
    assert err < 5e-7, err  # measured max rel err 5.6e-8 on torch 2.13 CPU


def test_bias_corrections_use_the_fp32_betas_rounded_to_fp32():
    """beta2 = 0.999 is not an FP32 number: the kernel's moments and its bias corrections both use the FP32 beta
    (0.99900001...), so after one step v_hat = g**2 exactly and |update| = 1; bias corrections from the float64
    beta would make it 1 - 6.4e-6."""
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(64, generator=gen)] for _ in range(4)]
    p = torch.nn.Parameter(torch.zeros(64))
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-12)
    steps_of(PortableFusedAdam([p], weight_decay=0.0, **hp), [p], grads)
    g = [x[0] for x in grads]
    ref = kernel_rule(torch.zeros(64, dtype=torch.float64), g, **hp)
    err = rel_err(p, ref)
    assert err < 1e-6, err  # measured max rel err 1.8e-7 on torch 2.13 CPU
    unrounded = kernel_rule(torch.zeros(64, dtype=torch.float64), g, round_bias_corrections=False, **hp)
    mixed = kernel_rule(torch.zeros(64, dtype=torch.float64), g, fp64_betas_in_bias_corrections=True, **hp)
    assert rel_err(unrounded, ref) < 1e-7  # rounding 1 - beta**t itself: measured 1.2e-8
    assert rel_err(mixed, ref) > 3e-6  # float64 betas in the corrections: measured 6.7e-6


def test_capturable_with_bias_correction_and_another_lr():
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(40, generator=gen)] for _ in range(6)]
    hp = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    p0 = torch.randn(40, generator=gen)
    p = torch.nn.Parameter(p0.clone())
    opt = PortableFusedAdam([p], capturable=True, **hp)
    steps_of(opt, [p], grads)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and int(opt.param_groups[0]["step"]) == 6
    ref = kernel_rule(p0.double(), [g[0] for g in grads], **hp)
    err = rel_err(p.detach(), ref)
    assert err < 5e-7, err  # measured max rel err 6.1e-8 on torch 2.13 CPU
    plain = torch.nn.Parameter(p0.clone())
    steps_of(PortableFusedAdam([plain], **hp), [plain], grads)
    # TE's capturable kernels round lr * u before subtracting it (FMUL + FADD in their SASS), the others fuse it
    # (FFMA): the two differ in the last bit of some elements (measured here: 1 of 40 after 6 steps, 1 ulp)
    ulps = (p.detach().view(torch.int32).long() - plain.detach().view(torch.int32).long()).abs()
    assert 0 < ulps.max().item() <= 4, ulps.max().item()


def test_capturable_steps_with_each_group_s_lr_tensor_as_a_scheduler_sets_it():
    """Two groups with their own lr, scaled every step by LambdaLR (which fills each group's lr tensor in place):
    the capturable step follows them as the plain one does, to the last bits its lr * u rounding changes."""
    gen = torch.Generator().manual_seed(11)
    p0 = [torch.randn(40, generator=gen), torch.randn(24, generator=gen)]
    grads = [[torch.randn(40, generator=gen), torch.randn(24, generator=gen)] for _ in range(6)]

    def trained(capturable: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in p0]
        groups = [{"params": [params[0]], "lr": 3e-3}, {"params": [params[1]], "lr": 2e-2}]
        opt = PortableFusedAdam(groups, lr=1e-3, weight_decay=0.05, capturable=capturable)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        for g in grads:
            for p, grad in zip(params, g):
                p.grad = grad.clone()
            opt.step()
            schedule.step()
        return [p.detach() for p in params]

    for got, plain in zip(trained(True), trained(False)):
        ulps = (got.view(torch.int32).long() - plain.view(torch.int32).long()).abs()
        assert ulps.max().item() <= 4, ulps.max().item()  # the FMUL + FADD rounding: measured <= 1 ulp


def test_l2_mode_with_bf16_params_decays_the_fp32_master():
    gen = torch.Generator().manual_seed(6)
    grads = [[torch.randn(48, generator=gen)] for _ in range(10)]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5)
    p0 = torch.randn(48, generator=gen).bfloat16()
    p = torch.nn.Parameter(p0.clone())
    opt = PortableFusedAdam([p], adam_w_mode=False, master_weights=True, **hp)
    steps_of(opt, [p], [[g[0].bfloat16()] for g in grads])
    ref = kernel_rule(p0.double(), [g[0].bfloat16() for g in grads], adam_w_mode=False, **hp)
    master = opt.state[p]["master_param"]
    assert rel_err(master, ref) < 1e-6, rel_err(master, ref)  # measured 1.2e-7 on torch 2.13 CPU
    # the BF16 parameter is the master rounded to nearest: parameter tolerance, one BF16 rounding (2**-9)
    assert rel_err(p.detach(), ref) < 2**-8, rel_err(p.detach(), ref)  # measured 2.2e-3
    assert torch.equal(p.detach(), master.bfloat16())


NEG_EXTREME = torch.tensor([0.25, -3.0, 1.5, 2.999, -0.001, 0.0])  # absmax 3.0 is the negative -3.0
NEG_STEP = torch.tensor([0.5, -3.0, 1.5, 2.9, -1.0, 0.75])  # no element that FP8 flushes to zero


@pytest.mark.parametrize("dtype,max_range", [(torch.float16, 65504.0 / 2), (FP8, 448.0)], ids=["fp16", "fp8"])
def test_scaling_with_a_negative_extreme(dtype, max_range):
    p = torch.nn.Parameter(torch.zeros(6))
    opt = PortableFusedAdam([p], exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    opt.set_scaled_state(p, "exp_avg", NEG_EXTREME.clone())
    scale = opt._scales[p]["exp_avg"]
    assert scale.item() == f32(3.0 / max_range)
    stored = opt.state[p]["exp_avg"].float()
    assert stored[1].item() == pytest.approx(-max_range, rel=2**-10)  # the extreme uses the whole range
    back = opt.get_unscaled_state(p, "exp_avg")
    tol = 2**-11 if dtype == torch.float16 else 2**-4  # an ulp of the format; measured 1.6e-4 (FP16), 3.0e-3 (FP8)
    assert (back - NEG_EXTREME).abs().max().item() <= tol * 3.0
    # through a step: negative-dominant gradients give a negative-extreme exp_avg; parameter tolerance
    q, r = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(6))
    lo = PortableFusedAdam([q], lr=1e-2, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    hi = PortableFusedAdam([r], lr=1e-2)
    steps_of(lo, [q], [[NEG_STEP.clone()]] * 3)
    steps_of(hi, [r], [[NEG_STEP.clone()]] * 3)
    assert lo.get_unscaled_state(q, "exp_avg")[1] < 0
    # parameter tolerance: measured max rel err 4.2e-5 (FP16 states) and 1.4e-2 (FP8 states) on torch 2.13 CPU
    assert rel_err(q.detach(), r.detach().double()) < (2e-4 if dtype == torch.float16 else 5e-2)


def test_fp8_uses_the_full_448_range_and_never_exceeds_it():
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = PortableFusedAdam([p], exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8)
    gen = torch.Generator().manual_seed(7)
    for values in (torch.randn(1000, generator=gen), torch.randn(1000, generator=gen) * 1e-30, -torch.rand(1000)):
        opt.set_scaled_state(p, "exp_avg", values)
        stored = opt.state[p]["exp_avg"].float()
        assert stored.abs().max().item() == 448.0  # the extreme lands on E4M3's largest finite value
        assert torch.isfinite(stored).all()


def test_kernel_fma_rounds_once():
    """(1 + 2**-12)**2 = 1 + 2**-11 + 2**-24 is an FP32 midpoint; + 2**-60 puts the exact sum just above it, so
    one rounding goes up, while rounding to float64 first loses the 2**-60 and the tie then goes to even."""
    from optim_factory.optimizers import kernel_math

    a = torch.tensor([1 + 2**-12], dtype=torch.float32)
    c = torch.tensor([2**-60], dtype=torch.float32)
    assert kernel_math.fma(a, a, c).item() == 1 + 2**-11 + 2**-23
    assert ((a.double() * a.double() + c.double()).float()).item() == 1 + 2**-11  # the double-rounded value


SLICED_CONFIGS = {
    "fp32": (torch.float32, {}),
    "l2": (torch.float32, dict(adam_w_mode=False)),
    "bf16-master-bf16-moments": (
        torch.bfloat16,
        dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    ),
    "bf16-remainders": (torch.bfloat16, dict(master_weights=True, store_param_remainders=True)),
    "fp16-fp8-moments": (torch.float32, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=FP8)),
    "capturable": (torch.float32, dict(capturable=True)),
}


@pytest.mark.parametrize("name", list(SLICED_CONFIGS))
def test_update_in_slices_equals_one_call(name, monkeypatch):
    """The update runs a slice at a time, small parameters together (bounded float64 temporaries). Slices of 64
    elements (the 1000-element parameter in 16 uneven slices, each smaller one alone), of 100 (20 + 30 + 40
    elements together until the next would not fit, an empty one skipped) and one call over everything give
    bitwise the same parameters and states."""
    from optim_factory.optimizers import updates

    dtype, kw = SLICED_CONFIGS[name]
    results = []
    for size in (64, 100, 1 << 30):
        monkeypatch.setattr(updates, "UPDATE_SLICE", size)
        params = make_params(dtype, shapes=[(40, 25), (33,), (20,), (30,), (0,), (8, 5)])
        opt = run_portable(params, 5, **HP, **kw)
        results.append((params, opt.state_dict()))
    (pa, sa), *others = results
    for pb, sb in others:
        for a, b in zip(pa, pb):
            assert torch.equal(a, b)
        for k, st in sb["state"].items():
            for state_name, v in st.items():
                assert torch.equal(sa["state"][k][state_name], v), (k, state_name)


def test_kernel_rcp_and_sqrt_are_correctly_rounded_off_cuda():
    """Off CUDA (or without Triton) the hardware approximations are replaced by the correctly rounded values;
    on CUDA with Triton, tests/gpu/test_kernel_math_cuda.py checks the approximations themselves."""
    from optim_factory.optimizers import kernel_math

    x = torch.rand(1000, dtype=torch.float32) * 100 + 1e-3
    assert not kernel_math.hardware_approximations("cpu")
    assert torch.equal(kernel_math.rcp(x), torch.reciprocal(x))
    assert torch.equal(kernel_math.sqrt(x), torch.sqrt(x))


def test_fp8_state_unscales_with_the_reciprocal_of_its_quantizing_scale():
    """TE quantizes with q = 1 / (absmax / 448) and unscales with __frcp_rn(q) (its cast kernel's scale_inv),
    which is not always absmax / 448: the twin stores and unscales the same way."""
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = PortableFusedAdam([p], exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8)
    opt.initialize_state(p, False)
    hits = 0
    for seed in range(50):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * 10 ** (seed % 7 - 3)
        opt.set_scaled_state(p, "exp_avg", x)
        q = torch.reciprocal(x.abs().max() / 448.0)
        expected = (x * q).clamp(-448, 448).to(torch.float8_e4m3fn).float() * torch.reciprocal(q)
        assert torch.equal(opt.get_unscaled_state(p, "exp_avg"), expected), seed
        hits += int(torch.reciprocal(q) != x.abs().max() / 448.0)
    assert hits > 0  # the case that tells the two apart occurred (measured: 6 of the 50)
