"""Fault injection: kill -9 the trainer at random moments and inside saves; every resume must be exact.

    python -m tests.fault.fault_injection --trials 20 --modes sync,async --out table.md   # full
    python -m tests.fault.fault_injection --trials 2                                      # test_reliability's
    python -m tests.fault.fault_injection --trials 4 --overrides "optim=fused_adam_lowmem model.dtype=bf16"  # streamed

Per mode (``checkpoint.async_save`` false/true) an uninterrupted reference run is made once, in this process.
Each trial then launches the recipe (20 steps, a checkpoint every 4 steps) through ``tests/fault/fault_train.py``
and kills it with SIGKILL: even trials at a random moment of the run (within 0.2 s after it logs a random step
of 1 to 19), odd trials at a chosen point of a save (after the export, after DCP wrote or started writing,
before the completion marker: ``--kill-at``). Then it relaunches until the run finishes. Each launch is a
process of its own, forked from a forkserver that imported the recipe once (``tests/forked.py``). A trial
fails if any launch resumed from a checkpoint that was not complete when it started, or if the final checkpoint
(model, optimizer and trainer state) is not bitwise equal to the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from recipes.checkpoint import SAVE_PHASES, is_complete, read_checkpoint
from recipes.job import train
from recipes.train import compose_config
from scripts import cli_args
from tests import forked
from tests.fault import fault_train

STEPS, EVERY = 20, 4
OVERRIDES: list[str] = []  # extra recipe overrides for every launch (--overrides)
RESUME = re.compile(r"resuming from checkpoint (\S+) at step")


@dataclass
class Trial:
    mode: str
    index: int
    fault: str
    killed: bool = False
    killed_in_save: bool = False
    launches: int = 0
    incomplete_seen: int = 0
    resumed_from: list[str] = field(default_factory=list)
    ok: bool = False
    problem: str = ""


def overrides(run_dir: Path, mode: str) -> list[str]:
    """The recipe's overrides of every launch and of the reference run."""
    return [
        "experiment=quick",
        "trainer.progress=false",
        "trainer.threads=1",
        "trainer.log_every=1",
        f"trainer.max_steps={STEPS}",
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=0",
        f"checkpoint.async_save={mode == 'async'}",
        f"run_dir={run_dir}",
        *OVERRIDES,
    ]


def launch(run_dir: Path, mode: str, kill_at: str | None = None):
    """``python -m tests.fault.fault_train [--kill-at ...] <overrides>`` as a forked process, started; the process
    and the file its stderr goes to."""
    stem = run_dir.with_name(f"{run_dir.name}.launch")
    argv = [*(["--kill-at", kill_at] if kill_at else []), *overrides(run_dir, mode)]
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = forked.start(fault_train.exit_with_main, (argv,), stem, ["tests.fault.fault_train"], env)
    return proc, Path(f"{stem}.stderr")


def final_state(run_dir: Path) -> dict:
    return read_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}")


def equal(a: dict, b: dict) -> str:
    if a.keys() != b.keys():
        return f"different keys: {sorted(a.keys() ^ b.keys())[:4]}"
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        if not same:
            return f"{k} differs"
    return ""


def run_trial(mode: str, index: int, rng: random.Random, work: Path, reference: dict) -> Trial:
    run_dir = work / f"{mode}-{index:03d}"
    if index % 2:
        phase, step = SAVE_PHASES[(index // 2) % len(SAVE_PHASES)], EVERY * rng.randint(1, STEPS // EVERY)
        trial = Trial(mode, index, f"kill in save: {phase} of step {step}")
        kill_at, after_step = f"{phase}:{step}", None
    else:
        after_step, delay = rng.randint(1, STEPS - 1), rng.uniform(0.0, 0.2)
        trial = Trial(mode, index, f"kill -9 {delay:.2f} s after step {after_step}")
        kill_at = None
    for attempt in range(6):
        complete_before = {str(p) for p in (run_dir / "checkpoints").glob("step_*") if is_complete(p)}
        trial.incomplete_seen += sum(1 for p in (run_dir / "checkpoints").glob("step_*") if not is_complete(p))
        proc, stderr = launch(run_dir, mode, kill_at if attempt == 0 else None)
        trial.launches += 1
        if attempt == 0 and after_step is not None:
            forked.wait_for_text(stderr, f"step {after_step}/{STEPS} ", proc, 300)
            time.sleep(delay)
            proc.kill()
        (code,) = forked.join([proc], 300)
        err = stderr.read_text()
        if code is None:
            trial.problem = f"launch {trial.launches} did not finish in 300 s: {err.strip().splitlines()[-1:]}"
            return trial
        for path in RESUME.findall(err):
            trial.resumed_from.append(Path(path).name)
            if path not in complete_before:
                trial.problem = f"resumed from {path}, which was not complete at launch"
                return trial
        if code == -signal.SIGKILL:
            trial.killed = True
            trial.killed_in_save = trial.killed_in_save or kill_at is not None
            continue
        if code != 0:
            trial.problem = f"launch {trial.launches} exited {code}: {err.strip().splitlines()[-1:]}"
            return trial
        break
    else:
        trial.problem = "did not finish in 6 launches"
        return trial
    trial.problem = equal(final_state(run_dir), reference)
    trial.ok = not trial.problem
    return trial


MODES = ("sync", "async")  # checkpoint.async_save=false / true


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=cli_args.positive_int, default=20, help="trials per mode")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=cli_args.out_file, help="write the markdown table here")
    ap.add_argument("--json", type=cli_args.out_file, help="write every trial here")
    ap.add_argument("--overrides", default="", help="extra recipe overrides, space-separated")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or not set(modes) <= set(MODES):  # another name would run sync saves under it
        ap.error(f"--modes={args.modes!r}: modes from {','.join(MODES)}")
    OVERRIDES[:] = args.overrides.split()
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fault-injection-") as tmp:
        work = Path(tmp)
        for mode in modes:
            ref_dir = work / f"{mode}-reference"  # uninterrupted, in this process (one thread, as the launches)
            train(compose_config(overrides(ref_dir, mode)))
            reference = final_state(ref_dir)
            for i in range(args.trials):
                trial = run_trial(mode, i, rng, work, reference)
                trials.append(trial)
                print(
                    f"{mode} #{i}: {trial.fault}: killed={trial.killed} launches={trial.launches} "
                    f"resumed={trial.resumed_from} {'ok' if trial.ok else 'FAIL ' + trial.problem}",
                    flush=True,
                )
    lines = [
        f"Fault injection, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, torch {torch.__version__}: "
        f"`python -m tests.fault.fault_injection --trials {args.trials} --modes {args.modes} --seed {args.seed}"
        f"{' --overrides ' + repr(args.overrides) if args.overrides else ''}` "
        f"({time.time() - t0:.0f} s)",
        "",
        "| mode | trials | processes killed | killed inside a save | incomplete checkpoints found (never loaded) "
        "| resumes | failures |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        ts = [t for t in trials if t.mode == mode]
        lines.append(
            f"| {mode} | {len(ts)} | {sum(t.killed for t in ts)} | {sum(t.killed_in_save for t in ts)} | "
            f"{sum(t.incomplete_seen for t in ts)} | {sum(len(t.resumed_from) for t in ts)} | "
            f"{sum(not t.ok for t in ts)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    for path, content in ((args.out, text), (args.json, json.dumps([asdict(t) for t in trials], indent=1))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    return 0 if all(t.ok for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
