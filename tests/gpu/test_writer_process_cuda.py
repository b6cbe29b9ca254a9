"""``StagerOptions(write_in_process=True)`` on CUDA: the writer process writes the files the stager's thread writes,
from host memory that is shared and pinned (the model's copies registered in place, the export's pooled buffers
made in shared memory and registered), reused from save to save."""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, StagerOptions
from tests.unit.saves import OURS, data_files, export_deferred


@pytest.mark.cuda_only
def test_a_writer_process_writes_the_thread_s_files_from_pinned_shared_memory(tmp_path):
    files = {}
    for in_process in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
        opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
        staged: list[dict] = []
        stager = AsyncSaveStager(opt, StagerOptions(check=staged.append, write_in_process=in_process))
        for n in range(2):
            model(torch.randn(4, 256, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if n == 0:
                opt.prepare_state_dict().result()  # the pool's buffers made (shared) and pinned before the export
            stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / f"{in_process}{n}"))
            stager.wait()
        if in_process:
            for first, second in zip(staged[0]["model"].values(), staged[1]["model"].values()):
                assert first.is_shared() and first.is_pinned() and first.data_ptr() == second.data_ptr()
            exported = [t for st in staged[1]["optim"]["state"].values() for t in st.values()]
            assert exported and all(t.is_shared() and t.is_pinned() for t in exported), "the export's buffers"
            assert stager.writer_pid is not None
        files[in_process] = [data_files(tmp_path / f"{in_process}{n}") for n in range(2)]
        stager.close()
    assert files[True] == files[False]
