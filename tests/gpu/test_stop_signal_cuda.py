"""The recipe's stop check on CUDA: between checkpoints the non-finite flag is read one step late (no sync)."""

from __future__ import annotations

import pytest
import torch

from recipes.stop_signal import StopSignal


@pytest.mark.cuda_only
def test_deferred_flag_is_read_at_the_next_check_and_now_reads_at_once():
    stop = StopSignal()
    try:
        bad = torch.ones((), dtype=torch.bool, device="cuda")
        good = torch.zeros((), dtype=torch.bool, device="cuda")
        assert stop.should_stop(1, bad, now=False) == (False, False)  # this step's flag: not read yet
        assert stop.pending  # the next check reads it
        assert stop.should_stop(1, good, now=False) == (False, True) and stop.flag_lag == 1  # the previous one
        assert stop.should_stop(1, good, now=False) == (False, False)
        assert stop.should_stop(1, bad, now=True) == (False, True) and stop.flag_lag == 0  # at once
        stop.should_stop(1, bad, now=False)
        assert stop.should_stop(1, None) == (False, True) and stop.flag_lag == 1  # a deferred flag read by now=True
        assert not stop.pending
    finally:
        stop.restore()
