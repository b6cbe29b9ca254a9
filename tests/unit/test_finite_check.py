"""StagerOptions(refuse_non_finite=True) through plain DCP on CPU: a NaN or inf in the model, in an optimizer's
pooled export (a background export) or in any other optimizer's states refuses the save in one line with nothing
written and the previous checkpoint intact; off (the default), the state is saved as it is. Which tensors are read
where (GPU or host) is tested in tests/gpu/test_finite_check_cuda.py."""

from __future__ import annotations

import concurrent.futures
import math

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import NON_FINITE_LINE, AsyncSaveStager, SaveRefused, StagerOptions
from optim_factory.checkpoint._finite_check import FiniteCheck
from tests.unit.saves import OURS, StuckExport, assert_checkpoint, expected_tensors, export_deferred, make_model, train


def _poison_model(model, opt, value: float) -> None:
    with torch.no_grad():
        next(model.parameters()).view(-1)[3] = value


def _poison_optimizer(model, opt, value: float) -> None:
    next(iter(opt.state.values()))["exp_avg_sq"].view(-1)[5] = value


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _ours(model):
    return PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "build, poison, where",
    [
        (_ours, _poison_model, "model.0.weight"),
        (_ours, _poison_optimizer, "optim.state.0.weight.exp_avg_sq"),
        (_adamw, _poison_optimizer, "optim.state.0.weight.exp_avg_sq"),
    ],
    ids=["ours-model", "ours-export", "adamw-states"],
)
def test_a_non_finite_value_refuses_the_save_in_one_line_naming_it_and_writes_nothing(
    tmp_path, build, poison, where, value
):
    model = make_model()
    opt = build(model)
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True))
    train(model, opt, 1)
    expected = expected_tensors(model, opt) if isinstance(opt, PortableFusedAdam) else None
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "good"))
    stager.wait()
    poison(model, opt, value)
    response = stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "bad"))
    response.staging_completion.result()
    with pytest.raises(SaveRefused) as info:
        stager.wait()
    assert str(info.value) == f"not saved, nothing was written: {NON_FINITE_LINE}: {where} (rank 0)"
    assert not (tmp_path / "bad").exists()
    if expected is not None:
        assert_checkpoint(tmp_path / "good", expected)
    stager.close()


def test_what_the_loop_writes_after_the_save_started_is_not_checked(tmp_path, monkeypatch):
    """The check reads the state of the save's moment, the staged copies: a NaN written into the live model after
    the save started (its export held unfilled, so the check has not run yet) and into the optimizer once
    ``staging_completion`` is done is neither saved nor refused."""
    stuck = StuckExport(monkeypatch)
    model = make_model()
    opt = _ours(model)
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True))
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    stuck.gate.clear()
    try:
        response = stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "ck"))
        _poison_model(model, opt, math.nan)  # the model's copy is made; the host check waits for the export
    finally:
        stuck.gate.set()
    response.staging_completion.result()
    _poison_optimizer(model, opt, math.nan)
    stager.wait()
    assert_checkpoint(tmp_path / "ck", expected)
    stager.close()


def test_a_check_that_fails_refuses_the_save_once_the_export_is_filled(tmp_path, monkeypatch):
    """The GPU's part of the check raising (a CUDA error) refuses the save in one line, and the staging still waits
    for the export (held unfilled here), so its buffers go back only once it is filled."""

    def broken(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    stuck = StuckExport(monkeypatch)
    model = make_model()
    opt = _ours(model)
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True))
    train(model, opt, 1)
    monkeypatch.setattr(FiniteCheck, "on_device", broken)
    stuck.gate.clear()
    try:
        state = export_deferred(model, opt)
        response = stager.async_save(state, checkpoint_id=str(tmp_path / "bad"))
        concurrent.futures.wait([response.staging_completion], timeout=0.5)
        assert not response.staging_completion.done(), "the staging completed before the export was filled"
    finally:
        stuck.gate.set()
    with pytest.raises(SaveRefused, match=r"nothing was written: the finite check failed: RuntimeError: CUDA error"):
        stager.wait()
    assert not (tmp_path / "bad").exists()
    assert not [t for t in state["optim"]["state"].values() for v in t.values() if opt.is_leased_export_buffer(v)]
    stager.close()


def test_a_refusal_names_the_first_staged_tensor_holding_a_nan_and_a_failed_check_its_own_line():
    """Each verdict ends its check: the tensors it read are let go, whatever it returns (an earlier refusal is
    returned as it is, the host not read)."""
    sources = {"model": {"w": torch.ones(3)}, "optim": {"state": {"0.weight": {"exp_avg_sq": torch.ones(4)}}}}
    staged = {"model": {"w": torch.ones(3)}, "optim": {"state": {"0.weight": {"exp_avg_sq": torch.ones(4)}}}}

    def verdict(on_device, earlier=None):
        check = FiniteCheck(sources, staged, lambda t: None)
        assert check.host  # the CPU tensors, read on the host
        line = check.refusal(on_device, earlier)
        assert check.host == [] and check.device == []
        return line

    assert verdict(None) is None
    assert verdict(NON_FINITE_LINE) == NON_FINITE_LINE  # the GPU saw one the staged copies do not hold
    staged["optim"]["state"]["0.weight"]["exp_avg_sq"][2] = math.inf
    assert verdict(None) == f"{NON_FINITE_LINE}: optim.state.0.weight.exp_avg_sq"
    assert verdict(NON_FINITE_LINE) == f"{NON_FINITE_LINE}: optim.state.0.weight.exp_avg_sq"
    assert verdict("the finite check failed: X") == "the finite check failed: X"
    assert verdict(None, earlier="the export failed") == "the export failed"


def test_off_by_default_a_non_finite_state_is_saved_as_it_is(tmp_path):
    model = make_model()
    opt = _ours(model)
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    _poison_optimizer(model, opt, math.nan)
    expected = expected_tensors(model, opt)
    assert any(v.isnan().any() for v in expected.values())
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "nan"))
    stager.wait()
    assert_checkpoint(tmp_path / "nan", expected)
    stager.close()


@pytest.mark.parametrize("name", ["refuse_non_finite", "pinned"])
def test_a_flag_that_is_not_a_bool_is_one_line_at_construction(name):
    with pytest.raises(TypeError, match=rf"^StagerOptions\({name}=\.\.\.\): expected True or False, got 'yes'$"):
        StagerOptions(**{name: "yes"})


@pytest.mark.parametrize("given", [0, -1.0, "600", True])
def test_options_of_another_type_or_a_timeout_that_is_not_positive_are_one_line(given):
    with pytest.raises(TypeError, match=r"^StagerOptions\(export_timeout_s=\.\.\.\): expected seconds > 0, got "):
        StagerOptions(export_timeout_s=given)
    with pytest.raises(TypeError, match=r"^AsyncSaveStager\(options=\.\.\.\): expected StagerOptions\(\.\.\.\), got "):
        AsyncSaveStager(torch.optim.SGD(make_model().parameters(), lr=0.1), {"refuse_non_finite": True})


def test_a_check_that_is_not_a_function_or_the_option_given_to_the_save_is_one_line(tmp_path):
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"^StagerOptions\(check=\.\.\.\): expected a function of the staged dict, got True$"
    ):
        AsyncSaveStager(opt, StagerOptions(check=True))
    stager = AsyncSaveStager(opt)
    with pytest.raises(
        TypeError, match=r"^AsyncSaveStager.async_save\(refuse_non_finite=\.\.\.\): a StagerOptions field"
    ):
        stager.async_save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "ck"), refuse_non_finite=True)
    assert not (tmp_path / "ck").exists()
    stager.close()
