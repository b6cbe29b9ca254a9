"""The preflight: every check of a launch that needs no heavy work, in order, before the process group, the model
or a GPU allocation exists and before anything is written (one line each; the caller exits 2).

:func:`preflight` checks the config (keys, the optimizer's values, every group's own rules and those across groups,
which the schemas hold), then the environment: the launcher's variables, the device, the data for the world size
and its file, ``run_dir`` and ``checkpoint.dir``. :func:`run_dir_refusal` holds the checks that rank 0 makes
against other launches once the locks are taken (earlier launches in ``run_dir``, checkpoints moved elsewhere).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from optim_factory.factory import ConfigError, validate_optim_config
from recipes.checkpoint import (
    METADATA,
    STEP_DIR,
    CheckpointError,
    checkpoint_key,
    is_complete,
    read_manifest,
    step_dirs,
)
from recipes.config import CheckpointConfig, TrainConfig, check_config
from recipes.data import build_data
from recipes.distributed import pick_device, resolve_dist_env
from recipes.evaluate import check_eval_config
from recipes.launches import earlier_launches
from recipes.run_lock import RunDirLock


def preflight(cfg: DictConfig):
    """Every check that needs no heavy work, in this order: the keys; the optimizer's config; every other group's
    own rules (the composed config converted once to its schemas, whose ``__post_init__`` hold them:
    recipes/config.py); the launcher, the device, the data for the world size and its file; the rules across
    groups (``TrainConfig.check``); an evaluation the token file can feed, ``run_dir`` and ``checkpoint.dir``.
    Nothing is written before the last check (``checkpoint.dir``'s, which creates it). Returns (launch env,
    device, data, validated optimizer config)."""
    check_config(cfg)
    optim = validate_optim_config(cfg.optim)
    if cfg.optim.get("use_decoupled_grad", False):
        unread = (
            "FusedAdam would read param.decoupled_grad, which this recipe's loop never sets (it sets .grad): no "
            "parameter would be updated"
        )
        raise ConfigError("optim.use_decoupled_grad", True, unread, shown="true")
    typed: TrainConfig = OmegaConf.to_object(cfg)
    env = resolve_dist_env(os.environ)
    device = pick_device(typed.trainer.device, env.local_rank)
    data = build_data(typed.data, typed.model.vocab_size, env.world_size)
    typed.check()
    check_eval_config(typed.trainer, data)
    check_run_dir(typed.run_dir)
    check_checkpoint_config(typed.checkpoint, env.rank)
    return env, device, data, optim


def check_run_dir(run_dir: str) -> None:
    """``run_dir`` is a directory, or can be created as one, and is writable: checked without creating anything."""
    path = Path(run_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise ConfigError("run_dir", run_dir, f"not a directory{where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("run_dir", run_dir, f"{existing} is not writable")


def check_checkpoint_config(cfg: CheckpointConfig, rank: int = 0) -> None:
    """The checkpoint directory and a given ``checkpoint.resume`` path before any heavy work (one-line
    CheckpointError; the rules of the config alone: :class:`recipes.config.CheckpointConfig`)."""
    if not cfg.enabled:  # an earlier launch's run_dir is refused by the recipe (its launches/, read by rank 0)
        return
    checkpoint_key(cfg)  # checkpoint.key_env names a variable that holds a key
    root = Path(cfg.dir)
    if cfg.resume not in ("auto", "never"):
        path = Path(cfg.resume)
        if not path.exists():
            raise CheckpointError(
                f"checkpoint.resume={cfg.resume!r}: no such directory; expected auto|never|<path of a step_* directory>"
            )
        if not (path / METADATA).is_file():
            raise CheckpointError(
                f"checkpoint.resume={cfg.resume!r}: not a checkpoint directory (no {METADATA}); "
                "expected auto|never|<path of a step_* directory>"
            )
        _check_nothing_newer(cfg, path, root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{rank}-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"checkpoint.dir={cfg.dir!r}: not writable ({exc.strerror or exc})") from None
    if cfg.resume == "never":
        existing = step_dirs(root)
        if existing:
            raise CheckpointError(
                f"checkpoint.resume=never but checkpoint.dir={cfg.dir!r} already holds {len(existing)} checkpoint(s) "
                f"(e.g. {existing[-1][1].name}); use resume=auto or another checkpoint.dir"
            )


def _check_nothing_newer(cfg: CheckpointConfig, path: Path, root: Path) -> None:
    """An explicit ``checkpoint.resume`` path must be at least as new as every complete checkpoint in
    ``checkpoint.dir``: a later ``resume=auto`` (a requeue, a plain relaunch) would otherwise jump to those, and
    ``keep_last`` would keep them before this run's own."""
    try:  # the step its manifest records: a symlink or a copy need not be named step_*
        step = int(read_manifest(path)["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        match = STEP_DIR.match(path.resolve().name)
        if match is None:
            return  # no step to compare: the load refuses a checkpoint without a manifest
        step = int(match.group(1))
    here = path.resolve()
    newer = [p.name for s, p in step_dirs(root) if s > step and is_complete(p) and p.resolve() != here]
    if newer:
        raise CheckpointError(
            f"checkpoint.resume={cfg.resume!r} but checkpoint.dir={cfg.dir!r} holds newer complete checkpoints "
            f"({', '.join(newer)}), which a later resume=auto would continue instead of this run; use "
            f"checkpoint.resume=auto to continue the newest, another checkpoint.dir (e.g. run_dir=<new>) to "
            f"train on from {path.name}, or remove the newer ones to rewind this run"
        )


def run_dir_refusal(cfg: DictConfig, locks: list[RunDirLock]) -> str | None:
    """Rank 0's checks of ``run_dir`` against other launches, the lock first (one line, or None; a refusal writes
    nothing): read by one rank, since this launch's own record (written by rank 0 after them) would refuse a
    later rank's. Any failure is a line too: the other ranks learn it after the process group is up."""
    for lock in locks:
        try:
            lock.acquire()
        except ConfigError as exc:
            return str(exc)
        except OSError as exc:
            return f"{lock.key}={lock.run_dir!r}: cannot take its lock ({exc.strerror or exc})"
    try:
        earlier = earlier_launches(cfg.run_dir)
        if not cfg.checkpoint.enabled and earlier:
            return (
                f"checkpoint.enabled=false but run_dir={cfg.run_dir!r} holds {len(earlier)} earlier launch(es) "
                "(launches/): without checkpoints this launch would train from step 0 again, resuming nothing, "
                "and append a second history to its metrics.jsonl; use another run_dir"
            )
        moved = _checkpoints_elsewhere(cfg, earlier)
        if moved:
            return moved
        for lock in locks:
            lock.note_holder()
    except OSError as exc:
        return f"run_dir={cfg.run_dir!r}: cannot read its launches or note this one ({exc.strerror or exc})"
    return None


def _checkpoints_elsewhere(cfg: DictConfig, earlier: list[Path]) -> str | None:
    """A ``checkpoint.dir`` changed since the last launch in this run_dir, the new one empty and the old one not:
    ``resume=auto`` would train from step 0 again without a word and append a second history to metrics.jsonl.
    The refusal, or None."""
    ckpt = cfg.checkpoint
    if not (ckpt.enabled and earlier and ckpt.resume == "auto") or step_dirs(Path(ckpt.dir)):
        return None
    previous = OmegaConf.load(earlier[-1]).get("checkpoint", {}).get("dir")
    if not previous or Path(previous).resolve() == Path(ckpt.dir).resolve() or not step_dirs(Path(previous)):
        return None
    return (
        f"checkpoint.dir={ckpt.dir!r} holds no checkpoint, but the last launch in run_dir={cfg.run_dir!r} saved into "
        f"{previous!r}: this launch would train from step 0 again and append a second history to its metrics.jsonl; "
        f"keep checkpoint.dir={previous}, pass checkpoint.resume=<one of its step_* folders>, or use another run_dir"
    )
