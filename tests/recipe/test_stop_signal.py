"""The recipe's stop check: between checkpoints a step's non-finite flag is read at the next check (CPU flags as
CUDA ones; tests/gpu covers the CUDA copy) and, with several ranks, the all-reduce of a check is read at the next
check, the same on every rank; steps that save and a stop read everything at once."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

from recipes.stop_signal import StopSignal
from recipes.train import INTERRUPTED_LINE
from tests.distributed.launch import spawn
from tests.recipe.runs import QUICK, cli, complete_steps

GOOD, BAD = torch.tensor(False), torch.tensor(True)


@pytest.fixture
def terminal_sigint():
    """SIGINT as a process started from a terminal finds it (Python's ``default_int_handler``), whatever this
    process inherited: a background job of a script or ``nohup ... &`` starts with SIGINT ignored."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


@pytest.fixture
def ignored_sigint():
    """SIGINT as a background job of a script or ``nohup ... &`` finds it: ignored."""
    found = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, found)


def test_one_rank_reads_a_flag_at_the_next_check_and_a_stop_at_once_with_its_own_flag():
    stop = StopSignal()
    try:
        assert stop.should_stop(1, BAD, now=False) == (False, False) and stop.pending  # kept for the next check
        assert stop.should_stop(1, GOOD, now=False) == (False, True) and stop.flag_lag == 1
        assert stop.should_stop(1, GOOD, now=False) == (False, False)
        assert stop.should_stop(1, BAD, now=True) == (False, True) and stop.flag_lag == 0  # a save step: at once
        stop.received = "SIGTERM"  # a stop between checkpoints saves this step: its own flag is read first
        assert stop.should_stop(1, BAD, now=False) == (True, True) and stop.flag_lag == 0 and not stop.pending
        assert stop.should_stop(1, GOOD, now=False) == (True, False)
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
    stop = StopSignal()
    try:

        def check(flag=GOOD, *, now=False, signal=None):
            if signal is not None and rank == 1:
                stop.received = signal
            return _agreed(stop.should_stop(world, flag, now=now), stop.flag_lag, world)

        assert check() == (False, False, 0) and stop.pending  # posted, read at the next check
        assert check(signal="SIGTERM") == (False, False, 0)  # rank 1's signal is posted now...
        assert check() == (True, False, 0) and not stop.pending  # ...and reported by all ranks one check later
        stop.received = None
        assert check(BAD if rank == 0 else GOOD) == (False, False, 0)  # rank 0's non-finite step: kept...
        assert check() == (False, False, 0)  # ...read here and posted...
        assert check() == (False, True, 2) and not stop.pending  # ...reported with its step (two before)
        assert check(BAD if rank == 1 else GOOD, now=True) == (False, True, 0)  # a save step: this step's, at once
        assert check() == (False, False, 0)
        # a stop and a non-finite value of the step before: reported together, the value with its step
        assert check(BAD if rank == 0 else GOOD, signal="SIGUSR1") == (False, False, 0)
        assert check() == (True, True, 1) and not stop.pending
        assert check(now=True) == (True, False, 0)  # rank 1's signal stays received
    finally:
        stop.restore()
    waiting = StopSignal(overlap=False)  # without overlap: every check waits for the all-reduce
    try:
        assert _agreed(waiting.should_stop(world, BAD if rank == 1 else GOOD, now=False), 0, world) == (False, False, 0)
        assert _agreed(waiting.should_stop(world, GOOD, now=False), waiting.flag_lag, world) == (False, True, 1)
        if rank == 0:
            waiting.received = "SIGTERM"
        # rank 0's stop is agreed in this check's all-reduce, after this step's flag was kept: it is read at once
        result = waiting.should_stop(world, BAD if rank == 1 else GOOD, now=False)
        assert _agreed(result, waiting.flag_lag, world) == (True, True, 0) and not waiting.pending
    finally:
        waiting.restore()


@pytest.mark.slow
def test_two_ranks_agree_a_check_or_two_later_between_checkpoints_and_at_once_when_saving():
    spawn(_two_ranks, 2)


def test_a_second_ctrl_c_stops_at_once(terminal_sigint):
    """The first SIGINT asks for a clean stop (as SIGTERM); the second raises KeyboardInterrupt where the loop is."""
    stop = StopSignal()
    try:
        signal.raise_signal(signal.SIGINT)
        assert stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.restore()
    first = StopSignal()
    try:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert first.received == "SIGTERM"  # the first reason is kept
    finally:
        first.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_two_ctrl_c_that_reach_python_as_one_handler_call_still_stop_at_once(terminal_sigint):
    """Two SIGINTs that arrive before the main thread runs Python again (here: both delivered to another thread
    while the main thread waits in ``join``, as two Ctrl-C during one long C call) reach Python as one handler
    call; they are still the second Ctrl-C. Broken on purpose (the handler not counting the wakeup fd's bytes):
    the pair is taken for one Ctrl-C and the run goes on to a checkpoint."""

    def two_ctrl_c():
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    stop = StopSignal()
    try:
        sender = threading.Thread(target=two_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            sender.start()
            sender.join()
            for _ in range(3):  # the handler runs at the main thread's next check, at the latest here
                pass
        sender.join()
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd is given back too


def test_a_sigint_found_ignored_stays_ignored_and_every_handler_is_put_back(ignored_sigint, caplog):
    """A background job of a script or ``nohup ... &`` starts with SIGINT ignored: the stop signal leaves it so
    (the terminal's Ctrl-C is not this process's), says so in one line, and catches SIGTERM; ``restore`` puts
    back what it found. Broken on purpose (a handler installed over SIG_IGN): the SIGINT is received."""
    found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    with caplog.at_level(logging.INFO, logger="recipes.stop_signal"):
        stop = StopSignal()
    try:
        signal.raise_signal(signal.SIGINT)
        assert stop.received is None and stop.sigint_ignored
        signal.raise_signal(signal.SIGTERM)
        assert stop.received == "SIGTERM"
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in found} == found
    said = [r.getMessage() for r in caplog.records if r.name == "recipes.stop_signal"]
    assert len(said) == 1 and said[0].startswith("SIGINT is ignored in this process"), said
    assert f"SIGTERM (kill {os.getpid()}) stops it after the step with a checkpoint" in said[0], said


def test_a_run_started_with_sigint_ignored_stops_cleanly_on_sigterm(tmp_path, monkeypatch, ignored_sigint):
    """The recipe in a process that inherited SIGINT ignored: a Ctrl-C's SIGINT changes nothing, SIGTERM stops it
    after the step with a checkpoint, and SIGINT is ignored again afterwards. Broken on purpose (a handler installed
    over SIG_IGN): the run stops on SIGINT."""
    import recipes.job
    from recipes.job import train
    from recipes.train import compose_config

    real = recipes.job.evaluate

    def evaluate_then_signals(*args):
        out = real(*args)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        return out

    monkeypatch.setattr(recipes.job, "evaluate", evaluate_then_signals)
    over = [*QUICK, "trainer.max_steps=8", "trainer.eval_every=4", "checkpoint.every_steps=100"]
    summary = train(compose_config([*over, f"run_dir={tmp_path}"]))
    assert (summary["stopped_at"], summary["stopped_by"]) == (4, "SIGTERM")
    assert complete_steps(tmp_path) == [4]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_the_first_ctrl_c_says_what_the_stop_does(capfd, terminal_sigint):
    """The first Ctrl-C's line says "with a checkpoint" only where checkpointing is on."""
    for saves, words in [(True, "stopping after this step with a checkpoint"), (False, "checkpointing is off")]:
        stop = StopSignal(saves=saves)
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            stop.restore()
        assert words in capfd.readouterr().err


def test_a_ctrl_c_during_the_last_step_is_the_end_of_the_run(tmp_path, monkeypatch, terminal_sigint):
    """Every step is done: the run ends as finished, not reported as a stop ("a new launch resumes here", exit
    130)."""
    import recipes.job
    from recipes.job import train
    from recipes.train import compose_config

    real = recipes.job.evaluate

    def evaluate_then_ctrl_c(*args):
        out = real(*args)
        signal.raise_signal(signal.SIGINT)  # before the last step's stop check
        return out

    monkeypatch.setattr(recipes.job, "evaluate", evaluate_then_ctrl_c)
    over = ["experiment=quick", "trainer.threads=1", "trainer.max_steps=4", "trainer.eval_every=4"]
    summary = train(compose_config([*over, f"run_dir={tmp_path}"]))  # its one evaluation: at the last step
    assert summary["end_step"] == 4 and summary["stopped_at"] is None and summary["stopped_by"] is None


def test_a_ctrl_c_outside_the_loop_s_stop_is_one_line_and_exit_130(tmp_path, monkeypatch, terminal_sigint):
    """A Ctrl-C that raises KeyboardInterrupt (before the loop's handler is installed, as here, or a second one
    inside it): the entry point's one line and 130, no traceback."""
    import recipes.job

    def interrupted(cfg):
        signal.raise_signal(signal.SIGINT)  # Python's own handler: KeyboardInterrupt here

    monkeypatch.setattr(recipes.job, "preflight", interrupted)
    proc = cli(*QUICK, f"run_dir={tmp_path}")
    assert (proc.returncode, proc.stderr) == (130, f"{INTERRUPTED_LINE}\n")


def test_a_ctrl_c_during_a_save_stops_once_that_save_is_durable(tmp_path, terminal_sigint):
    """A first Ctrl-C while step 4's checkpoint is being written (sync and async): the run stops at step 4 once
    that checkpoint is complete, without a further step or a second save."""
    from recipes.job import train
    from recipes.train import compose_config

    def ctrl_c_in_save(phase: str, step: int, path) -> None:
        if phase == "write" and step == 4:
            signal.raise_signal(signal.SIGINT)

    for mode in ("false", "true"):
        run_dir = tmp_path / mode
        over = [*QUICK, "trainer.max_steps=8", "checkpoint.every_steps=4", f"checkpoint.async_save={mode}"]
        summary = train(compose_config([*over, f"run_dir={run_dir}"]), on_phase=ctrl_c_in_save)
        assert (summary["stopped_at"], summary["stopped_by"]) == (4, "SIGINT"), (mode, summary)
        assert complete_steps(run_dir) == [4], mode


def test_restore_leaves_a_wakeup_fd_set_after_it_alone(terminal_sigint):
    """A wakeup fd another part of the process set after the stop signal (an asyncio loop) stays set and open;
    only the stop signal's own pipe is closed. Broken on purpose (closing whatever fd is set): theirs is closed."""
    import socket

    stop = StopSignal()
    theirs, other_end = socket.socketpair()
    theirs.setblocking(False)
    signal.set_wakeup_fd(theirs.fileno())
    try:
        stop.restore()
        assert signal.set_wakeup_fd(-1) == theirs.fileno()
        os.fstat(theirs.fileno())  # still open
    finally:
        theirs.close()
        other_end.close()
