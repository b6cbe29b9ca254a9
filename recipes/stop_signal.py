"""The training loop's per-step check: a stop signal on some rank, or a non-finite loss or gradient norm on some rank.

Between checkpoints the check costs the loop neither a device sync nor a wait for the other ranks: this step's
non-finite flag is read at the next check (a CUDA flag is copied to the host without waiting; a CPU flag is kept
as it is, so both behave alike), and with several ranks the flags are combined by an all-reduce that runs during
the next step and is read at the next check. So a value reaches the loop one step late with one rank, two with
several, and every rank reads the same all-reduce at the same step: all ranks stop or raise together, and the
divergence message names the step that was non-finite. Steps that save and the last step check synchronously;
so does a check that learns of a stop or a non-finite value, and a stop never returns with a flag unread: a stop's
checkpoint is of the step just done, and a non-finite step is never saved.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# What each rank contributes to the all-reduce (MAX): a stop signal arrived; the step just done was non-finite (read
# at once); the step before it was (its flag kept by the previous check)
_STOP, _BAD_NOW, _BAD_BEFORE = range(3)


class StopSignal:
    """SIGTERM / SIGUSR1 (Slurm preemption, time limit, torchrun shutting down) and a first SIGINT (Ctrl-C) ask the
    loop to stop cleanly; a second SIGINT stops at once (``KeyboardInterrupt``, no checkpoint). A SIGINT the
    process was started with ignored (a background job of a script, ``nohup ... &``: the shell keeps the
    terminal's Ctrl-C from it) stays ignored (:attr:`sigint_ignored`); SIGTERM still stops it cleanly.
    :meth:`restore` puts back every handler it replaced.

    Two Ctrl-C that arrive while the main thread is inside one long C call (a backward, a copy) reach Python as one
    handler call: CPython keeps one pending flag per signal. So the handler counts SIGINTs from the wakeup fd
    (``signal.set_wakeup_fd``: the C-level handler writes one byte per signal received), and two of them are the
    second Ctrl-C however close together they came. Where a wakeup fd is already set (an asyncio loop in the main
    thread) it is left as it is, and close Ctrl-Cs may count as one.

    The loop checks after every step (:meth:`should_stop`); all ranks agree (a max all-reduce), save a checkpoint at
    that step, wait for in-flight saves and return. A requeued job then resumes from it. ``overlap=False`` makes
    every check wait for the all-reduce (for the step-overhead benchmark: a check that waits lines up the ranks'
    CPU threads every step, docs/recipe.md).
    """

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self, *, overlap: bool = True, saves: bool = True) -> None:
        self.received: str | None = None  # the first stop signal's name
        self.saves = saves  # a stop saves a checkpoint (what the first Ctrl-C's line says)
        self._interrupted = False  # a SIGINT arrived
        self.overlap = overlap
        self.flag_lag = 0  # the non-finite flag reported by the last check is from that many steps before it
        self._deferred: Callable[[], int] | None = None  # reads the previous check's flag (kept, not read yet)
        self._host_flag: torch.Tensor | None = None  # pinned, reused: read before it is filled again
        self._reduce: Any = None  # (work, flags) of the all-reduce posted by the previous check, not read yet
        self._previous = {}
        self.sigint_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # left so (the class docstring)
        if self.sigint_ignored:
            log.info(
                "SIGINT is ignored in this process (as its launch set it: a background job of a script, nohup): "
                "Ctrl-C does not stop it; SIGTERM (kill %d) stops it after the step%s",
                os.getpid(),
                " with a checkpoint" if saves else " (checkpointing is off: nothing is saved)",
            )
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None and not (name == "SIGINT" and self.sigint_ignored):
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread (e.g. some launchers): no handler, no stop
                    pass
        self._wakeup = self._count_signals() if signal.SIGINT in self._previous else None

    @staticmethod
    def _count_signals() -> tuple[int, int] | None:
        """(read, write) ends of a pipe whose write end now gets one byte per signal received (the class docstring),
        or None where a wakeup fd was already set (left in place)."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        found = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if found != -1:  # someone else's: theirs again
            signal.set_wakeup_fd(found)
            os.close(read)
            os.close(write)
            return None
        return read, write

    def _sigints(self) -> int:
        """How many SIGINTs arrived since the last call (at least the one being handled)."""
        count = 0
        while self._wakeup is not None:
            try:
                got = os.read(self._wakeup[0], 4096)
            except BlockingIOError:
                break
            count += got.count(signal.SIGINT.value)
        return max(count, 1)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT":
            if self._interrupted or self._sigints() > 1:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
            self._interrupted = True
            how = (
                b"with a checkpoint (Ctrl-C again: at once, without)"
                if self.saves
                else b"(checkpointing is off: nothing is saved; Ctrl-C again: at once)"
            )
            os.write(2, b"\nSIGINT: stopping after this step " + how + b"\n")
        self.received = self.received or name

    def should_stop(self, world: int, nonfinite: torch.Tensor | None = None, *, now: bool = True) -> tuple[bool, bool]:
        """(a stop signal arrived on some rank, a non-finite flag was true on some rank), agreed by all ranks.

        Call once per step, on every rank, with the same ``now`` and a flag on every rank or on none (the
        collectives then match across ranks). ``now=True`` (steps that save, the last step):
        this step's flags, read at once and all-reduced before returning. ``now=False``: this step's flag is kept
        for the next check (a CUDA flag copied to the host without a sync), and with several ranks the all-reduce
        is posted, not waited for; what returns is what earlier checks posted. If that says stop or non-finite,
        this check completes at once as with ``now=True``, and a stop or non-finite value learnt after this step's
        flag was kept (one rank, or ``overlap=False``) reads that flag before returning.
        :attr:`flag_lag` is how many steps before this one the reported non-finite value was (0, 1 or 2).
        """
        earlier = self._collect()  # [stop, bad one check ago, bad two checks ago], agreed; zeros if none
        now = now or any(earlier)
        mine = [0, 0, 0]
        mine[_STOP] = 1 if self.received else 0
        mine[_BAD_BEFORE] = self._read_deferred()
        if nonfinite is not None:
            if now:
                mine[_BAD_NOW] = int(nonfinite.to(device="cpu", dtype=torch.int32))  # a device->host copy and sync
            else:
                self._defer(nonfinite)
        if world > 1:
            flags = torch.tensor(mine, dtype=torch.int32)
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=not now and self.overlap)  # CPU: gloo
            if work is None:
                mine = flags.tolist()
            else:
                self._reduce = (work, flags)
                mine = [0, 0, 0]  # read at the next check
        bad_by_lag = [mine[_BAD_NOW], mine[_BAD_BEFORE] | earlier[1], earlier[2]]
        stop = bool(mine[_STOP] or earlier[0])
        if (stop or any(bad_by_lag)) and self._deferred is not None:  # learnt after this step's flag was kept
            late = torch.tensor([self._read_deferred()], dtype=torch.int32)  # stop/bad are agreed: every rank is here
            if world > 1:
                dist.all_reduce(late, op=dist.ReduceOp.MAX)
            bad_by_lag[0] |= int(late)
        self.flag_lag = max((lag for lag, bad in enumerate(bad_by_lag) if bad), default=0)
        return stop, any(bad_by_lag)

    def _collect(self) -> list[int]:
        """The all-reduce of the previous check (waited for), its bad flags one step older: [stop, lag 1, lag 2]."""
        if self._reduce is None:
            return [0, 0, 0]
        (work, flags), self._reduce = self._reduce, None
        work.wait()
        agreed = flags.tolist()
        return [agreed[_STOP], agreed[_BAD_NOW], agreed[_BAD_BEFORE]]

    def _read_deferred(self) -> int:
        """The flag kept by the previous check (0 if none); a CUDA flag once its copy has landed."""
        if self._deferred is None:
            return 0
        read, self._deferred = self._deferred, None
        return read()

    def _defer(self, nonfinite: torch.Tensor) -> None:
        """Keep this step's flag for the next check: a CUDA flag is copied to the (reused, pinned) host int
        without waiting; a CPU flag is read now and reported later all the same."""
        if nonfinite.device.type != "cuda":
            value = int(nonfinite.to(torch.int32))
            self._deferred = lambda: value
            return
        if self._host_flag is None:
            self._host_flag = torch.empty((), dtype=torch.int32, pin_memory=True)
        self._host_flag.copy_(nonfinite.to(torch.int32), non_blocking=True)  # the previous one was read above
        event = torch.cuda.current_stream(nonfinite.device).record_event()
        self._deferred = lambda: (event.synchronize(), int(self._host_flag))[1]

    @property
    def pending(self) -> bool:
        """Something posted by a check is not read yet (a deferred CUDA flag or an all-reduce): the next check reads
        it. False after any check with ``now=True`` and after any check that reported a stop or a non-finite value."""
        return self._deferred is not None or self._reduce is not None

    def restore(self) -> None:
        """Every handler this object replaced, as it found it (SIG_IGN, SIG_DFL, Python's or another's)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        if self._wakeup is not None:
            read, write = self._wakeup
            found = signal.set_wakeup_fd(-1)
            if found != write:  # set by someone else since: theirs stays
                signal.set_wakeup_fd(found)
            os.close(read)
            os.close(write)
            self._wakeup = None
