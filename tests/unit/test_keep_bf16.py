"""``state_dict_keep_bf16``: BF16 states are exported as BF16 (the stored values, bitwise; half the bytes), in
every export mode; everything else as without the option; loading accepts BF16 or FP32 for any state (issue 17,
item 1)."""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers.export import export_state
from recipes.checkpoint import state_bytes
from tests.helpers import (
    FP8,
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

HP = dict(lr=1e-2, weight_decay=0.1)
BF16_CONFIGS = [c for c in LIFECYCLE_CONFIGS if torch.bfloat16 in c[2].values()]
MODES = {  # name -> export options other than keep_bf16
    "on-device": dict(),
    "per-state": dict(state_dict_cpu_offload=True),
    "chunked": dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=64),
    "chunked+reuse": dict(
        state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=64, state_dict_offload_reuse_buffers=True
    ),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name,dtype,kw", [c[:3] for c in BF16_CONFIGS], ids=[c[0] for c in BF16_CONFIGS])
def test_bf16_states_export_as_stored_and_round_trip_bitwise(name, dtype, kw, mode):
    params = make_params(dtype)
    opt = PortableFusedAdam(params, **HP, **kw, **MODES[mode], state_dict_keep_bf16=True)
    run_steps(opt, params, 0, 3)
    before = LiveSnapshot.take(opt)
    sd = deep_clone(opt.state_dict())
    fp32 = export_state(opt, cpu_offload=True)  # the FP32 export of the same states
    LiveSnapshot.take(opt).assert_same(before)
    for (key, states), p in zip(sd["state"].items(), params):
        for state_name, v in states.items():
            if opt.name_to_dtype_map[state_name] == torch.bfloat16:
                assert_bitwise(v, opt.state[p][state_name], f"{name} {mode} {state_name} exported as stored")
                assert_bitwise(v.float(), fp32["state"][key][state_name], f"{name} {state_name} widens to FP32")
            else:
                assert_bitwise(v, fp32["state"][key][state_name], f"{name} {mode} {state_name} unchanged")
    halved = sum(  # BF16 states: half the bytes of their FP32 export; the rest: the same bytes
        state_bytes(v) // (2 if opt.name_to_dtype_map[n] == torch.bfloat16 else 1)
        for st in fp32["state"].values()
        for n, v in st.items()
    )
    assert state_bytes(sd["state"]) == halved < state_bytes(fp32["state"])

    restored_params = clone_params(params)
    restored = PortableFusedAdam(restored_params, **HP, **kw, **MODES[mode], state_dict_keep_bf16=True)
    restored.load_state_dict(sd)
    for p, q in zip(params, restored_params):
        for state_name in opt.state[p]:
            assert_bitwise(restored.state[q][state_name], opt.state[p][state_name], f"{name} {state_name} loaded")
    run_steps(opt, params, 3, 2)
    run_steps(restored, restored_params, 3, 2)
    for a, b in zip(params, restored_params):
        assert_bitwise(a, b, f"{name} {mode} continued")


@pytest.mark.parametrize(
    "target",
    [
        dict(),  # FP32 states
        dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8),
        dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16),
    ],
    ids=["fp32", "fp8", "fp16-bf16"],
)
def test_a_bf16_export_loads_into_other_configurations_as_the_fp32_export_does(target):
    params = make_params(torch.float32)
    kw = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    opt = PortableFusedAdam(params, **HP, **kw, state_dict_cpu_offload=True, state_dict_keep_bf16=True)
    run_steps(opt, params, 0, 3)
    kept = deep_clone(opt.state_dict())
    assert {v.dtype for st in kept["state"].values() for v in st.values()} == {torch.bfloat16}
    widened = deep_clone(export_state(opt, cpu_offload=True))
    a = PortableFusedAdam(clone_params(params), **HP, **target)
    b = PortableFusedAdam(clone_params(params), **HP, **target)
    a.load_state_dict(kept)
    b.load_state_dict(widened)
    assert_state_dicts_bitwise(a.state_dict(), b.state_dict(), f"{target}: BF16 export == FP32 export once loaded")
    for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        for state_name in a.state[p]:
            assert_bitwise(a.state[p][state_name], b.state[q][state_name], f"{target} live {state_name}")


def test_keep_bf16_leaves_an_fp32_configuration_unchanged():
    params = make_params(torch.float32)
    with pytest.warns(UserWarning, match=r"state_dict_keep_bf16=True has no effect: no optimizer state is BF16"):
        opt = PortableFusedAdam(params, **HP, state_dict_keep_bf16=True)
    run_steps(opt, params, 0, 2)
    sd = opt.state_dict()
    assert_state_dicts_bitwise(sd, export_state(opt, cpu_offload=False), "FP32 states: the TE export")
    assert all(local(v).dtype == torch.float32 for st in sd["state"].values() for v in st.values())
