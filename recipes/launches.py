"""The records of a run_dir's accepted launches: ``<run_dir>/launches/<time>-<pid>[-<n>].yaml``, one resolved
config each (read by the preflight: a run_dir's earlier launches, the checkpoint.dir they saved into)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

LAUNCHES = "launches"  # <run_dir>/launches/: one resolved config per accepted launch


def earlier_launches(run_dir: str) -> list[Path]:
    """The records of the launches accepted so far in ``run_dir`` (:func:`record_config`), oldest first."""
    folder = Path(run_dir) / LAUNCHES
    return sorted(folder.glob("*.yaml")) if folder.is_dir() else []


def record_config(cfg: DictConfig, run_dir: str, argv: list[str]) -> Path:
    """Write the resolved config of an accepted launch to ``<run_dir>/launches/<time>-<pid>[-<n>].yaml``.

    A new file per launch, written only after every check passed: a later launch, rejected or not, never
    overwrites the record of an earlier one, also in the same process and second (``-<n>``: a Hydra sweep's
    jobs, tests). The job removes it again where the resume refuses the launch or leaves it nothing to train.
    """
    folder = Path(run_dir) / LAUNCHES
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    text = f"# python recipes/train.py {' '.join(argv)}\n" + OmegaConf.to_yaml(cfg)
    n = 0
    while True:
        path = folder / (f"{stem}.yaml" if n == 0 else f"{stem}-{n}.yaml")
        try:
            with open(path, "x") as f:  # created here, never an earlier launch's file
                f.write(text)
            return path
        except FileExistsError:
            n += 1
