"""optim_factory.checkpoint's HostCopies on CUDA: pinned buffers, a side stream, reused from one copy to the next."""

from __future__ import annotations

import gc

import pytest
import torch

from optim_factory.checkpoint import HostCopies
from tests.gpu.pinning import host_registered


@pytest.mark.cuda_only
def test_cuda_copies_are_pinned_complete_after_wait_and_reused():
    copies = HostCopies()
    src = {"w": torch.randn(1 << 22, device="cuda"), "b": [torch.randn(5, device="cuda").bfloat16()]}
    staged, wait = copies.copy(src)
    wait()
    assert staged["w"].is_pinned() and staged["w"].device.type == "cpu"
    assert torch.equal(staged["w"], src["w"].cpu()) and torch.equal(staged["b"][0], src["b"][0].cpu())
    first = staged["w"].data_ptr()
    src["w"].mul_(2)  # the caller's kernel, queued before the next copy: the copy must see its result
    again, wait = copies.copy(src)
    wait()
    assert again["w"].data_ptr() == first  # the buffer is reused
    assert torch.equal(again["w"], src["w"].cpu())
    assert copies.nbytes() == (1 << 22) * 4 + 5 * 2


@pytest.mark.cuda_only
def test_shared_copies_are_pinned_in_place_and_unpinned_when_let_go_without_close():
    """A shared buffer pinned in place is unpinned when it is freed, close() or not: freed while still registered,
    its address would refuse the next registration there."""
    copies = HostCopies(shared=True)
    staged, wait = copies.copy({"w": torch.randn(1 << 20, device="cuda")})
    wait()
    ptr = staged["w"].data_ptr()
    assert staged["w"].is_shared() and host_registered(ptr)
    del copies, staged, wait
    gc.collect()
    assert not host_registered(ptr)
