"""What a ``-m`` sweep through submitit (``hydra/launcher=laptop``, ``submitit_local``, ``slurm``) says on the
terminal that started it: its jobs run in processes of their own whose output goes to files under the sweep's
``.submitit/`` folder, so without this the command prints nothing until it ends, and ends without a word. A Hydra
callback (``conf/train.yaml``, ``hydra.callbacks``), run in the process that launches the jobs: where the jobs'
logs are, as soon as the sweep starts; each job's outcome in one line (its ``nothing to do``, ``done`` or
``error`` line) once the jobs have ended. Other launchers (the basic one runs its jobs in this process, whose lines
reach the terminal themselves) are left alone."""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# a line of the recipe's log (recipes/logs.py): "[08:18:46][rank0][recipes.train][INFO] done: ..."
LOG_LINE = re.compile(r"^\[[^]]*\]\[rank\d+\]\[[\w.]+\]\[\w+\] (.*)$")
OUTCOMES = ("nothing to do:", "error: ", "done: ")  # the first of these a job's log has is its outcome


def submitit_folder(config: DictConfig) -> str | None:
    """The launcher's ``submitit_folder`` (``%j``: a job's id) where the sweep's launcher is submitit's, else None."""
    launcher = config.hydra.launcher
    if "hydra_submitit_launcher" not in str(launcher.get("_target_", "")):
        return None
    return str(launcher.submitit_folder)


def outcome(log: str) -> str | None:
    """A job's outcome in its log's text (stderr): its ``nothing to do`` line where it trained nothing, else its
    ``error:`` or ``done:`` line; None where it has none of them (a job that crashed: its log says why)."""
    lines = [LOG_LINE.sub(r"\1", line) for line in log.splitlines()]
    for start in OUTCOMES:
        found = [line for line in lines if line.startswith(start)]
        if found:
            return found[-1]
    return None


class SubmititLogs(Callback):
    """The sweep's lines on stderr, in the launching process (see the module docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = submitit_folder(config)
        if folder is not None:
            log = folder.replace("%j", "<job id>") + "/<job id>_0_log.err"
            print(f"-m: each job runs in a process of its own; its log: {log} (and .out)", file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        folder = submitit_folder(config)
        if folder is None:
            return
        for log in sorted(glob.glob(glob.escape(folder).replace("%j", "*") + "/*_log.err")):
            line = outcome(Path(log).read_text(errors="replace"))
            print(f"-m job log {log}: {line or 'no outcome line (see the log)'}", file=sys.stderr)
