"""Loads through DCP's default planner, which reads each saved tensor into the template's dtype (the README's loop
without ``ExactLoadPlanner``), in one process: a changed master format is refused in one line naming the state, the
saved and the stored format and the fix, and the optimizer is left as it was; an unchanged format, and a changed
moment dtype (which DCP rounds as ``set_scaled_state`` does), load as through ``ExactLoadPlanner``, bitwise.
Through torchtitan's and Automodel's own checkpointers, on 1 and 2 ranks: tests/integrations/test_cast_loads.py."""

from __future__ import annotations

import pytest
import torch

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
