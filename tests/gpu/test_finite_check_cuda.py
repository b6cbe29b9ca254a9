"""StagerOptions(refuse_non_finite=True) on CUDA: the model's tensors and the optimizer's states are read on the
GPU, not on the host (the export's host buffers are checked through the states they are filled from), except FP8
states, which are checked widened in the export; a NaN in a CUDA state refuses the save with nothing written."""

from __future__ import annotations

import math

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import NON_FINITE_LINE, AsyncSaveStager, HostCopies, SaveRefused, StagerOptions
from optim_factory.checkpoint._finite_check import FiniteCheck
from tests.helpers import FP8
from tests.unit.saves import OURS, export_deferred

pytestmark = pytest.mark.cuda_only


def _cuda_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()


def _train(model, opt) -> None:
    model(torch.randn(4, 256, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _planned(model, opt) -> FiniteCheck:
    state = export_deferred(model, opt)
    staged, copied = HostCopies().copy(state, keep=opt.is_leased_export_buffer)
    check = FiniteCheck(state, staged, lambda t: opt if opt.is_leased_export_buffer(t) else None)
    copied()
    opt.wait_state_dict()
    return check


@pytest.mark.parametrize("exp_avg", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_cuda_states_are_read_on_the_gpu_and_fp8_ones_widened_on_the_host(exp_avg):
    model = _cuda_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **{**OURS, "exp_avg_dtype": exp_avg})
    _train(model, opt)
    check = _planned(model, opt)
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert all(t.is_cuda for t in check.device)
    if exp_avg == FP8:
        assert len(check.device) == len(list(model.parameters())) and check.host
        assert all(not t.is_cuda for t in check.host)
    else:
        assert check.host == [] and len(check.device) == len(list(model.parameters())) + len(states)
    assert check.on_device() and check.on_host()
    next(iter(opt.state.values()))["exp_avg_sq"].view(-1)[7] = math.nan
    poisoned = _planned(model, opt)
    assert (poisoned.on_device(), poisoned.on_host()) == ((True, False) if exp_avg == FP8 else (False, True))


def test_te_s_fp8_states_are_checked_widened_on_the_host_not_dequantized_on_the_gpu():
    """TE's class keeps FP8 moments as ``Float8Tensor`` (four bytes per value by its dtype): not reduced on the GPU,
    where a reduction would dequantize each into an FP32 temporary; its export buffers are checked on the host."""
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE
    from tests.gpu.test_te_fused_adam import te_cls

    if not TE_AVAILABLE:
        pytest.skip("Transformer Engine is not importable")
    model = _cuda_model()
    opt = te_cls()(model.parameters(), lr=1e-3, **{**OURS, "exp_avg_dtype": FP8, "exp_avg_sq_dtype": FP8})
    _train(model, opt)
    check = _planned(model, opt)
    assert len(check.device) == len(list(model.parameters())) and check.host
    assert check.on_device() and check.on_host()


def test_a_nan_the_next_step_writes_after_the_staging_completed_is_not_checked(tmp_path):
    model = _cuda_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True))
    _train(model, opt)
    response = stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "ck"))
    response.staging_completion.result()
    next(iter(opt.state.values()))["exp_avg_sq"].view(-1)[7] = math.nan  # the GPU read it before the fill
    stager.wait()
    assert (tmp_path / "ck" / ".metadata").is_file()
    stager.close()


def test_a_nan_in_a_cuda_state_refuses_the_save_and_the_next_one_saves(tmp_path):
    model = _cuda_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True))
    _train(model, opt)
    state = next(iter(opt.state.values()))["exp_avg_sq"]
    kept = state.view(-1)[7].item()
    state.view(-1)[7] = math.nan
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "bad")).staging_completion.result()
    with pytest.raises(SaveRefused) as info:
        stager.wait()
    assert (
        str(info.value)
        == f"not saved, nothing was written: {NON_FINITE_LINE}: optim.state.0.weight.exp_avg_sq (rank 0)"
    )
    assert not (tmp_path / "bad").exists()
    state.view(-1)[7] = kept
    _train(model, opt)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "good"))
    stager.wait()
    assert (tmp_path / "good" / ".metadata").is_file()
    stager.close()
