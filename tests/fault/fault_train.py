"""The training recipe with a checkpoint manager that SIGKILLs its own process at one point of one save.

    python -m tests.fault.fault_train --kill-at write:8 experiment=quick run_dir=/tmp/run   # then Hydra overrides

``--kill-at PHASE:STEP`` picks the point: PHASE is one of ``recipes.checkpoint.SAVE_PHASES`` (``export``: after
the optimizer export; ``write``: after DCP wrote, or started writing with async saves; ``marker``: before the
completion marker), STEP the step whose save it is. Without ``--kill-at`` it trains like ``recipes/train.py``.
If the run finishes without reaching the point (no save at that step), it exits 3, so that a fault-injection
trial never passes without its fault. Used by ``tests/fault/fault_injection.py``; one process (no torchrun).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from recipes.checkpoint import SAVE_PHASES, PhaseCallback
from recipes.job import USER_ERRORS, train
from recipes.train import compose_config


def kill_point(text: str) -> tuple[str, int]:
    """``"PHASE:STEP"`` -> (phase, step), or one line naming the value and what is allowed."""
    phase, _, step = text.partition(":")
    if phase not in SAVE_PHASES or not step.isdigit() or int(step) < 1:
        raise argparse.ArgumentTypeError(
            f"--kill-at={text!r}: must be PHASE:STEP with PHASE one of {', '.join(SAVE_PHASES)} and STEP >= 1"
        )
    return phase, int(step)


def killing_at(phase: str, step: int) -> PhaseCallback:
    """An ``on_phase`` callback that SIGKILLs the process at ``phase`` of the save of ``step``."""

    def kill(at_phase: str, at_step: int, path: Path) -> None:
        if (at_phase, at_step) == (phase, step):
            os.kill(os.getpid(), signal.SIGKILL)

    return kill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kill-at", type=kill_point, help="PHASE:STEP, e.g. write:8")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for recipes/train.py")
    args = ap.parse_args(argv)
    try:  # a config error: one line and exit 2, as recipes/train.py gives it (not a traceback and exit 1)
        cfg = compose_config(args.overrides)
        if args.kill_at is None:
            train(cfg)
            return 0
        train(cfg, on_phase=killing_at(*args.kill_at))
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    phase, step = args.kill_at
    print(f"error: --kill-at={phase}:{step} was never reached (no save at step {step})", file=sys.stderr)
    return 3


def exit_with_main(argv: list[str]) -> None:
    """:func:`main` as a forked process's whole life (``tests/fault/fault_injection.py`` launches its trainers so,
    through ``tests/forked.py``): the process exits with ``main``'s code."""
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())
