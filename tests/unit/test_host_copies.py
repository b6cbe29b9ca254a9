"""optim_factory.checkpoint.HostCopies: host copies of a nested state dict (CPU here; CUDA in tests/gpu)."""

from __future__ import annotations

import torch

from optim_factory.checkpoint import HostCopies


def test_copies_nested_tensors_and_passes_kept_ones_through():
    kept = torch.arange(4.0)
    state = {"model": {"w": torch.randn(3, 2), "layers": [torch.ones(2), 7]}, "optim": {"exp_avg": kept}, "n": 1}
    staged, wait = HostCopies().copy(state, keep=lambda t: t is kept)
    wait()
    assert staged["optim"]["exp_avg"] is kept
    assert staged["n"] == 1 and staged["model"]["layers"][1] == 7
    for got, src in (
        (staged["model"]["w"], state["model"]["w"]),
        (staged["model"]["layers"][0], state["model"]["layers"][0]),
    ):
        assert torch.equal(got, src) and got.data_ptr() != src.data_ptr()
    state["model"]["w"].add_(1)  # the copy does not alias the source
    assert not torch.equal(staged["model"]["w"], state["model"]["w"])
