"""Train a small decoder-only transformer with FSDP2 and DCP checkpoints.

    python recipes/train.py [overrides]                        # one process (CPU or one GPU)
    torchrun --nproc_per_node=2 recipes/train.py [overrides]   # several processes
    python recipes/train.py optim.state_dict_cpu_offload=true optim.exp_avg_dtype=bf16

Config: ``conf/train.yaml`` (groups optim, model, data, checkpoint, trainer; presets in ``experiment/``).
Every config value is checked before the process group, the model or a GPU allocation exists, and before
anything is written: a config error is one line on stderr and exit code 2, and leaves the disk as it was.

This module is the command line (``main``; ``compose_config``, from ``recipes/composing.py``); the job itself is
``recipes/job.py`` (``train``), imported once Hydra has composed the config: a config error Hydra finds (an unknown
key, a bad value) is refused before torch is imported.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `recipes` and `optim_factory` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes.command_line import command_line_error, config_error_line, shared_run_dir_error
from recipes.composing import compose_config
from recipes.config import CONFIG_DIR

EXIT_INTERRUPTED = 130  # a plain run stopped by Ctrl-C, as for any interrupted command
# a Ctrl-C outside the loop's clean stop (before it, or a second one: recipes/stop_signal.py)
INTERRUPTED_LINE = "interrupted by Ctrl-C: the step in progress is not saved; the complete checkpoints are as they were"


def _refuse(message: str) -> None:
    # one write of the whole line: the ranks of a torchrun job refuse at once, and print()'s two writes (the text,
    # then the newline) can let two ranks' lines run into one
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(2)


def _which_job(message: str) -> str:
    """``message`` prefixed, in a ``-m`` sweep, with the job that refused (with the basic launcher the sweep
    stops there; the submitit launcher's other jobs, processes of their own, run on)."""
    hydra_cfg = HydraConfig.get()
    return f"-m job {hydra_cfg.job.num}: {message}" if hydra_cfg.mode == RunMode.MULTIRUN else message


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def _task(cfg: DictConfig) -> None:
    """Hydra's task function: one job (one process of a run, or one point of a ``-m`` sweep)."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:  # e.g. an interpolation to a missing key
        _refuse(config_error_line(exc))
    from recipes.job import USER_ERRORS, train  # composed: the job's imports (torch) run from here

    try:
        summary = train(cfg)
    except USER_ERRORS as exc:
        _refuse(_which_job(str(exc)))
    except (HydraException, OmegaConfBaseException) as exc:  # a bug in the task, not a config error: main()
        raise RuntimeError(f"{type(exc).__name__} in the training job") from exc  # must not report it as one
    hydra_cfg = HydraConfig.get()
    in_process_sweep = hydra_cfg.mode == RunMode.MULTIRUN and hydra_cfg.launcher._target_.endswith(".BasicLauncher")
    if in_process_sweep and summary["stopped_at"] is not None:
        # a signal (Ctrl-C, a requeue's SIGTERM) stops the sweep, not only its job: the basic launcher runs the
        # jobs in this process and would go on to the next ones (a Ctrl-C'd sweep would train on and exit 0)
        print(
            f"-m job {hydra_cfg.job.num} stopped at step {summary['stopped_at']} by {summary['stopped_by']}: the sweep "
            "stops here (run the same command again to resume it)",
            file=sys.stderr,
        )
    elif "TORCHELASTIC_RUN_ID" not in os.environ and hydra_cfg.mode != RunMode.RUN:
        return  # a sweep's finished job: the launcher (basic: this process; submitit: its job) has more to do
    # A torchrun worker, a plain run or a stopped sweep, whose work is done: its exit code, as a SystemExit, which
    # passes through Hydra's launcher (it catches Exception), so that a stopped sweep starts no further job.
    # A run stopped by Ctrl-C did not finish: 130 as for any interrupted command (`train && next` stops);
    # torchrun's workers exit 0 (the agent reports the interrupt), as do stops on SIGTERM/SIGUSR1 (requeues).
    interrupted = summary["stopped_by"] == "SIGINT" and "TORCHELASTIC_RUN_ID" not in os.environ
    raise SystemExit(EXIT_INTERRUPTED if interrupted else 0)


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``, else ``sys.argv[1:]``): Hydra's (overrides, ``--cfg job``, ``-m`` with the
    launchers in ``conf/hydra/launcher``), except that every config error Hydra finds while composing is one line
    on stderr with exit code 2.

    Returns the exit code of a run whose work is done: 0, or 130 for a plain run stopped by Ctrl-C. A refusal
    raises ``SystemExit(2)`` after its one line on stderr. ``HYDRA_FULL_ERROR=1`` makes Hydra raise its errors
    instead of printing them over several lines and exiting with 1. The task turns its own Hydra/OmegaConf errors
    into ``RuntimeError`` (with traceback), so what is caught here comes from composing a config (also a sweep
    point's).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    error = command_line_error(argv, CONFIG_DIR) or shared_run_dir_error(argv, compose_config)
    if error:
        _refuse(error)
    saved_argv, saved_full_error = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    saved_hydra_cfg = HydraConfig.instance().cfg  # put back after the job: ${hydra:...} would resolve against it
    sys.argv = [saved_argv[0] if saved_argv else "train.py", *argv]  # hydra.main parses sys.argv
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _task()
    except SystemExit as done:
        if done.code not in (0, EXIT_INTERRUPTED):  # a refusal (2), or an error of Hydra's own argument parser
            raise
        return done.code
    except KeyboardInterrupt:  # the stop at once a Ctrl-C asks for, said in one line
        sys.stderr.write(f"{INTERRUPTED_LINE}\n")
        return EXIT_INTERRUPTED
    except (HydraException, OmegaConfBaseException) as exc:
        _refuse(config_error_line(exc, [a for a in argv if not a.startswith("-")]))
    finally:
        sys.argv = saved_argv
        HydraConfig.instance().cfg = saved_hydra_cfg  # a later compose_config in this process is no job's
        if saved_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full_error
    return 0  # a -m sweep, --cfg, --info, --help


if __name__ == "__main__":
    code = main()  # a refusal raises SystemExit(2): the interpreter exits as usual
    # work done: skip interpreter teardown, where gloo's threads can abort the process after a success ("terminate
    # called without an active exception", exit -6)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
