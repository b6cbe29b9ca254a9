"""The training job of ``recipes/train.py``: :func:`train` runs the job a composed config describes (checks,
locks, process group, model, optimizer, checkpoints, the loop, the summary). The entry point imports this module
only once Hydra has composed the config, so that a config error is refused before torch is imported."""

from __future__ import annotations

import contextlib
import gc
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from optim_factory.checkpoint import host_budget
from optim_factory.factory import ConfigError, ValidatedOptim, build_optimizer
from recipes.checkpoint import CheckpointError, CheckpointManager, Loader, PhaseCallback, Saver
from recipes.checkpoint.checksums import writer_options
from recipes.checkpoint.resume import log_changes, nothing_to_do
from recipes.command_line import keys_set
from recipes.config import CONFIG_DIR
from recipes.data import DataError
from recipes.distributed import LaunchError, all_ranks, init_distributed, shutdown
from recipes.evaluate import evaluate
from recipes.launches import record_config
from recipes.logs import FILE_ONLY, MetricsWriter, StepLog, done_text, eval_postfix, eval_text, log, setup_logging
from recipes.model import build_model
from recipes.preflight import preflight, run_dir_refusal
from recipes.progress import progress_bar
from recipes.run_lock import RunDirLock, missing_dirs
from recipes.step import TrainStep, shard_model
from recipes.stop_signal import StopSignal


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became non-finite: the run stops before its next save (exit 2)."""


USER_ERRORS = (ConfigError, CheckpointError, DataError, LaunchError, TrainingDiverged)
DEFAULT_THREADS = torch.get_num_threads()  # torch's own count in this process (trainer.threads=0)
# the objects frozen out of the garbage collector before the recipe's start: the interpreter's own (setup_frozen)
_FROZEN_AT_IMPORT = gc.get_freeze_count()


def _finish_saves(saver: Saver) -> None:
    """The loop failed: an async save in flight is finished and marked complete where it can be (its state is
    from a finished step), so the failure costs only the steps after it; its own failure is logged."""
    try:
        saver.close()
    except Exception as exc:  # noqa: BLE001  (the loop's failure is the one raised)
        log.warning("the checkpoint in flight when training failed was not completed: %s", exc)


def train(cfg: DictConfig, *, on_phase: PhaseCallback | None = None) -> dict[str, Any]:
    """Run the training job that ``cfg`` describes; returns a summary (first/last loss, steps, checkpoints).

    ``on_phase``: called with (phase, step, path) at each point of every save (``recipes.checkpoint.SAVE_PHASES``;
    ``tests/fault/fault_train.py`` kills the process there).
    """
    where = OmegaConf.select(cfg, "checkpoint.dir", throw_on_missing=False)  # None where missing: preflight says so
    created = missing_dirs(where) if where else []  # before preflight makes them
    env, device, data, optim = preflight(cfg)
    locks = [RunDirLock(cfg.run_dir)]  # one launch per run_dir and per checkpoint.dir at once (rank 0 holds them)
    if cfg.checkpoint.enabled and Path(cfg.checkpoint.dir).resolve() != Path(cfg.run_dir).resolve():
        locks.append(RunDirLock(cfg.checkpoint.dir, "checkpoint.dir"))  # (one lock file, not two, where they meet)
    try:
        refusal = run_dir_refusal(cfg, locks) if env.rank == 0 else None
        # 0: torch's default, set explicitly: an earlier sweep job in this process may have set a count
        torch.set_num_threads(cfg.trainer.threads if cfg.trainer.threads > 0 else DEFAULT_THREADS)
        mesh = init_distributed(env, device)
        try:
            views = all_ranks((refusal, created, socket.gethostname()))
            refusal = views[0][0]  # rank 0's: every rank refuses, none waits in a collective
            # the directories this launch made: those any rank of rank 0's host found missing before its preflight
            # made them (a rank that started later finds them made by another; another host's are not rank 0's)
            created = max((made for _, made, host in views if host == views[0][2]), key=len)
            if refusal is not None:
                raise ConfigError(refusal)
            record = record_config(cfg, cfg.run_dir, sys.argv[1:]) if env.rank == 0 else None
            setup_logging(env.rank, cfg.run_dir)
            for lock in locks:
                if lock.unavailable:
                    log.warning("%s=%s: %s", lock.key, lock.run_dir, lock.unavailable)
            try:
                run = Run(cfg, env, device, data, mesh, optim, record, MetricsWriter(cfg.run_dir, env.rank))
                return _train(run, on_phase)
            except USER_ERRORS as exc:  # after logging started: train.log ends with why (stderr: once, from main)
                log.error("%s", exc, extra={FILE_ONLY: True})
                raise
        finally:
            shutdown()
    except USER_ERRORS:
        if env.rank == 0:  # a refusal (no room, a diverged run) before any checkpoint: checkpoint.dir as it was found
            locks[-1].remove_created(created)
        raise
    finally:
        for lock in locks:
            lock.release()


@dataclass
class Run:
    """One launch's training job once its checks passed: what its phases (:func:`_setup`, :func:`_resume`,
    :func:`_loop`, :func:`_summary`) share. Its parts are set by :func:`_setup`, where it starts and ends by
    :func:`_resume`."""

    cfg: DictConfig
    env: Any  # recipes.distributed's launch environment (rank, world size, launcher)
    device: torch.device
    data: Any
    mesh: Any
    optim: ValidatedOptim
    record: Path | None  # this launch's launches/ file (rank 0), removed where the launch is refused
    metrics: MetricsWriter
    model: Any = None
    optimizer: Any = None
    checkpoints: CheckpointManager | None = None  # builds the saver and the loader, checks the first save
    saver: Saver | None = None
    loader: Loader | None = None
    base_lrs: list[float] = field(default_factory=list)  # the config's learning rates, before a resume
    start: int = 0  # the step training starts at
    end: int = 0  # the step this launch stops at (trainer.stop_at, else trainer.max_steps)
    limit: str = "trainer.max_steps"  # the key that ends this launch
    resumed_from: str | None = None


@dataclass
class Stopped:
    """How :func:`_loop` ended: the step log, the last evaluation, the step a signal stopped it at and the signal."""

    step_log: StepLog
    last_eval: dict[str, Any] | None
    at: int | None
    by: str | None


@contextlib.contextmanager
def _unrecorded_if_refused(record: Path | None):
    """A refusal inside removes this launch's ``launches/`` record: launches/ holds accepted launches only."""
    try:
        yield
    except USER_ERRORS:
        if record is not None:
            record.unlink(missing_ok=True)
        raise


def _resume(run: Run) -> None:
    """Where ``run`` starts: the newest good checkpoint loaded into its model and optimizer with the process RNG,
    its config changes logged and recorded; refused (and this launch's record removed) where a changed key would
    take effect in no step, or where the run's next save cannot fit (a fresh run's: estimated from the model,
    ``first_save_bytes``) or exceeds the optimizer's host budget (``CheckpointManager.check_first_save``), before
    the first step."""
    cfg, model, optimizer = run.cfg, run.model, run.optimizer
    template = {"step": 0, "data_position": 0, "world_size": 0, "rng_state": torch.get_rng_state()}
    with _unrecorded_if_refused(run.record):
        path, state = run.checkpoints.resume(model, optimizer, template) or (None, template)
        run.start, changes = int(state["step"]), run.loader.resume_changes
        if run.start >= run.end and changes:  # keys that would change nothing: refused, nothing recorded
            raise ConfigError(nothing_to_do(run.start, run.end, str(path), changes, run.limit))
        if run.start < run.end and cfg.checkpoint.enabled:  # its space, its host budget
            run.checkpoints.check_first_save(model, optimizer, template, path)
    if path is None:
        return
    run.resumed_from = str(path)
    torch.set_rng_state(state["rng_state"])
    if run.env.rank == 0:  # with this launch's overrides, where Hydra's command line gave them
        typed = keys_set(list(HydraConfig.get().overrides.task), CONFIG_DIR) if HydraConfig.initialized() else None
        log_changes(changes, typed)
    log.info("resuming from checkpoint %s at step %d (saved by %d rank(s))", path, run.start, state["world_size"])
    for change in changes:
        run.metrics.write(change.record())


def _setup(run: Run, on_phase: PhaseCallback | None) -> None:
    """The run's model, optimizer and checkpoints (``on_phase``: the saver's), with the launch's first log lines."""
    cfg, env = run.cfg, run.env
    run.model = shard_model(build_model(cfg.model, seed=cfg.trainer.seed, device=run.device), run.mesh)
    with _unrecorded_if_refused(run.record):  # the checks that need the model (backend, override patterns)
        run.optimizer = build_optimizer(run.optim, run.model)
    run.checkpoints = CheckpointManager(
        cfg.checkpoint,
        rank=env.rank,
        device=run.device,
        on_report=run.metrics.checkpoint,
        run_config=OmegaConf.to_container(cfg, resolve=True),  # stored in every checkpoint's manifest
        waits_before_step=True,  # TrainStep calls saver.wait_export before optimizer.step()
        on_phase=on_phase,
    )
    run.saver, run.loader = run.checkpoints.saver, run.checkpoints.loader
    run.base_lrs = [float(g["lr"]) for g in run.optimizer.param_groups]
    world, where = env.world_size, Path(cfg.run_dir).resolve()
    log.info("launcher=%s world_size=%d device=%s run_dir=%s", env.launcher, world, run.device, where)
    if cfg.checkpoint.enabled:
        given = cfg.checkpoint.write_threads
        threads = writer_options(run.optimizer, run.checkpoints.write_threads)["thread_count"]
        how = "0: min(4, the CPUs of this rank)" if given == 0 else str(given)
        how += "; one within optim.state_dict_offload_host_budget" if host_budget(run.optimizer) is not None else ""
        log.info("checkpoints: %d writer thread(s) per rank (checkpoint.write_threads=%s)", threads, how)
    if cfg.trainer.warmup_steps > cfg.trainer.max_steps and env.rank == 0:
        warmup, steps = cfg.trainer.warmup_steps, cfg.trainer.max_steps
        log.warning(f"trainer.warmup_steps={warmup} > trainer.max_steps={steps}: the learning rate peaks at "
                    f"{100 * steps / warmup:.3g} % of optim.lr")  # fmt: skip


def _train(run: Run, on_phase: PhaseCallback | None) -> dict[str, Any]:
    """The job after its checks: setup, resume, loop, summary."""
    cfg = run.cfg
    _setup(run, on_phase)
    # the process RNG (dropout-free model: recorded, restored)
    torch.manual_seed(cfg.trainer.seed + 1000 * run.env.rank)
    max_steps = cfg.trainer.max_steps
    run.end = min(max_steps, cfg.trainer.stop_at) if cfg.trainer.stop_at > 0 else max_steps
    run.limit = "trainer.stop_at" if run.end < max_steps else "trainer.max_steps"
    _resume(run)
    if run.start >= run.end:  # a finished run relaunched: nothing changes (launches/ holds launches that trained)
        if run.record is not None:
            run.record.unlink(missing_ok=True)
        log.info(nothing_to_do(run.start, run.end, run.resumed_from, [], run.limit))
    with setup_frozen():
        stopped = _loop(run)
    return _summary(run, stopped)


@contextlib.contextmanager
def setup_frozen() -> Iterator[None]:
    """Runs its block (the recipe's loop) with everything made before it frozen out of the garbage collector
    (``gc.freeze``): the generation-2 collections that a save's many small objects trigger then scan only what the
    block made, not the hundreds of thousands of objects that torch, the model and the optimizer hold
    (docs/recipe.md, "Garbage collection"). Garbage is collected once before the freeze, and the objects are
    unfrozen when the block ends. Where the process froze objects itself (more are frozen than when this module was
    imported: Python 3.12 starts with 375 of its own frozen, which are no owner's), it has an owner of that policy:
    the block runs as it is, nothing collected, frozen or unfrozen."""
    if gc.get_freeze_count() > _FROZEN_AT_IMPORT:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _loop(run: Run) -> Stopped:
    """Steps ``run.start`` to ``run.end``, evaluated and saved where due, until a stop signal."""
    cfg, env, model, data, saver = run.cfg, run.env, run.model, run.data, run.saver
    rank, world, max_steps, start, end = env.rank, env.world_size, cfg.trainer.max_steps, run.start, run.end
    bar = progress_bar(total=end, initial=start, enabled=cfg.trainer.progress if rank == 0 else False)
    train_step = TrainStep(
        model,
        run.optimizer,
        data,
        run.device,
        rank,
        world,
        run.base_lrs,
        warmup_steps=cfg.trainer.warmup_steps,
        max_steps=max_steps,
        grad_clip=cfg.trainer.grad_clip,
        prepare_at=start if cfg.checkpoint.enabled else None,
        before_step=saver.wait_export,
    )
    step_log = StepLog(
        run.metrics, bar, world=world, start=start, end=end, max_steps=max_steps, every=cfg.trainer.log_every
    )
    due = run.checkpoints.due
    stop, stopped_at, last_eval = StopSignal(saves=cfg.checkpoint.enabled), None, None
    model.train()
    try:
        for step in range(start, end):
            result = train_step(step)
            done = step + 1
            step_log(done, result)
            if cfg.trainer.eval_every > 0 and (done % cfg.trainer.eval_every == 0 or done == end):
                last_eval = {"step": done, **evaluate(model, data, rank, world, run.device)}
                run.metrics.write({"kind": "eval", **last_eval})
                log.info("eval %s", eval_text(last_eval))
                step_log.postfix.update(eval_postfix(last_eval))
                bar.set_postfix(**step_log.postfix)
                step_log.t_since += last_eval["eval_s"]  # tokens/s counts training time only
            bar.update(1)
            # synchronous where a checkpoint may follow; elsewhere a step or two late (recipes/stop_signal.py)
            stopping, diverged = stop.should_stop(world, result.nonfinite, now=due(done, end) or done == end)
            if diverged:
                saver.close()  # an async save of an earlier (finite) step finishes and is marked complete
                raise TrainingDiverged(
                    f"step {done - stop.flag_lag}: non-finite loss or gradient norm (NaN/inf); stopped before saving, "
                    f"the newest good checkpoint is {saver.verified or 'none'} (lower optim.lr, set "
                    "trainer.grad_clip, or check the data)"
                )
            if due(done, end) or (stopping and cfg.checkpoint.enabled):
                state = {"step": done, "data_position": done, "world_size": world, "rng_state": torch.get_rng_state()}
                saver.save(done, model, run.optimizer, state)
                # a signal during the save: this save is the stop's checkpoint (no further step, no second save)
                stopping = stopping or stop.should_stop(world)[0]
            if stopping and done < end:  # a stop at the last step is the end of the run
                stopped_at = done
                log.warning(
                    "stopping at step %d on %s%s",
                    done,
                    stop.received or "a signal on another rank",
                    " (checkpoint saved); a new launch resumes here" if cfg.checkpoint.enabled else "",
                )
                break
    except Exception:
        if world == 1:  # with several ranks, marking a save complete needs every rank's agreement
            _finish_saves(saver)
        raise
    finally:
        stop.restore()  # also when a step or a save raises
    bar.close()
    saver.close()
    return Stopped(step_log, last_eval, stopped_at, stop.received)


def _summary(run: Run, stopped: Stopped) -> dict[str, Any]:
    """The run's summary (``metrics.jsonl``'s last record; rank 0 logs it for a person)."""
    cfg, rank, reports, step_log = run.cfg, run.env.rank, run.saver.reports, stopped.step_log
    summary = {
        "start_step": run.start,
        "resumed_from": run.resumed_from,
        "end_step": stopped.at if stopped.at is not None else max(run.start, run.end),
        "first_loss": step_log.first_loss,
        "last_loss": step_log.last_loss,
        "eval": stopped.last_eval,
        "saved_checkpoints": [r.path for r in reports],  # by this launch, in order (keep_last may delete)
        # per checkpoint of this launch: how long it held the loop and the bytes written (rank 0), as logged
        "checkpoints": [r.summary() for r in reports],
        # complete checkpoints in checkpoint.dir at the end, after keep_last, oldest first (rank 0 applies it)
        "kept_checkpoints": [str(p) for _, p in run.checkpoints.complete()] if rank == 0 else None,
        "stopped_at": stopped.at,
        "stopped_by": (stopped.by or "a signal on another rank") if stopped.at is not None else None,
    }
    run.metrics.summary(summary, trained=run.end > run.start)  # a no-op relaunch keeps the last one in metrics.jsonl
    if rank == 0:
        where = cfg.checkpoint.dir if cfg.checkpoint.enabled else None
        log.info(done_text(summary, run.metrics.path, where, run.limit))
    return summary
