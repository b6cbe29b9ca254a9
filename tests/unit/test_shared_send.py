"""A save handed to its writer process with its storages' descriptors beside the pickle (``_shared_send.py``): every
storage once, mapped on the other side without a copy, and no descriptor left open by the hand-over."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading

import pytest
import torch

from optim_factory.checkpoint._shared_send import pickle_with_fds, recv_with_fds, send_with_fds

pytestmark = pytest.mark.skipif(
    torch.multiprocessing.get_sharing_strategy() != "file_descriptor", reason="the file_descriptor sharing strategy"
)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _received(obj):
    """``obj`` sent on one end of a pipe and received on the other (the receiver on a thread: the pickle can fill the
    socket's buffer)."""
    sender, receiver = multiprocessing.Pipe()
    out: list = []
    thread = threading.Thread(target=lambda: out.append(recv_with_fds(receiver)))
    thread.start()
    payload, storages = pickle_with_fds(obj)
    send_with_fds(sender, payload, storages)
    thread.join(60)
    sender.close()
    receiver.close()
    return out[0], storages


def test_every_storage_goes_once_beside_the_pickle_and_is_mapped_not_copied():
    shared = [torch.full((64,), float(i)).share_memory_() for i in range(300)]  # more than one message's 250
    base = torch.arange(16.0).share_memory_()
    plain = torch.ones(8)  # not in shared memory yet: moved there, as torch's own pickler moves it
    state = {
        "shared": shared,
        "views": (base[:8], base[8:]),
        "plain": plain,
        "empty": torch.empty(0),
        "meta": torch.empty(4, device="meta"),
        "step": 7,
    }
    got, storages = _received(state)
    assert len(storages) == 300 + 1 + 1  # the two views' storage once, nothing for the empty or the meta tensor
    assert [float(t[0]) for t in got["shared"]] == [float(i) for i in range(300)]
    assert got["views"][0].untyped_storage().data_ptr() == got["views"][1].untyped_storage().data_ptr()
    assert torch.equal(torch.cat(got["views"]), base) and torch.equal(got["plain"], plain)
    assert got["empty"].numel() == 0 and got["meta"].is_meta and got["step"] == 7
    shared[299].fill_(-1.0)  # the same memory on both sides
    base[9] = 100.0
    plain.fill_(3.0)
    assert float(got["shared"][299][5]) == -1.0 and float(got["views"][1][1]) == 100.0
    assert torch.equal(got["plain"], torch.full((8,), 3.0))


def test_the_hand_over_leaves_no_descriptor_open():
    tensors = [torch.zeros(32).share_memory_() for _ in range(20)]
    before = _open_fds()
    got, _ = _received(tensors)
    assert _open_fds() == before + len(tensors)  # each storage mapped here keeps its own, as torch's does
    del got
    gc.collect()
    assert _open_fds() == before


def test_the_end_of_the_requests_is_none():
    sender, receiver = multiprocessing.Pipe()
    sender.send(None)
    assert recv_with_fds(receiver) is None
