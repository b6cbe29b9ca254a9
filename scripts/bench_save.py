"""The whole save path side by side, in one run: how long the training loop waits per checkpoint.

    torchrun --nproc_per_node=2 -m scripts.bench_save --out DIR --scratch /local/scratch     # 2 GPUs (TE if importable)
    torchrun --nproc_per_node=2 -m scripts.bench_save --out DIR --width 256 --layers 2 --tokens 64   # CPU, gloo

An FSDP2 model (``--layers`` Linear+GELU blocks of ``--width``; BF16 parameters) with FusedAdam (TE's if
importable on CUDA, else PortableFusedAdam): FP32 master, BF16 moments. ``--store-param-remainders`` keeps the FP32
master as TE's ``store_param_remainders`` (the BF16 parameter and the missing 16 bits: 2 bytes instead of 4).
The default size gives each of 2 ranks 2.2 GB of FP32-equivalent optimizer state (3 states x 4 B x 184M local
parameters). Training uses one fixed batch.

Modes (each steps an optimizer of its own, over the one model, built with its export options):

* ``a-te-async-pinned``: TE's export (offload off) via ``get_optimizer_state_dict`` + ``dcp.async_save`` with
  DCP's ``DefaultStager(StagingOptions(use_pinned_memory, use_async_staging, use_non_blocking_copy))``, the stager
  kept across saves as torch >= 2.13 keeps it (where this torch's stager serves one save, torch 2.11,
  pytorch/pytorch#183413: ``scripts.dcp_stagers.KeptStager``, 2.13's staging; a new one per save with ``--stager
  fresh``), and staging awaited before the next ``optimizer.step()``: torchtitan's ``async_with_pinned_mem`` (its
  ``maybe_wait_for_staging``). Thread executor and no shared memory here (torchtitan's process executor is what
  shared memory is for); on CPU no pinning and blocking copies.
* ``b-te-cpu-offload``: (a) with ``StateDictOptions(cpu_offload=True)``.
* ``c-ours``: the recipe's path: chunked + reused buffers + ``state_dict_offload_background``, saved by
  ``recipes.checkpoint.CheckpointManager`` (async, the library's ``AsyncSaveStager``; finite check and checksums
  included). The save call returns before the export is filled; the next forward and backward overlap it and
  ``Saver.wait_export()`` (what the recipe's loop calls) waits for the rest before ``step()``.
* ``c-ours-process``: ``c-ours`` with ``checkpoint.write_in_process=true`` (each rank's DCP write, its checksums
  included, in a writer process of its own).
* ``c-ours-no-background``: ``c-ours`` without the background option (the save call waits for the export).
* ``d-ours-keep-bf16``: ``c-ours`` with ``state_dict_keep_bf16``.
* ``e-te-sync`` / ``e-ours-sync``: synchronous ``dcp.save`` of (a)'s export, and the recipe's synchronous save
  (without the background option).
* ``f-titan-te`` / ``f-titan-ours``: torchtitan 0.3's own ``CheckpointManager`` (``async_with_pinned_mem``)
  around TE's class, and ``optim_factory.integrations.torchtitan.CheckpointManager`` around ours with (c)'s
  options (``f-titan-ours-process``: with ``write_in_process=True``, each rank's DCP write in a writer process of its
  own, as torchtitan's own mode writes in DCP's process executor); ``g-automodel-te`` /
  ``g-automodel-ours``: NeMo Automodel 0.7's ``Checkpointer`` (``is_async``) and
  ``optim_factory.integrations.automodel.Checkpointer`` (``g-automodel-ours-process``: with
  ``write_in_process=True``); ``h-checkpointing-te``: Meta's ``torch_checkpointing`` 0.1.1 around TE's class, its
  default async saver (``scripts.bench_save_frameworks``).
* ``s-stager`` / ``s-stager-process``: the library's ``AsyncSaveStager`` in a plain DCP loop, as docs/export.md's
  loop runs it: (c)'s export options, the export inside ``stager.exporting()``, ``stager.async_save`` (DCP's
  ``FileSystemWriter``, no checks), ``staging_completion`` waited for before the next ``step()``
  (``-process``: ``StagerOptions(write_in_process=True)``); ``s-stager-process-finite``: with
  ``refuse_non_finite=True`` too, the recipe's one other stager option (beside ``c-ours-process``, whose checksums
  and save bookkeeping the difference then holds).
* ``f-titan-ours-budget-<b>`` / ``c-ours-budget-<b>``: torchtitan's manager of the integration and the recipe, the
  optimizer within a host budget (:data:`BUDGETS`); ``f-titan-ours-process-budget-<b>`` /
  ``c-ours-process-budget-<b>``: the same written by a writer process (the fills asked for by it).

Per checkpoint: ``block_s`` (from the save call until training may resume: the save call plus any wait for staging
or for the export before the next ``step()``; for the recipe's modes the part of the recipe's ``blocking_s`` up to
that ``step()``), the GPU peak of the save call above the step boundary, the next
step's GPU peak beyond a plain step's (what a save keeps on the GPU into the next step: (a)'s export until its
staging is done, the overlapping export's chunks), RSS and pinned host bytes (torch's pinned host allocator plus
our pool's registered buffers), bytes on disk, ``complete_s`` (save call until the save was confirmed complete,
after the following steps: an upper bound) and the ``--steps-after`` following step times (8 by default: enough steps
to hold the start of the save's DCP write, whose planning and small pickled items run on DCP's upload thread beside
them, on every path; with 3 the recipe's write, which starts after its finite check, fell after the counted steps and
the frameworks' within them) against the median of as many steps before the save (``steps_before_s`` in the jsonl:
a median of fewer strays, of 3 from 15 % below to 7.5 % above the steady step after a save, p10 to p90 of 240 saves
on an H100, which over 8 steps is up to 0.4x the floor at 4.43 GB), and the generation-2 garbage collections that
ended in that window (how many, the longest; in the jsonl each one's pause, the objects it scanned, those it freed and
its thread). ``--gc frozen`` (the default) runs each mode with what its setup made
frozen out of the collector, as the recipe's loop runs (torchtitan's and Automodel's trainers turn automatic
collection off); ``--gc automatic`` leaves Python's collector as it is, every object scanned by each gen-2 pass.
Each mode's loss is set against its floor, measured in the same run: the bytes it moves to the host (its optimizer
export and the model's parameters) over the pinned device-to-host link (``scripts.bench_export.d2h_bandwidth``),
less one forward and backward, which the next step runs beside the copy. Each mode gets one warm-up checkpoint
(DCP's stager allocates its pinned memory, our pool its buffers), then
``--repeats`` measured ones (medians in the table). Checkpoints go to ``--scratch``; each is deleted once it is
complete and measured (one on the disk at a time: 20 GB at ``--layers 88``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.fsdp import fully_shard

from optim_factory.checkpoint import AsyncSaveStager, StagerOptions
from optim_factory.optimizers.export import ExportOptions
from optim_factory.rules.export import parse_bytes
from recipes.checkpoint import CheckpointManager, state_bytes
from recipes.config import CheckpointConfig
from recipes.distributed import init_distributed, pick_device, resolve_dist_env, shutdown
from recipes.job import setup_frozen
from scripts import cli_args
from scripts.bench_export import PoolBuffers, d2h_bandwidth, environment, sync, wait_pinning, write_results
from scripts.dcp_stagers import EMULATION, KeptStager, stager_reusable

# the host budget of a *-budget-<b> mode, from the FP32 export's bytes S, the model's M and the chunk C
BUDGETS = {
    "all": lambda s, m, c: s + m + c,  # everything, a chunk spare for the save's small tensors (the recipe's RNG)
    "full": lambda s, m, c: s,
    "half": lambda s, m, c: s // 2,
    "quarter": lambda s, m, c: s // 4,
    "min": lambda s, m, c: 2 * c,
}
MODES = (
    "a-te-async-pinned",
    "b-te-cpu-offload",
    "c-ours",
    "c-ours-process",
    "c-ours-no-background",
    "d-ours-keep-bf16",
    "e-te-sync",
    "e-ours-sync",
    "s-stager",
    "s-stager-process",
    "s-stager-process-finite",
    "f-titan-te",
    "f-titan-ours",
    "f-titan-ours-process",
    "g-automodel-te",
    "g-automodel-ours",
    "g-automodel-ours-process",
    "h-checkpointing-te",
    *(f"f-titan-ours-budget-{b}" for b in BUDGETS),
    *(f"c-ours-budget-{b}" for b in BUDGETS),
    "f-titan-ours-process-budget-all",
    "c-ours-process-budget-all",
)
STEPS_AFTER = 8  # the steps after a save that count (the module docstring)


class Gen2Pauses:
    """The generation-2 garbage collections of this process (``gc.callbacks``): when each ended and how long it
    took, so that a row can say which fell into its save's window; and for each, what it had to scan (the objects
    the collector tracked outside the frozen ones, counted before its clock starts), what it freed, the thread it
    ran on and the CPU time that thread spent in it. A long pass that scanned little spent its time freeing
    (finalizers, deallocations); one whose CPU time is far below its wall time waited there (a lock, a device call,
    the interpreter's lock held by another thread)."""

    def __init__(self) -> None:
        self.ended: list[tuple[float, float, dict]] = []  # (perf_counter at its end, ms, what it scanned and freed)
        self._start = 0.0
        self._cpu_start = 0.0
        self._scanned = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._scanned = sum(len(gc.get_objects(generation)) for generation in range(3))
            self._start = time.perf_counter()
            self._cpu_start = time.thread_time()
        else:
            now, cpu = time.perf_counter(), time.thread_time()
            detail = dict(
                cpu_ms=(cpu - self._cpu_start) * 1e3,
                scanned=self._scanned,
                collected=info["collected"],
                uncollectable=info["uncollectable"],
                thread=threading.current_thread().name,
            )
            self.ended.append((now, (now - self._start) * 1e3, detail))

    def since(self, t0: float) -> list[float]:
        """The pauses (ms) of the collections that ended after ``t0``."""
        return [ms for end, ms, _ in self.ended if end > t0]

    def details_since(self, t0: float) -> list[dict]:
        """Each collection that ended after ``t0``: its pause (ms), its thread's CPU time in it, what it scanned
        and freed, its thread."""
        return [{"ms": ms, **detail} for end, ms, detail in self.ended if end > t0]

    def close(self) -> None:
        """Stop recording (the callback leaves ``gc.callbacks``)."""
        gc.callbacks.remove(self._on_gc)


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # as the recipe and torchtitan save optimizers


def blocks(width: int, layers: int, device: torch.device, mesh, seed: int = 0) -> torch.nn.Module:
    """``layers`` x (Linear(width, width) + GELU), BF16, each block and the whole FSDP2-sharded over ``mesh``."""
    torch.manual_seed(seed)
    layers_ = [torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.GELU()) for _ in range(layers)]
    model = torch.nn.Sequential(*layers_).to(device=device, dtype=torch.bfloat16)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(width: int, layers: int, device: torch.device, mesh, remainders: bool = False):
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE

    model = blocks(width, layers, device, mesh)
    if TE_AVAILABLE and device.type == "cuda":
        from optim_factory import FusedAdam as cls
    else:
        from optim_factory import PortableFusedAdam as cls

    def make_opt(container: bool = False, **export):
        """An optimizer of the model with the export keyword arguments ``export`` (fixed at construction); with
        ``container``, torchtitan's ``OptimizersContainer`` of one such optimizer, built from its config."""
        options = dict(master_weights=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
        options.update(store_param_remainders=remainders, **export)
        if container:
            from optim_factory.integrations.torchtitan import fused_adam

            return fused_adam(lr=1e-5, name=cls.__name__, **options).build(model_parts=[model])
        return cls(list(model.parameters()), lr=1e-5, **options)

    return model, make_opt, cls.__name__


def switch_optimizer(ctx: dict, container: bool = False, **export):
    """A new optimizer of the model with the export keyword arguments ``export``, its states initialized, in place
    of the run's (the trainer steps it from now on; its moments start again, which changes no byte a save moves).
    With ``container``: torchtitan's ``OptimizersContainer`` of it (the trainer steps the container), returned."""
    ctx["opt"].state_exporter.close()
    stepper = ctx["trainer"].opt = ctx["make_opt"](container, **export)
    opt = ctx["opt"] = stepper.optimizers[0] if container else stepper
    opt.initialize_states()
    return stepper


def ours_export(ctx: dict, background: bool = True, keep_bf16: bool = False) -> dict:
    """Our export options of the recipe's path: chunked, reused buffers, [background], [keep BF16]."""
    return dict(
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=ctx["chunk"],
        state_dict_offload_reuse_buffers=True,
        state_dict_keep_bf16=keep_bf16,
        state_dict_offload_background=background,
    )


def budget_export(ctx: dict, name: str) -> dict:
    """A chunked export into fresh memory within a host budget (``*-budget-<b>``: :data:`BUDGETS`, at least two
    chunks)."""
    params = list(ctx["model"].parameters())
    state = sum(p.to_local().numel() for p in params) * 12  # FP32 master and moments
    model = sum(p.to_local().numel() * p.element_size() for p in params)
    budget = max(2 * ctx["chunk"], BUDGETS[name.rsplit("-", 1)[1]](state, model, ctx["chunk"]))  # the option's least
    return dict(
        state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=ctx["chunk"], state_dict_offload_host_budget=budget
    )


class Trainer:
    """Fixed-batch training steps, each timed to its end on the device (with a hook between backward and step)."""

    def __init__(self, model, opt, tokens: int, width: int, device: torch.device):
        self.model, self.opt, self.device = model, opt, device
        self.enqueued_s = 0.0  # the last step's time until enqueued (see step())
        self.batch = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)

    def forward_backward_s(self, repeats: int = 5) -> float:
        """The median time of a forward and backward alone (gradients dropped, no step): what overlaps a save that
        the next step's forward and backward run beside."""
        times = []
        for _ in range(repeats + 1):  # the first: warm-up
            sync(self.device)
            t0 = time.perf_counter()
            self.model(self.batch).float().pow(2).mean().backward()
            sync(self.device)
            times.append(time.perf_counter() - t0)
            self.opt.zero_grad()
        return statistics.median(times[1:])

    def step(self, before_step=None) -> tuple[float, float]:
        """One step; returns (seconds, seconds spent in ``before_step``). ``enqueued_s``: the seconds until the
        step was enqueued, before the device sync (equal to its total when the step waited on the CPU)."""
        t0 = time.perf_counter()
        loss = self.model(self.batch).float().pow(2).mean()
        loss.backward()
        hook_s = 0.0
        if before_step is not None:
            h0 = time.perf_counter()
            before_step()
            hook_s = time.perf_counter() - h0
        self.opt.step()
        self.opt.zero_grad()
        self.enqueued_s = time.perf_counter() - t0
        sync(self.device)
        return time.perf_counter() - t0, hook_s


def proc_status(key: str) -> int | None:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmPin``), or None where there is none."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.exists() else []:
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def rss_bytes() -> int:
    return proc_status("VmRSS") or 0


def pinned_bytes(pool_buffers: PoolBuffers, device: torch.device) -> int | None:
    """Pinned host bytes that can be counted: torch's pinned host allocator plus our pool's registered buffers
    (``scripts.bench_export.PoolBuffers``: those an export leased). DCP's stager pins with ``cudaHostRegister``
    (not counted here; see ``vm_pin_bytes``)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.host_memory_stats()
    return int(stats.get("allocated_bytes.all.current", stats.get("allocated_bytes.current", 0))) + (
        pool_buffers.pinned_bytes()
    )


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def gpu_base(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def gpu_peak_mib(device: torch.device, base: int) -> float | None:
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None


class Mode:
    """One save mode: ``save(step, path)`` at a step boundary, ``hook`` (before the next ``step()``) and ``finish``
    (waits until the checkpoint is complete). Each returns what it measured."""

    def __init__(self, name: str, ctx: dict):
        self.name, self.ctx = name, ctx
        self.manager = None
        self.stager = None
        self.pending = None  # what finish() waits for
        self.fresh_stagers = False  # a new DefaultStager per save (--stager fresh)
        self.stagers_built = 0
        if name.startswith(("a-", "b-", "e-te")):
            switch_optimizer(ctx)  # TE's own state_dict()
            if name != "e-te-sync":
                self.fresh_stagers = ctx["fresh_stagers"]
                self.stager = self.new_stager()
        else:
            background = name in ("c-ours", "c-ours-process", "d-ours-keep-bf16") or name.startswith("s-")
            export = ours_export(ctx, background, keep_bf16=name.startswith("d-"))
            opt = switch_optimizer(ctx, **(budget_export(ctx, name) if "-budget-" in name else export))
            if name.startswith("s-"):  # docs/export.md's loop: the stager alone
                options = StagerOptions(write_in_process="-process" in name, refuse_non_finite="-finite" in name)
                self.stager = AsyncSaveStager(opt, options)
            else:
                cfg = CheckpointConfig(
                    dir=str(ctx["root"]),
                    every_steps=1,
                    keep_last=0,
                    async_save=name != "e-ours-sync",
                    write_in_process="-process" in name,
                )
                # hook() calls wait_export() before the next step(), as the recipe's loop does
                self.manager = CheckpointManager(cfg, rank=ctx["rank"], device=ctx["device"], waits_before_step=True)
            if opt.state_dict_offload_reuse_buffers:
                opt.prepare_state_dict().result()
        self.options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=name.startswith("b-"))
        self.pool_buffers = PoolBuffers(ctx["opt"])  # what of the pinned host memory is our pool's

    def new_stager(self) -> DefaultStager:
        cuda = self.ctx["device"].type == "cuda"
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
        self.stagers_built += 1
        return self.ctx["stager_cls"](options)

    def checkpoint_path(self, root: Path, step: int) -> Path:
        return root / f"step_{step:08d}"

    def save(self, step: int, path: Path) -> dict:
        model, opt, group = self.ctx["model"], self.ctx["opt"], self.ctx["group"]
        if self.manager is not None:
            report = self.manager.saver.save(step, model, opt, {"step": step})
            self.pending = ("manager", None)
            return {"optim_bytes": report.export_bytes}
        if self.name.startswith("s-"):
            with self.stager.exporting():  # the background export returns unfilled: the next step overlaps it
                msd, osd = get_state_dict(model, opt, options=FLAT)
            state = {"model": msd, "optim": osd, "trainer": {"step": step}}
            self.pending = ("dcp", self.stager.async_save(state, checkpoint_id=str(path)))
            return {"optim_bytes": state_bytes(osd), "stager": type(self.stager).__name__}
        osd = get_optimizer_state_dict(model, opt, options=self.options)
        msd = get_model_state_dict(model, options=FLAT)
        state = {"model": msd, "optim": osd, "trainer": {"step": step}}
        nbytes = state_bytes(osd)
        if self.name == "e-te-sync":
            dcp.save(state, checkpoint_id=str(path), process_group=group)
            self.pending = None
        else:
            response = dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager, process_group=group)
            self.pending = ("dcp", response)
        return {
            "optim_bytes": nbytes,
            "stagers_built": self.stagers_built,
            "stager": self.stager and type(self.stager).__name__,
        }

    def hook(self) -> None:
        """Before the next ``step()``: what the loop must wait for there."""
        if self.manager is not None:
            self.manager.saver.wait_export()  # the recipe's loop: the export still being filled (background option)
        elif self.pending is not None and self.pending[0] == "dcp":
            self.pending[1].staging_completion.result()  # torchtitan's maybe_wait_for_staging()

    def finish(self) -> None:
        if self.pending is None:
            return
        kind, what = self.pending
        self.pending = None
        if kind == "manager":
            self.manager.saver.wait()
        else:
            what.upload_completion.result()
            if self.fresh_stagers:  # the next save's stager, built here (outside the timed save call)
                self.close()
                self.stager = self.new_stager()
        wait_pinning(self.ctx["opt"])

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.manager is not None:  # the recipe's saver: its stager and writer process
            self.manager.saver.close()


def make_mode(name: str, ctx: dict):
    """The mode ``name``: :class:`Mode`, or a framework's (``scripts.bench_save_frameworks``, which imports the
    framework), whose ``-te`` modes step TE's class (its own ``state_dict()``) and ``-ours`` modes ours with
    (c)'s export options. Raises ``ModeSkipped`` where this machine cannot run it."""
    if not name.startswith(FW):
        return Mode(name, ctx)
    from scripts.bench_save_frameworks import build_mode

    if "-budget-" in name:
        export = budget_export(ctx, name)
    else:  # -ours and -ours-process: (c)'s options; -te: TE's class as it is
        export = ours_export(ctx) if "-ours" in name else {}
    stepper = switch_optimizer(ctx, container=name.startswith("f-"), **export)
    if export.get("state_dict_offload_reuse_buffers"):
        ctx["opt"].prepare_state_dict().result()  # the pool's buffers, as (c) prepares them
    return build_mode(name, ctx, stepper)


def start_mode(name: str, ctx: dict):
    """The mode's folder (``ctx["root"]``) and the mode; None where it is skipped (the reason goes to
    ``ctx["skipped"]``)."""
    from scripts.bench_save_frameworks import ModeSkipped

    ctx["root"] = ctx["scratch"] / name
    if ctx["rank"] == 0:
        ctx["root"].mkdir(parents=True, exist_ok=True)
    dist.barrier()
    try:
        return make_mode(name, ctx)
    except ModeSkipped as exc:
        ctx["skipped"][name] = str(exc)
        if ctx["rank"] == 0:
            shutil.rmtree(ctx["root"], ignore_errors=True)
        return None


def measure_mode(name: str, ctx: dict, repeats: int, step: int) -> tuple[list[dict], int]:
    """The mode's warm-up and measured checkpoints (rows, one per checkpoint and rank); none where it is
    skipped."""
    mode = start_mode(name, ctx)
    if mode is None:
        return [], step
    with setup_frozen() if ctx["gc"] == "frozen" else contextlib.nullcontext():  # as the recipe's loop runs
        return _measured(mode, name, ctx, repeats, step)


def _measured(mode, name: str, ctx: dict, repeats: int, step: int) -> tuple[list[dict], int]:
    """:func:`measure_mode`'s checkpoints of a started mode; it closes the mode."""
    trainer, device, rank, root = ctx["trainer"], ctx["device"], ctx["rank"], ctx["root"]
    profiles: list[cProfile.Profile] = []
    rss0, pinned0 = rss_bytes(), pinned_bytes(mode.pool_buffers, device)
    rows = []
    for repeat in range(-1, repeats):  # -1: the warm-up checkpoint
        before = [trainer.step()[0] for _ in range(ctx["steps_after"])]  # the baseline: as many steps as after
        step += len(before)
        baseline = statistics.median(before)
        if device.type == "cuda":  # a plain step's peak above its start, for the step after the save
            base = gpu_base(device)
            trainer.step()
            step += 1
            plain_peak = gpu_peak_mib(device, base)
        path = mode.checkpoint_path(root, step)
        rss_a, pinned_a = rss_bytes(), pinned_bytes(mode.pool_buffers, device)
        base = gpu_base(device)
        if ctx.get("profile") and repeat >= 0:
            profiles.append(cProfile.Profile())
            save = functools.partial(profiles[-1].runcall, mode.save)
        else:
            save = mode.save
        t0 = time.perf_counter()
        info = save(step, path)
        save_call_s = time.perf_counter() - t0
        peak_save = gpu_peak_mib(device, base)  # the allocator's counts: no device sync needed
        # the loop resumes: forward and backward of the next step, then the wait (if any) before step()
        first_s, hook_s = trainer.step(before_step=mode.hook)
        peak_step = gpu_peak_mib(device, base)
        after = [first_s - hook_s] + [trainer.step()[0] for _ in range(ctx["steps_after"] - 1)]
        step += ctx["steps_after"]
        gen2 = ctx["gen2"].since(t0)  # the save's window: the call and the steps counted after it
        gen2_details = ctx["gen2"].details_since(t0)
        mode.finish()
        complete_s = time.perf_counter() - t0
        dist.barrier()
        rows.append(
            dict(
                mode=name,
                repeat=repeat,
                warmup=repeat < 0,
                rank=rank,
                block_s=save_call_s + hook_s,
                save_call_s=save_call_s,
                wait_before_step_s=hook_s,
                gpu_peak_at_save_mib=peak_save,
                gpu_peak_step_excess_mib=None if peak_step is None else max(0.0, peak_step - plain_peak),
                rss_delta_bytes=rss_bytes() - rss_a,
                rss_held_bytes=rss_bytes() - rss0,
                pinned_delta_bytes=None if pinned_a is None else pinned_bytes(mode.pool_buffers, device) - pinned_a,
                pinned_held_bytes=None if pinned0 is None else pinned_bytes(mode.pool_buffers, device) - pinned0,
                vm_pin_bytes=proc_status("VmPin"),
                disk_bytes=disk_bytes(path) if rank == 0 else None,
                complete_s=complete_s,
                step_before_s=baseline,
                steps_before_s=before,
                steps_after_s=after,
                interference=max(after) / baseline,
                frozen_objects=gc.get_freeze_count(),
                gen2_count=len(gen2),
                gen2_max_ms=max(gen2, default=0.0),
                gen2_details=gen2_details,
                **info,
            )
        )
        if rank == 0:  # complete and measured: one checkpoint on the disk at a time (20 GB each at 4 x the state)
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    mode.close()
    if profiles:
        write_profile(profiles, Path(ctx["profile"]) / f"{name}_rank{rank}.txt")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return rows, step


def write_profile(profiles: list[cProfile.Profile], path: Path) -> None:
    """The measured save calls of one mode on one rank: the 40 functions of most cumulative, then of most own
    time (cProfile's overhead inflates both; for where the time goes, not for the table's numbers)."""
    text = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=text)
    for more in profiles[1:]:
        stats.add(more)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{len(profiles)} save calls\n" + text.getvalue())


def median(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def lost_s(row: dict) -> float:
    """What a checkpoint costs the training loop: its blocking time plus how much longer than the median step
    before the save each of the steps after it took (a save that returns at once but slows the next steps,
    e.g. a background staging thread competing with them, loses time there)."""
    return row["block_s"] + sum(max(0.0, s - row["step_before_s"]) for s in row["steps_after_s"])


def floor_s(optim_bytes: float, meta: dict) -> float | None:
    """The least a checkpoint can cost the loop: its bytes (the optimizer's export and the model's parameters,
    per rank) over the pinned device-to-host link, less the next forward and backward, which can run beside the
    copy (both measured in this run). None without a link (CPU)."""
    link, overlap = meta.get("link_gbps"), meta.get("forward_backward_s")
    if not link or overlap is None:
        return None
    return max(0.0, (optim_bytes + meta["model_bytes"]) / (link * 1e9) - overlap)


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per mode: medians of the measured (not warm-up) checkpoints; block and peaks: the slowest rank's."""
    out = {}
    for name in dict.fromkeys(r["mode"] for r in rows):
        mine = [{**r, "lost_s": lost_s(r)} for r in rows if r["mode"] == name and not r["warmup"]]
        by_repeat: dict[int, list[dict]] = {}
        for r in mine:
            by_repeat.setdefault(r["repeat"], []).append(r)
        worst = [
            {
                k: max((r[k] for r in rs if r.get(k) is not None), default=None)
                for k in rs[0]
                if k not in ("repeat", "rank") and isinstance(rs[0][k], (int, float)) and not isinstance(rs[0][k], bool)
            }
            for rs in by_repeat.values()
        ]
        out[name] = {k: median(worst, k) for k in worst[0]} if worst else {}
    return out


COLUMNS = (  # summary key, table label, divisor, digits
    ("block_s", "block (s)", 1, 3),
    ("lost_s", "lost to the loop (s)", 1, 3),
    ("save_call_s", "save call (s)", 1, 3),
    ("wait_before_step_s", "wait before step (s)", 1, 3),
    ("gpu_peak_at_save_mib", "GPU peak at save (MiB)", 1, 0),
    ("gpu_peak_step_excess_mib", "next step's GPU excess (MiB)", 1, 0),
    ("rss_delta_bytes", "RSS delta (MB)", 1e6, 0),
    ("rss_held_bytes", "RSS held by the mode (MB)", 1e6, 0),
    ("budget_bytes", "host budget (MB)", 1e6, 0),
    ("rss_peak_added_bytes", "RSS peak added by the save (MB)", 1e6, 0),
    ("pinned_held_bytes", "pinned held, counted (MB)", 1e6, 0),
    ("disk_bytes", "on disk (MB)", 1e6, 1),
    ("optim_bytes", "optimizer export per rank (MB)", 1e6, 1),
    ("complete_s", "complete (s)", 1, 2),
    ("step_before_s", "step before (s)", 1, 3),
    ("interference", "worst after / before", 1, 2),
    ("gen2_count", "gen-2 collections in the window", 1, 0),
    ("gen2_max_ms", "longest gen-2 collection in the window (ms)", 1, 0),
)


FW = ("f-", "g-", "h-")  # the framework modes' prefixes (scripts.bench_save_frameworks)


def stager_note(meta: dict) -> str:
    """How (a) and (b) kept DCP's stager: one across saves (torch 2.13's, emulated where this torch's serves one
    save: scripts.dcp_stagers), or one per save (``--stager fresh``)."""
    if meta.get("fresh_stagers", False):
        note = "a new one per save, so every save allocates and pins its staging memory"
        if not meta.get("stager_reusable", True):
            note += " (this torch's stager serves one save: pytorch/pytorch#183413)"
        return note
    return "one kept across saves" + (f" ({EMULATION})" if meta.get("stager_emulated") else "")


def render(summary: dict, meta: dict) -> str:
    def fmt(v, scale=1.0, digits=3):
        return "n/a" if v is None else f"{v / scale:.{digits}f}"

    lines = [
        "# Save path side by side (scripts/bench_save.py)",
        "",
        f"Command: `{meta['command']}`",
        "",
        *meta["environment"],
        f"- model: {meta['layers']} x Linear({meta['width']}, {meta['width']}) + GELU, FSDP2 over {meta['world']} "
        f"rank(s), {meta['optimizer']}, BF16 params, FP32 master{_MASTER[meta.get('master', 'fp32')]}, BF16 moments; "
        f"{meta['fp32_state_gb']:.2f} GB of "
        f"FP32-equivalent optimizer state per rank; chunk {meta['chunk'] >> 20} MiB; {meta['repeats']} measured "
        "checkpoints per mode after one warm-up (medians; per checkpoint the slowest rank); "
        f"the slowdown of {meta.get('steps_after', 3)} steps after each save counted against the median of the "
        f"{meta.get('steps_before', 3)} before it; garbage collection: " + GC[meta.get("gc", "automatic")],
        "- DCP's `DefaultStager` for (a) and (b): " + stager_note(meta),
        *[f"- {name}: stager: {stager}" for name, stager in meta.get("stagers", {}).items() if name[:2] in FW],
        *[f"- {name}: skipped: {reason}" for name, reason in meta.get("skipped", {}).items()],
        "",
        "- floor: (optimizer export + model parameters) / the pinned link "
        + (
            f"({meta['link_gbps']:.1f} GB/s) - a forward and backward ({meta['forward_backward_s']:.3f} s), "
            f"measured in this run; model parameters {meta['model_bytes'] / 1e6:.0f} MB per rank"
            if meta.get("link_gbps")
            else "(no link on CPU: n/a)"
        ),
        "",
        "| mode | " + " | ".join(label for _, label, _, _ in COLUMNS) + " | floor (s) | lost / floor |",
        "|---|" + "---:|" * (len(COLUMNS) + 2),
    ]
    for name, s in summary.items():
        floor = floor_s(s["optim_bytes"], meta) if s.get("optim_bytes") is not None else None
        cells = [fmt(s.get(key), scale, digits) for key, _, scale, digits in COLUMNS]
        cells += [fmt(floor), fmt(s["lost_s"] / floor if floor else None, digits=2)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Goals", ""] + [f"- [{'x' if ok else ' '}] {text}" for ok, text in goals(summary, meta)]
    return "\n".join(lines) + "\n"


# --gc's choices (the first is the default) and how the table names each
GC = {
    "frozen": "automatic, with what each mode's setup made frozen out of the collector (gc.freeze, as the recipe's "
    "loop runs)",
    "automatic": "automatic, nothing frozen (Python's default)",
}
# how the table names the FP32 master's storage (--store-param-remainders)
_MASTER = {"fp32": "", "remainders": " stored as BF16 parameter + int16 remainder (store_param_remainders)"}


def goals(summary: dict, meta: dict) -> list[tuple[bool, str]]:
    a, step = summary.get("a-te-async-pinned", {}), summary.get("a-te-async-pinned", {}).get("step_before_s")
    out = []
    for name in ("c-ours", "d-ours-keep-bf16"):  # the goals are those of the recipe's path (with the option)
        s = summary.get(name)
        if not s or not a:
            continue
        ok = s["block_s"] <= a["block_s"] and s["block_s"] <= step
        out.append((ok, f"{name} blocks {s['block_s']:.3f} s <= (a) {a['block_s']:.3f} s and <= one step {step:.3f} s"))
        ok = s["lost_s"] <= a["lost_s"] and s["lost_s"] <= step
        text = f"{name} loses {s['lost_s']:.3f} s <= (a) {a['lost_s']:.3f} s and <= one step (blocked + slower steps)"
        out.append((ok, text))
        floor = floor_s(s["optim_bytes"], meta)
        if floor:
            ratio = s["lost_s"] / floor
            out.append((ratio <= 1.2, f"{name} loses {ratio:.2f} x its floor {floor:.3f} s (goal <= 1.2)"))
        out += peak_goal(name, s, "(a)", a, meta)
    out += framework_goals(summary, meta)
    c, d = summary.get("c-ours"), summary.get("d-ours-keep-bf16")
    if c and d and c.get("disk_bytes"):
        ratio = d["disk_bytes"] / c["disk_bytes"]
        out.append((ratio <= 0.7, f"(d) writes {ratio:.3f} x the bytes of (c) on disk (model included; goal <= 0.7)"))
        opt_ratio = d["optim_bytes"] / c["optim_bytes"]
        out.append((opt_ratio <= 0.7, f"(d) exports {opt_ratio:.3f} x the optimizer bytes of (c) (goal <= 0.7)"))
    return out


def peak_goal(name: str, s: dict, anchor: str, a: dict, meta: dict) -> list[tuple[bool, str]]:
    """``name``'s GPU peak at save (or what stays allocated into the next step, the overlap's export say, if more)
    <= 2 chunks + 1 MiB, beside the anchor's peak at save; none on CPU."""
    peak = s.get("gpu_peak_at_save_mib")
    if peak is None or a.get("gpu_peak_at_save_mib") is None:
        return []
    peak = max(peak, s.get("gpu_peak_step_excess_mib") or 0.0)
    limit = 2 * meta["chunk"] / 2**20 + 1
    text = f"{name} GPU peak {peak:.0f} MiB <= 2 chunks + 1 MiB ({limit:.0f}); {anchor}: "
    text += f"{a['gpu_peak_at_save_mib']:.0f} MiB"
    return [(peak <= limit, text)]


FRAMEWORKS = ("f-titan", "g-automodel")  # each framework's modes: <prefix>-te, <prefix>-ours


def framework_goals(summary: dict, meta: dict) -> list[tuple[bool, str]]:
    """Per framework, ours with the handle: loses <= 1.2 x what the recipe's path (c) loses, >= 10 x less than the
    same framework's own async mode with TE's class, and its GPU peak at save <= 2 chunks."""
    out = []
    c = summary.get("c-ours")
    for prefix in FRAMEWORKS:
        ours, te = summary.get(f"{prefix}-ours"), summary.get(f"{prefix}-te")
        if not ours:
            continue
        lost = ours["lost_s"]
        if c:
            text = f"{prefix}-ours loses {lost:.3f} s = {lost / c['lost_s']:.2f} x what c-ours loses (goal <= 1.2)"
            out.append((lost <= 1.2 * c["lost_s"], text))
        if te:
            text = f"{prefix}-te loses {te['lost_s']:.3f} s = {te['lost_s'] / lost:.1f} x what {prefix}-ours loses"
            out.append((te["lost_s"] >= 10 * lost, text + " (goal >= 10)"))
            out += peak_goal(f"{prefix}-ours", ours, f"{prefix}-te", te, meta)
    return out


def _chunk_bytes(text: str) -> int:
    """``--chunk``: a size the export accepts (``64MiB``), checked as the optimizer checks it."""
    try:
        chunk = parse_bytes(text, "--chunk")
        ExportOptions(cpu_offload=True, chunk_bytes=chunk)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return chunk


def read(path: Path) -> tuple[dict, list[dict]]:
    """The metadata and the rows of a ``bench_save.jsonl``."""
    meta, rows = {}, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise SystemExit(f"{path}:{n}: not JSON (expected the JSON lines of scripts.bench_save)") from None
        if "meta" in record:
            meta = record["meta"]
        else:
            rows.append(record)
    if not rows:
        raise SystemExit(f"{path}: no measurements (expected the JSON lines of scripts.bench_save)")
    return meta, rows


def checked_modes(args: argparse.Namespace) -> list[str]:
    """``--modes`` as a list, refused in one line before any measurement where a mode is unknown or the framework
    a framework mode needs does not import."""
    from scripts.bench_save_frameworks import import_error

    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.repeats < 1:
        raise SystemExit(
            f"--modes={args.modes!r} / --repeats={args.repeats}: modes from {','.join(MODES)}, repeats >= 1"
        )
    error = import_error(modes)
    if error:
        raise SystemExit(
            f"--modes={args.modes!r}: {error}; pip install --no-deps -r tests/integrations/requirements.txt"
        )
    return modes


def stagers(choice: str) -> dict:
    """``--stager``: whether this torch's ``DefaultStager`` serves more than one save, whether (a) and (b) build
    one per save, and the class of theirs: kept across saves as torch 2.13 keeps it (where this torch's serves
    one save, 2.13's staging: ``KeptStager``)."""
    reusable = stager_reusable(DefaultStager)
    if choice == "reuse" and not reusable:
        raise SystemExit("--stager=reuse: this torch's DefaultStager serves one save (pytorch/pytorch#183413)")
    fresh = choice == "fresh"
    return dict(
        stager_reusable=reusable, fresh_stagers=fresh, stager_cls=DefaultStager if reusable or fresh else KeptStager
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=cli_args.out_dir, required=True)
    ap.add_argument("--render", type=Path, help="only write --out/bench_save.md again from this bench_save.jsonl")
    ap.add_argument(
        "--scratch",
        type=cli_args.out_dir,
        default=None,
        help="local directory for the checkpoints (default: a temp dir)",
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--width", type=cli_args.positive_int, default=4096)
    ap.add_argument("--layers", type=cli_args.positive_int, default=22)
    ap.add_argument("--tokens", type=cli_args.positive_int, default=8192)
    ap.add_argument("--chunk", type=_chunk_bytes, default="64MiB", help="chunk size (B, KiB, MiB, GiB)")
    ap.add_argument(
        "--store-param-remainders",
        action="store_true",
        help="keep the FP32 master as TE's store_param_remainders=True: the BF16 parameter's missing 16 bits "
        "(int16, 2 bytes per parameter in memory and in the checkpoint instead of 4)",
    )
    ap.add_argument("--repeats", type=cli_args.positive_int, default=2)
    ap.add_argument(
        "--steps-after",
        type=cli_args.positive_int,
        default=STEPS_AFTER,
        help="the steps after each save whose slowdown counts as lost to the loop",
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--stager",
        default="auto",
        choices=["auto", "reuse", "fresh"],
        help="(a)/(b): one DefaultStager kept across saves, or a new one per save; auto: kept, as torch 2.13 keeps "
        "it (where this torch's stager serves one save, 2.11, scripts.dcp_stagers.KeptStager: 2.13's staging); "
        "reuse: this torch's DefaultStager kept (refused where it serves one save). torchtitan's stager (f-) is "
        "kept as auto keeps it",
    )
    ap.add_argument(
        "--gc",
        default=next(iter(GC)),
        choices=tuple(GC),
        help="frozen: each mode runs with what its setup made frozen out of the garbage collector (gc.freeze after "
        "one collection), as the recipe's loop runs (torchtitan's and Automodel's trainers turn automatic collection "
        "off); automatic: Python's default, every object scanned by a generation-2 collection",
    )
    ap.add_argument(
        "--profile",
        type=cli_args.out_dir,
        help="cProfile the measured save calls; one text file per mode and rank in this directory (slower calls: "
        "run it apart from the table's run)",
    )
    args = ap.parse_args(argv)
    if args.render is not None:
        meta, rows = read(args.render)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_save.md").write_text(render(summarize(rows), meta))
        print((out / "bench_save.md").read_text(), end="")
        return
    modes = checked_modes(args)
    env = resolve_dist_env(os.environ)
    device = pick_device(args.device, env.local_rank)
    mesh = init_distributed(env, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    scratch = Path(args.scratch or tempfile.gettempdir()) / "bench_save"
    model, make_opt, opt_name = build(args.width, args.layers, device, mesh, remainders=args.store_param_remainders)
    opt = make_opt()
    trainer = Trainer(model, opt, args.tokens, args.width, device)
    for _ in range(3):
        trainer.step()
    local = sum(p.to_local().numel() for p in model.parameters())
    link_gbps = d2h_bandwidth(device).get("pinned")  # None on CPU
    forward_backward_s = trainer.forward_backward_s()
    ctx = dict(
        model=model,
        opt=opt,
        make_opt=make_opt,
        device=device,
        rank=rank,
        trainer=trainer,
        scratch=scratch,
        chunk=args.chunk,
        group=dist.new_group(backend="gloo"),
        profile=args.profile,
        steps_after=args.steps_after,
        gc=args.gc,
        gen2=Gen2Pauses(),
    )
    ctx.update(stagers(args.stager), skipped={})
    rows, step = [], 3
    try:
        for name in modes:
            mode_rows, step = measure_mode(name, ctx, args.repeats, step)
            rows += mode_rows
            if rank == 0 and name in ctx["skipped"]:
                print(f"{name}: skipped: {ctx['skipped'][name]}", flush=True)
            elif rank == 0:
                print(name, json.dumps(summarize(mode_rows)[name]), flush=True)
    finally:
        ctx["gen2"].close()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        rows = [r for part in gathered for r in part]
        meta = dict(
            command="torchrun --nproc_per_node=N -m scripts.bench_save "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            environment=environment(device, "te" if opt_name == "FusedAdam" else "portable"),
            width=args.width,
            layers=args.layers,
            world=world,
            optimizer=opt_name,
            chunk=ctx["chunk"],
            master="remainders" if args.store_param_remainders else "fp32",
            repeats=args.repeats,
            steps_after=args.steps_after,
            steps_before=args.steps_after,  # the baseline's steps (runs without the key had 3)
            gc=args.gc,
            fp32_state_gb=local * 12 / 1e9,
            model_bytes=sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
            link_gbps=link_gbps,
            forward_backward_s=forward_backward_s,
            stager_reusable=ctx["stager_reusable"],
            fresh_stagers=ctx["fresh_stagers"],
            stager_emulated=ctx["stager_cls"] is KeptStager,
            stagers={r["mode"]: r["stager"] for r in rows if r.get("stager")},
            skipped=ctx["skipped"],
        )
        write_results(args.out, "bench_save", meta, rows, render(summarize(rows), meta))
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
