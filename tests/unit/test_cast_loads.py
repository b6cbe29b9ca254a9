"""Loads through DCP's default planner, which reads each saved tensor into the template's dtype (the README's loop
without ``ExactLoadPlanner``), in one process: a changed master format is refused in one line naming the state, the
saved and the stored format and the fix, and the optimizer is left as it was; an unchanged format, and a changed
moment dtype (which DCP rounds as ``set_scaled_state`` does), load as through ``ExactLoadPlanner``, bitwise. The
check's edges: one master of whole numbers beside trained ones loads; remainders reaching -32768 are refused.
Through torchtitan's and Automodel's own checkpointers, on 1 and 2 ranks: tests/integrations/test_cast_loads.py."""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import ExactLoadPlanner
from tests.helpers import LiveSnapshot, assert_bitwise, run_steps
from tests.unit.test_formats import MASTERS, build, load, save

pytestmark = pytest.mark.filterwarnings("ignore:state_dict_cpu_offload=True has no memory effect")

FIX = (
    "not loaded: read it with dcp.load(..., planner=ExactLoadPlanner()) (optim_factory.checkpoint), or through "
    "optim_factory.integrations' torchtitan CheckpointManager or Automodel Checkpointer"
)
JOIN = (
    "load_state_dict: group 0, parameter 0: master_param: every master holds only whole numbers within int16's "
    "range, as int16 remainders read into an FP32 master by DCP's default planner do; saved: int16 remainders, "
    "stored here: {live}; " + FIX
)
SPLIT = (
    "load_state_dict: group 0, parameter 0: master_param: every int16 remainder is within +-255, as an FP32 master "
    "truncated into int16 remainders by DCP's default planner is; saved: an FP32 master, stored here: int16 "
    "remainders; " + FIX
)
REFUSED = {
    ("remainders", "fp32 master"): JOIN.format(live="an FP32 master"),
    ("remainders", "fp16 master"): JOIN.format(live="an FP16 master"),
    ("fp32 master", "remainders"): SPLIT,
    ("fp16 master", "remainders"): SPLIT,
}


def trained(path, scale: float = 1.0, **options) -> None:
    """A checkpoint of 3 steps on BF16 parameters (``scale``: of the initial weights)."""
    model, opt = build(torch.bfloat16, **options)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    run_steps(opt, list(model.parameters()), 0, 3)
    save(model, opt, path)


@pytest.mark.parametrize("scale", [1.0, 0.01], ids=["weights-up-to-4", "weights-below-1"])
@pytest.mark.parametrize("saved,live", list(REFUSED), ids=[f"{a}->{b}" for a, b in REFUSED])
def test_a_changed_master_format_through_dcp_s_default_planner_is_refused_and_nothing_changes(
    saved, live, scale, tmp_path
):
    """Weights below 1 are the case where an FP32 master truncates to remainders that are all 0."""
    trained(tmp_path, scale, **MASTERS[saved])
    # offloaded: a template that aliases no live state (TE's own export aliases FP32 states, which DCP then writes)
    model, opt = build(torch.bfloat16, 1, state_dict_cpu_offload=True, **MASTERS[live])
    run_steps(opt, list(model.parameters()), 0, 1)
    before = LiveSnapshot.take(opt)
    with pytest.raises(ValueError) as info:
        load(model, opt, tmp_path)
    assert str(info.value) == REFUSED[saved, live]
    LiveSnapshot.take(opt).assert_same(before)
    load(model, opt, tmp_path, ExactLoadPlanner())  # the fix the line names


def resumed(path, planner, **options):
    model, opt = build(torch.bfloat16, 1, **options)
    opt.initialize_states()
    load(model, opt, path, planner)
    run_steps(opt, list(model.parameters()), 3, 1)
    return model, opt


def assert_same_resume(path, **options) -> None:
    """The default planner's resume is ExactLoadPlanner's, bitwise, one step later."""
    (m1, o1), (m2, o2) = resumed(path, None, **options), resumed(path, ExactLoadPlanner(), **options)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert_bitwise(a, b, "parameter")
    for (k, a), b in zip(o1.state_dict()["state"].items(), o2.state_dict()["state"].values()):
        assert a.keys() == b.keys()
        for name in a:
            assert_bitwise(a[name], b[name], f"{k}.{name}")


@pytest.mark.parametrize("fmt", ["fp32 master", "fp16 master", "remainders"])
def test_an_unchanged_master_format_loads_through_dcp_s_default_planner(fmt, tmp_path):
    trained(tmp_path, **MASTERS[fmt])
    assert_same_resume(tmp_path, **MASTERS[fmt])


BF16_KEPT = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16, "state_dict_keep_bf16": True}
MOMENTS = {
    "fp32 -> bf16 kept": ({}, BF16_KEPT),  # an FP32 moment into a BF16 template: DCP rounds it
    "bf16 kept -> fp32": (BF16_KEPT, {}),  # a BF16 moment into an FP32 template: exact
    "bf16 kept -> fp8": (BF16_KEPT, {"exp_avg_dtype": torch.uint8, "exp_avg_sq_dtype": torch.uint8}),
}


@pytest.mark.parametrize("saved,live", list(MOMENTS.values()), ids=list(MOMENTS))
def test_a_changed_moment_dtype_through_dcp_s_default_planner_is_the_exact_load(saved, live, tmp_path):
    trained(tmp_path, **MASTERS["remainders"], **saved)
    assert_same_resume(tmp_path, **MASTERS["remainders"], **live)


def _with_a_layer_norm(seed: int, **options):
    """A BF16 model of a trained weight and a LayerNorm's weight of ones that no step changes (no gradient, no
    weight decay): its FP32 master holds only whole numbers, as a cast one would."""
    torch.manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
    norm = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    model = torch.nn.Module()
    model.weight, model.norm = weight, norm
    groups = [{"params": [weight], "weight_decay": 0.1}, {"params": [norm], "weight_decay": 0.0}]
    return model, PortableFusedAdam(groups, lr=1e-2, state_dict_cpu_offload=True, **options)


def test_one_untrained_master_among_trained_ones_loads_through_dcp_s_default_planner(tmp_path):
    """The cast refusal needs every master to look cast: a LayerNorm whose master stayed at whole numbers beside a
    trained weight is a good checkpoint, loaded as ExactLoadPlanner loads it."""
    model, opt = _with_a_layer_norm(0, **MASTERS["fp32 master"])
    for step in range(3):
        model.weight.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
        model.norm.grad = torch.zeros(64, dtype=torch.bfloat16)
        opt.step()
    save(model, opt, tmp_path)
    loaded = {}
    for planner in (None, ExactLoadPlanner()):
        live, live_opt = _with_a_layer_norm(1, **MASTERS["fp32 master"])
        load(live, live_opt, tmp_path, planner)
        loaded[planner is None] = live_opt.state_dict()["state"]
    for key, states in loaded[False].items():
        for name, value in states.items():
            assert_bitwise(loaded[True][key][name], value, f"{key}.{name}")


def test_int16_remainders_of_32768_read_into_an_fp32_master_are_refused(tmp_path):
    """A trained weight's int16 remainders reach -32768 (the int16 range's end): read into an FP32 master they are
    whole numbers of magnitude 32768 at most, the cast the check refuses."""
    model, opt = build(torch.bfloat16, **MASTERS["remainders"])
    run_steps(opt, list(model.parameters()), 0, 3)
    for state in opt.state.values():
        state["master_param"].view(-1)[0] = -32768
    save(model, opt, tmp_path)
    live, live_opt = build(torch.bfloat16, 1, state_dict_cpu_offload=True, **MASTERS["fp32 master"])
    run_steps(live_opt, list(live.parameters()), 0, 1)
    before = LiveSnapshot.take(live_opt)
    with pytest.raises(ValueError) as info:
        load(live, live_opt, tmp_path)
    assert str(info.value) == REFUSED["remainders", "fp32 master"], str(info.value)
    LiveSnapshot.take(live_opt).assert_same(before)
