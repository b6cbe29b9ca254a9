"""A save within a host budget on CUDA (BF16 parameters, BF16 moments exported as FP32): the fills stream the
states and the model's parameters through the exporter's staging ring on a side stream; the async save writes the
same data files as a plain save of the state at its start, although ``step()`` is called at once; written by a writer
process (the fills into shared memory, a whole save's kept buffers pinned in place), the thread's files."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, BudgetSavePlanner, StagerOptions
from tests.unit.saves import data_files
from tests.unit.test_budget import Recording

pytestmark = pytest.mark.cuda_only
CHUNK = 1 << 20


def _trained(budget: int = 8 << 20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)]).cuda().to(torch.bfloat16)
    opt = PortableFusedAdam(
        model.parameters(), lr=1e-3, master_weights=True, exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16, state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=CHUNK,
        state_dict_offload_host_budget=budget,
    )  # fmt: skip
    _train(model, opt)
    return model, opt


def _train(model, opt) -> None:
    model(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_saves_within_the_budget_on_cuda_write_the_plain_save_s_files(tmp_path):
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    plain = FileSystemWriter(tmp_path / "plain", per_thread_copy_ahead=0)
    dcp.save({"model": msd, "optim": osd}, storage_writer=plain, no_dist=True)
    del msd, osd
    planner = BudgetSavePlanner(opt)
    with planner.exporting():
        msd, osd = get_state_dict(model, opt)
    planner.save({"model": msd, "optim": osd}, tmp_path / "sync", no_dist=True)
    stager = AsyncSaveStager(opt)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    response = stager.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "async"), no_dist=True)
    _train(model, opt)  # at once: it waits for the fills
    response.upload_completion.result()
    assert 0 < planner.peak_bytes <= 8 << 20 and 0 < stager.budget_peak_bytes <= 8 << 20
    for name in ("sync", "async"):
        assert data_files(tmp_path / name) == data_files(tmp_path / "plain"), name
    stager.close()


def test_a_save_that_fits_the_budget_whole_fills_pinned_buffers_kept_for_the_next(tmp_path):
    model, opt = _trained(budget=1 << 30)
    planner = Recording(opt)
    for name in ("first", "second"):
        if name == "second":  # the kept buffers are pinned on a thread once written: the device copies into them
            for _ in range(3000):
                if all(t.is_pinned() for t in planner.given[0]):
                    break
                torch.cuda.synchronize()
                threading.Event().wait(0.01)
            assert all(t.is_pinned() for t in planner.given[0])
        msd, osd = get_state_dict(model, opt)
        plain = FileSystemWriter(tmp_path / f"{name}_plain", per_thread_copy_ahead=0)  # the budget's writer's layout
        dcp.save({"model": msd, "optim": osd}, storage_writer=plain, no_dist=True)
        del msd, osd
        with planner.exporting():
            msd, osd = get_state_dict(model, opt)
        planner.save({"model": msd, "optim": osd}, tmp_path / name, no_dist=True)
        assert data_files(tmp_path / name) == data_files(tmp_path / f"{name}_plain"), name
        _train(model, opt)
    assert planner.given[1] and all(a is b for a, b in zip(*planner.given))


@pytest.mark.parametrize("budget", [8 << 20, 1 << 30], ids=["streamed", "whole"])
def test_async_saves_within_the_budget_written_by_a_writer_process_are_the_thread_s_files(tmp_path, budget):
    files = {}
    for in_process in (False, True):
        model, opt = _trained(budget)
        stager = AsyncSaveStager(opt, StagerOptions(write_in_process=in_process))
        for n in range(2):  # whole: the second save fills the first one's kept buffers
            with stager.exporting():
                msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            response = stager.async_save(state, checkpoint_id=str(tmp_path / f"{in_process}{n}"), no_dist=True)
            _train(model, opt)  # at once: it waits for the fills
            response.upload_completion.result()
        assert 0 < stager.budget_peak_bytes <= budget and (stager.writer_pid is not None) == in_process
        files[in_process] = [data_files(tmp_path / f"{in_process}{n}") for n in range(2)]
        stager.close()
    assert files[True] == files[False]
