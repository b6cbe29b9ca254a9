"""The load of a checkpoint: the candidates (``checkpoint.resume``, with ``checkpoint.fallback`` the older ones),
the config check (recipes/checkpoint/resume.py), verification against the manifest, DCP's read into host copies
(in the saved dtypes: ``optim_factory.checkpoint.ExactLoadPlanner``), and the config's hyperparameters put back
(docs/reliability.md, "Resume").

A load first verifies every file of the manifest (present, recorded size, recorded hash; the ranks share the files
to read) and refuses a damaged checkpoint in one line, before anything is read into the model or optimizer; only a
complete read is set into the live model and optimizer. One :class:`Loader` per run, built by the checkpoint
manager (recipes/checkpoint/manager.py), which hands the loaded checkpoint to the saver as the newest verified one.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from optim_factory.checkpoint import ExactLoadPlanner, HostCopies, SafeFileSystemReader, finish_load, prepare_load
from optim_factory.errors import first_line
from recipes.checkpoint import resume
from recipes.checkpoint.checksums import file_problem
from recipes.checkpoint.layout import (
    DCP_ERRORS,
    FALLBACK_HINT,
    MARKER,
    METADATA,
    STEP_DIR,
    CheckpointError,
    DamagedCheckpoint,
    checkpoint_key,
    is_complete,
    read_manifest,
    set_aside,
    step_dirs,
    unsafe_refusal,
)
from recipes.distributed import all_ranks, world_size

log = logging.getLogger(__package__)  # recipes.checkpoint: one logger for the package


class Loader:
    """The loads of one run: which checkpoint to resume from, its verification and its read."""

    def __init__(self, cfg, *, rank: int, options: StateDictOptions, run_config: dict[str, Any] | None):
        """``cfg``: the run's ``checkpoint`` config; ``options``: DCP's state dict options (as the saves');
        ``run_config``: the run's resolved config, checked against a checkpoint's (recipes/checkpoint/resume.py)."""
        self.cfg, self.rank, self.options, self.run_config = cfg, rank, options, run_config
        self.root = Path(cfg.dir)
        self.key = checkpoint_key(cfg)  # checkpoint.key_env's: a checkpoint must be signed with it to load
        self.resume_changes: list = []  # resume.Change: how the run's config differs from the last loaded one's

    def candidates(self) -> list[Path]:
        """Checkpoints to try, newest first, per ``checkpoint.resume`` (empty: start fresh). With ``auto``, rank 0
        removes every incomplete step directory (a save cut short: a crash, a second Ctrl-C), in one line each:
        nothing can load it, and left there it would be reported again by every later launch."""
        if not self.cfg.enabled or self.cfg.resume == "never":
            return []
        if self.cfg.resume != "auto":
            return [Path(self.cfg.resume)]
        done = []
        for step, path in step_dirs(self.root):
            if is_complete(path):
                done.append(path)
            elif self.rank == 0:
                missing = " or ".join(n for n in (METADATA, MARKER) if not (path / n).is_file())
                log.warning(
                    "removing the incomplete checkpoint %s (step %d): its save did not finish (no %s), nothing can "
                    "resume from it",
                    path,
                    step,
                    missing,
                )
                try:
                    shutil.rmtree(path)
                except OSError as exc:  # never loaded either way; said again at the next launch
                    log.warning("could not remove %s: %s", path, exc)
        return done[::-1]

    def resume(self, model, optimizer, trainer_state: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest loadable checkpoint; with ``checkpoint.fallback``, older ones after a failure.

        Returns (path, trainer state) or None when there is nothing to resume. A checkpoint that fails to load
        raises CheckpointError (or, with fallback, is logged and skipped); the live model and optimizer are
        only written once a checkpoint has been read completely. Once an older checkpoint has loaded, the
        skipped ones that failed verification are set aside (``layout.set_aside``, by rank 0); a resume that
        fails changes nothing on disk.
        """
        candidates = self.candidates()
        damaged: list[Path] = []
        for i, path in enumerate(candidates):
            try:
                state = self.load(path, model, optimizer, trainer_state)
            except CheckpointError as exc:
                if not exc.older_may_load or not (self.cfg.fallback and i + 1 < len(candidates)):
                    if exc.older_may_load and self.cfg.fallback:  # the hint's advice is taken: say why it did not help
                        why = (
                            "checkpoint.fallback applies to resume=auto, not to a given path"
                            if self.cfg.resume != "auto"
                            else "no older complete checkpoint is left to fall back to"
                        )
                        raise CheckpointError(str(exc).replace(FALLBACK_HINT, why)) from exc
                    raise
                why = str(exc).replace(f"; {FALLBACK_HINT}", "")  # the hint is being followed
                log.warning("%s; checkpoint.fallback=true: trying the older %s", why, candidates[i + 1])
                if isinstance(exc, DamagedCheckpoint):
                    damaged.append(path)
                continue
            if self.rank == 0:  # no collective: every rank saw the same verdict (verification shares it)
                for bad in damaged:
                    set_aside(bad)
            return path, state
        return None

    def load(self, path: Path, model, optimizer, trainer_state: dict[str, Any]) -> dict[str, Any]:
        """Load ``path`` into model, optimizer and a copy of ``trainer_state``; return the loaded trainer state.

        The manifest is read once (its own hash, with ``checkpoint.key_env`` its MAC, checked); a config change that
        ``recipes.checkpoint.resume.RESUME_RULES`` refuses raises first (one line); the checkpoint is then verified
        against it (:meth:`verify`). DCP reads into host copies of the state dicts; only a
        complete read is set into the live model and optimizer, so a damaged or mismatched checkpoint leaves the
        model and the optimizer's values untouched. The optimizer's states exist from here on: our classes create
        them by ``initialize_states()`` (zeros, the master from the parameter, step 0) before the template; for
        another optimizer DCP creates them by a step on zero gradients.
        """
        manifest = read_manifest(path, self.key)
        changes = resume.check_config(path, manifest, self.run_config)  # a refused change: one line, nothing read yet
        self.verify(path, manifest)
        prepare_load(optimizer)  # else DCP's template makes the states by a step on zero gradients (allocated)
        msd, osd = get_state_dict(model, optimizer, options=self.options)
        copies = HostCopies(pinned=False)  # DCP reads into these; the live state is written after a complete read
        state, copied = copies.copy({"model": msd, "optim": osd, "trainer": dict(trainer_state)})
        copied()
        del msd, osd
        hyperparameters = capture_hyperparameters(optimizer)
        try:  # read as data (nothing in it runs); the optimizer's states in their saved dtypes, converted exactly
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=ExactLoadPlanner())
        except DCP_ERRORS as exc:  # DCP's errors are long: name the checkpoint and the first rank's error
            refusal = unsafe_refusal(exc)
            if refusal is not None:  # its bytes are not what this recipe writes: an older checkpoint may load
                raise DamagedCheckpoint(f"checkpoint {path} is refused: {refusal}; {FALLBACK_HINT}") from exc
            line = first_line(exc, named=True)
            raise CheckpointError(f"checkpoint {path} cannot be loaded into this run: {line}") from exc
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=self.options
        )
        finish_load(optimizer)  # the masters from the parameters just loaded (set_state_dict loads the model last)
        restore_hyperparameters(optimizer, hyperparameters)  # the config's, not the checkpoint's
        self.resume_changes = changes  # logged by the caller once it accepts them (resume.log_changes)
        return state["trainer"]

    def verify(self, path: Path, manifest: dict[str, Any]) -> None:
        """Check ``path`` against its ``manifest``: every file present, with the recorded size and hash.

        The files (sorted by name) are dealt out to the ranks round-robin, so each byte is read once by one
        rank whatever the world size (the checkpoint's files do not depend on it); the verdicts are shared
        (one collective), so all ranks raise the same CheckpointError or none does. A checkpoint
        written before checksums were recorded (no ``files`` in its manifest) is loaded with a warning.
        """
        files = manifest.get("files")
        problem = None
        named = STEP_DIR.match(Path(path).name)
        if named is not None and int(named.group(1)) != manifest.get("step"):
            # renamed: resume=auto and keep_last go by the name, the run by the manifest's step
            problem = f"its name says step {int(named.group(1))}, its {MARKER} step {manifest.get('step')} (renamed?)"
        elif files is None and self.key is not None:
            problem = "it records no checksums, so nothing in it is signed (checkpoint.key_env is set)"
        elif files is None:
            if self.rank == 0:
                log.warning(
                    "checkpoint %s has no checksums (written before they were recorded): loading it unverified", path
                )
        else:
            for name in sorted(files)[self.rank :: world_size()]:
                try:
                    problem = file_problem(Path(path), name, files[name], self.key)
                except OSError as exc:
                    problem = f"{name}: unreadable ({exc.strerror or exc})"
                except Exception as exc:  # noqa: BLE001  (a malformed record: every rank must reach the verdicts)
                    problem = f"{name}: its record cannot be checked ({first_line(exc, named=True)})"
                if problem:
                    break
        problem = next((v for v in all_ranks(problem) if v), None)
        if problem:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: {problem}; {FALLBACK_HINT}")


# the group values the config sets (DCP's load puts the checkpoint's back; restore_hyperparameters undoes that):
# FusedAdam's, and AdamW's foreach (without it in this list the checkpoint's value stays)
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "foreach")


def capture_hyperparameters(optimizer: torch.optim.Optimizer) -> list[tuple[list, dict[str, Any]]]:
    """Each group's parameters and hyperparameters as the config built them (before a load replaces them)."""
    return [
        (
            list(g["params"]),
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k in HYPERPARAMETERS},
        )
        for g in optimizer.param_groups
    ]


def restore_hyperparameters(optimizer: torch.optim.Optimizer, captured: list[tuple[list, dict[str, Any]]]) -> None:
    """Put the config's hyperparameters back into each group (after a load); the groups keep their parameters."""
    if len(captured) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the load changed the optimizer's groups ({len(captured)} -> {len(optimizer.param_groups)})"
        )
    for group, (params, values) in zip(optimizer.param_groups, captured):
        if [id(p) for p in group["params"]] != [id(p) for p in params]:
            raise CheckpointError("the load changed the parameters of an optimizer group")
        for k, v in values.items():
            if isinstance(v, torch.Tensor) and isinstance(group.get(k), torch.Tensor):
                group[k].copy_(v)
            else:
                group[k] = v
