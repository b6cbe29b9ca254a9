"""The recipe's stop check on CPU: flags are read at once (deferring needs a CUDA stream; tests/gpu covers it)."""

from __future__ import annotations

import torch

from recipes.train import StopSignal


def test_cpu_flags_are_read_at_once_even_between_checkpoints():
    stop = StopSignal()
    try:
        assert stop.should_stop(1, torch.tensor(True), now=False) == (False, True)
        assert not stop.flag_pending and stop.flag_lag == 0
        assert stop.should_stop(1, torch.tensor(False), now=False) == (False, False)
        stop.received = "SIGTERM"
        assert stop.should_stop(1, None) == (True, False)
    finally:
        stop.restore()
