"""The recipe's stop check on CPU: flags are read at once (deferring needs a CUDA stream; tests/gpu covers it); with
several ranks the all-reduce of a check between checkpoints is read at the next check, the same on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from recipes.stop_signal import StopSignal
from tests.distributed.launch import spawn


def test_cpu_flags_are_read_at_once_with_one_rank():
    stop = StopSignal()
    try:
        assert stop.should_stop(1, torch.tensor(True), now=False) == (False, True)
        assert not stop.pending and stop.flag_lag == 0
        assert stop.should_stop(1, torch.tensor(False), now=False) == (False, False)
        stop.received = "SIGTERM"
        assert stop.should_stop(1, None, now=False) == (True, False)
    finally:
        stop.restore()


def _agreed(result: tuple[bool, bool], lag: int, world: int) -> tuple[bool, bool, int]:
    """This rank's (stop, bad, lag), checked to be every rank's."""
    mine = (*result, lag)
    every = [None] * world
    dist.all_gather_object(every, mine)
    assert all(r == mine for r in every), every
    return mine


def _two_ranks(rank: int, world: int) -> None:
    good, bad = torch.tensor(False), torch.tensor(True)
    stop = StopSignal()
    try:

        def check(flag=good, *, now=False, signal=None):
            if signal is not None and rank == 1:
                stop.received = signal
            return _agreed(stop.should_stop(world, flag, now=now), stop.flag_lag, world)

        assert check() == (False, False, 0) and stop.pending  # posted, read at the next check
        assert check(signal="SIGTERM") == (False, False, 0)  # rank 1's signal is posted now...
        assert check() == (True, False, 0) and not stop.pending  # ...and reported by all ranks one check later
        stop.received = None
        assert check(bad if rank == 0 else good) == (False, False, 0)  # rank 0's non-finite loss, posted
        assert check() == (False, True, 1) and not stop.pending  # reported with its step (one before)
        assert check(bad if rank == 1 else good, now=True) == (False, True, 0)  # at once: this step's
        assert check() == (False, False, 0)
        assert check(now=True, signal="SIGUSR1") == (True, False, 0) and not stop.pending  # a save step: at once
    finally:
        stop.restore()
    waiting = StopSignal(overlap=False)  # the check as it was: every check waits for the all-reduce
    try:
        assert _agreed(waiting.should_stop(world, bad if rank == 1 else good, now=False), waiting.flag_lag, world) == (
            False,
            True,
            0,
        )
        assert not waiting.pending
    finally:
        waiting.restore()


def test_two_ranks_agree_one_check_later_between_checkpoints_and_at_once_when_saving():
    spawn(_two_ranks, 2)
