"""The export contract (docs/export.md) on PortableFusedAdam, CPU: lifecycle over the option matrix."""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers.export import ExportOptions, ExportPlan, export_state
from tests.helpers import (
    LIFECYCLE_CONFIGS,
    LiveSnapshot,
    assert_bitwise,
    assert_state_dicts_bitwise,
    clone_params,
    deep_clone,
    local,
    make_params,
    run_steps,
)

CASES = [
    pytest.param(name, dtype, kw, offload, id=f"{name}-offload{'On' if offload else 'Off'}")
    for name, dtype, kw in LIFECYCLE_CONFIGS
    for offload in (False, True)
]


def _aliases_live(sd: dict, opt) -> bool:
    live_ptrs = {
        local(v).untyped_storage().data_ptr()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.numel()
    }
    return any(
        local(v).untyped_storage().data_ptr() in live_ptrs
        for st in sd["state"].values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


@pytest.mark.parametrize("name,dtype,kw,offload", CASES)
def test_lifecycle(name, dtype, kw, offload):
    params = make_params(dtype)
    opt = PortableFusedAdam(params, lr=1e-2, weight_decay=0.1, state_dict_cpu_offload=offload, **kw)
    run_steps(opt, params, 0, 3)

    before = LiveSnapshot.take(opt)
    exports = [opt.state_dict() for _ in range(3)]
    reference = deep_clone(export_state(opt, cpu_offload=False))  # the option-off (TE) export
    LiveSnapshot.take(opt).assert_same(before)

    for sd in exports:
        assert_state_dicts_bitwise(sd, reference, name)
        for st in sd["state"].values():
            for state_name, v in st.items():
                remainder = (
                    state_name == "master_param" and kw.get("store_param_remainders") and dtype == torch.bfloat16
                )
                assert v.dtype == (torch.int16 if remainder else torch.float32), (state_name, v.dtype)
                assert v.device.type == "cpu"
        if offload:
            assert not _aliases_live(sd, opt), "offloaded export aliases live state"
            for g in sd["param_groups"]:
                for k, v in g.items():
                    if isinstance(v, torch.Tensor):
                        assert not any(v is lg[k] for lg in opt.param_groups)
    assert len(exports[0]["state"]) == len(params)

    # restore into a fresh optimizer; N further steps equal an uninterrupted run, bitwise
    restored_params = clone_params(params)
    restored = PortableFusedAdam(restored_params, lr=1e-2, weight_decay=0.1, state_dict_cpu_offload=offload, **kw)
    restored.load_state_dict(exports[1])
    run_steps(opt, params, 3, 4)
    run_steps(restored, restored_params, 3, 4)
    for a, b in zip(params, restored_params):
        assert_bitwise(a, b, f"{name} param after resume")
    assert_state_dicts_bitwise(deep_clone(opt.state_dict()), deep_clone(restored.state_dict()), name)
    # the exported dictionaries are not disturbed by loading or further steps when offloaded
    if offload:
        assert_state_dicts_bitwise(exports[0], exports[2], name)


@pytest.mark.parametrize("name,dtype,kw", [c[:3] for c in LIFECYCLE_CONFIGS][:6])
def test_offload_export_is_independent_copy(name, dtype, kw):
    """Mutating an offloaded export never reaches the live optimizer."""
    params = make_params(dtype)
    opt = PortableFusedAdam(params, lr=1e-2, state_dict_cpu_offload=True, **kw)
    run_steps(opt, params, 0, 2)
    before = LiveSnapshot.take(opt)
    sd = opt.state_dict()
    for st in sd["state"].values():
        for v in st.values():
            v.fill_(123)
    LiveSnapshot.take(opt).assert_same(before)


def test_capturable_lr_and_step_stay_tensors_on_param_device():
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, lr=1e-2, capturable=True, state_dict_cpu_offload=True)
    run_steps(opt, params, 0, 2)
    lr_obj, step_obj = opt.param_groups[0]["lr"], opt.param_groups[0]["step"]
    sd = opt.state_dict()
    assert opt.param_groups[0]["lr"] is lr_obj and opt.param_groups[0]["step"] is step_obj
    assert isinstance(sd["param_groups"][0]["lr"], torch.Tensor) and sd["param_groups"][0]["lr"] is not lr_obj
    assert int(sd["param_groups"][0]["step"]) == 2
    fresh_params = clone_params(params)
    fresh = PortableFusedAdam(fresh_params, lr=1e-2, capturable=True)
    fresh.load_state_dict(sd)
    assert isinstance(fresh.param_groups[0]["lr"], torch.Tensor)
    assert fresh.param_groups[0]["lr"].device == params[0].device
    assert int(fresh.param_groups[0]["step"]) == 2


@pytest.mark.parametrize("offload", [False, True])
def test_edge_cases_no_grad_zero_element_groups_repeated(offload):
    gen = torch.Generator().manual_seed(3)
    p_nograd = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
    p_empty = torch.nn.Parameter(torch.empty(0, 7))
    p_a = torch.nn.Parameter(torch.randn(6, generator=gen))
    p_b = torch.nn.Parameter(torch.randn(2, 5, generator=gen))
    groups = [
        {"params": [p_a, p_nograd], "weight_decay": 0.0},
        {"params": [p_empty, p_b], "lr": 5e-3},
    ]
    kw = dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16, state_dict_cpu_offload=offload)
    opt = PortableFusedAdam(groups, lr=1e-2, weight_decay=0.05, **kw)
    empty_sd = opt.state_dict()
    assert empty_sd["state"] == {}
    assert [g["params"] for g in empty_sd["param_groups"]] == [[0, 1], [2, 3]]

    for step in range(3):
        gen_g = torch.Generator().manual_seed(100 + step)
        for p in (p_a, p_b, p_empty):
            p.grad = torch.randn(p.shape, generator=gen_g)
        p_nograd.grad = None
        opt.step()
    # TE initialises state for every parameter it visits, with or without a gradient
    sd1, sd2 = opt.state_dict(), opt.state_dict()  # repeated exports, no step in between
    assert_state_dicts_bitwise(sd1, sd2)
    assert sd1["state"][2]["exp_avg"].shape == (0, 7)
    assert torch.equal(sd1["state"][1]["exp_avg"], torch.zeros(4, 3))  # no gradient yet: zero moments
    assert sd1["param_groups"][1]["lr"] == 5e-3 and sd1["param_groups"][0]["weight_decay"] == 0.0

    clones = [torch.nn.Parameter(p.detach().clone()) for p in (p_a, p_nograd, p_empty, p_b)]
    fresh = PortableFusedAdam(
        [{"params": clones[:2], "weight_decay": 0.0}, {"params": clones[2:], "lr": 5e-3}],
        lr=1e-2,
        weight_decay=0.05,
        **kw,
    )
    fresh.load_state_dict(deep_clone(sd1))
    assert_state_dicts_bitwise(deep_clone(fresh.state_dict()), deep_clone(sd1))


def test_state_dict_before_any_step_and_partial_state():
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, lr=1e-2, state_dict_cpu_offload=True)
    assert opt.state_dict()["state"] == {}
    fresh = PortableFusedAdam(clone_params(params), lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    assert len(fresh.state) == 0


def test_load_does_not_mutate_callers_dict():
    params = make_params(torch.float32)
    kw = dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=FP8_ALIAS)
    opt = PortableFusedAdam(params, lr=1e-2, **kw)
    run_steps(opt, params, 0, 2)
    sd = deep_clone(opt.state_dict())
    keep = deep_clone(sd)
    PortableFusedAdam(clone_params(params), lr=1e-2, **kw).load_state_dict(sd)
    assert_state_dicts_bitwise(sd, keep)


FP8_ALIAS = torch.float8_e4m3fn  # accepted as a synonym of TE's torch.uint8


def test_fp8_storage_and_alias():
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=FP8_ALIAS)
    run_steps(opt, params, 0, 1)
    st = opt.state[params[0]]
    assert st["exp_avg"].dtype == torch.float8_e4m3fn and st["exp_avg_sq"].dtype == torch.float8_e4m3fn
    assert opt.name_to_dtype_map["exp_avg_sq"] == torch.uint8
    assert set(opt._scales[params[0]]) == {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("saved_remainders", [True, False])
def test_load_converts_between_int16_remainders_and_fp32_master(saved_remainders):
    """Turning store_param_remainders on or off between save and resume keeps the exact FP32 master."""
    from optim_factory.optimizers.export import join_bf16_remainder

    kw = dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    params = make_params(torch.bfloat16)
    src = PortableFusedAdam(params, lr=1e-2, store_param_remainders=saved_remainders, **kw)
    run_steps(src, params, 0, 3)
    sd = deep_clone(src.state_dict())
    dst_params = clone_params(params)
    dst = PortableFusedAdam(dst_params, lr=1e-2, store_param_remainders=not saved_remainders, **kw)
    dst.load_state_dict(sd)
    for i, (p_src, p_dst) in enumerate(zip(params, dst_params)):
        src_master = src.state[p_src]["master_param"]
        dst_master = dst.state[p_dst]["master_param"]
        if saved_remainders:  # int16 in the checkpoint → FP32 master now
            assert dst_master.dtype == torch.float32
            assert torch.equal(dst_master, join_bf16_remainder(p_src.detach(), src_master)), i
        else:  # FP32 master in the checkpoint → int16 remainders now
            assert dst_master.dtype == torch.int16
            assert torch.equal(join_bf16_remainder(p_dst.detach(), dst_master), src_master), i
    run_steps(src, params, 3, 3)
    run_steps(dst, dst_params, 3, 3)
    for a, b in zip(params, dst_params):
        assert_bitwise(a, b, "param after resume with remainders toggled")


@pytest.mark.parametrize("option", ["reuse_buffers", "background"])
def test_a_plan_without_the_optimizer_s_exporter_refuses_pooled_and_background_exports(option):
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, lr=1e-3)
    run_steps(opt, params, 0, 1)
    options = ExportOptions(True, 64, **{option: True})
    with pytest.raises(ValueError, match=r"^reuse_buffers or background: needs the optimizer's own exporter"):
        ExportPlan(options).export(opt)  # a temporary pool would go with the plan: nothing could be reused
