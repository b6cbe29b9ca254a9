"""The recipe's training step against a bare FSDP2 loop, interleaved in one process; and the per-step stop check.

    torchrun --nproc_per_node=2 -m benchmarks.probes.bench_recipe_overhead --out DIR     # 2 GPUs (the GPU preset)
    torchrun --nproc_per_node=2 -m benchmarks.probes.bench_recipe_overhead --device cpu --out DIR  # gloo, tiny model
    python -m benchmarks.probes.bench_recipe_overhead --device cpu --out DIR             # one process (no all-reduce)

One model (built, sharded with FSDP2 and given its optimizer by the recipe's own functions: ``preflight``,
``build_model``, ``shard_model``, ``build_optimizer``) is trained by four loops in turn, on the same batches
(``data.batch(step, rank, world)``, one step counter for all):

- ``bare``: batch to the device, forward, backward, ``optimizer.step()``, ``zero_grad``;
- ``bare+stop``: ``bare`` plus the recipe's per-step stop check between checkpoints
  (``StopSignal.should_stop(..., now=False)``: this rank's loss-is-not-finite flag copied to the host without a
  sync and read one step later, and one 3-integer all-reduce on gloo that runs during the next step and is read at
  the next check); only with ``--loops``: ``bare+syncstop`` (the check without overlap: ``StopSignal(
  overlap=False)``, waiting for the all-reduce every step), ``bare+reduce`` and ``bare+flag`` (``bare`` plus only
  the overlapped all-reduce, or only the deferred flag: the two parts of the check);
- ``recipe``: the recipe loop's own per-step code (``TrainStep`` with ``grad_clip=0``, ``StepLog``, the progress
  bar, ``StopSignal.should_stop``), i.e. the same arithmetic as ``bare`` plus what the recipe adds per step;
- ``recipe+clip``: the same with the config's ``trainer.grad_clip`` (the recipe's default 1.0: the gradient
  norm, one more all-reduce, and its non-finite check).

Checkpoints and evaluation are off (they are not per-step work). After ``--warmup`` steps of each loop, each
repetition runs a block of ``--steps`` steps of each loop (default 25, the recipe's ``trainer.log_every``: the
recipe loops count their own steps, so each of their blocks holds one log step), in an order rotated per
repetition. A block is timed between device synchronisations after a barrier, and its time is the slowest
rank's. The step time of a loop is the median over its blocks of (block time / steps); its overhead is also given
paired: the median over repetitions of (its block / bare's block of the same repetition), with a 95 % bootstrap
interval, since whole blocks drift by ±10 % on a shared host. Each block records the garbage collector's pauses in
it (``gc.callbacks``). ``--loops`` picks the loops (bare first). Then the synchronous stop check (``now=True``,
as on steps that save) alone is timed ``--probe`` times: the all-reduce (no flag) and the all-reduce with the
device flag (the flag computed beforehand, the device idle).

Writes ``bench_recipe_overhead.jsonl`` (one line per block, per loop, per probe, and the run's metadata) and
``bench_recipe_overhead.md`` to ``--out`` (rank 0). Extra positional arguments are recipe overrides
(``model.n_layers=6``), applied after the preset's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from optim_factory.factory import build_optimizer
from recipes.distributed import init_distributed, shutdown
from recipes.logs import MetricsWriter, StepLog
from recipes.model import build_model
from recipes.preflight import preflight
from recipes.progress import progress_bar
from recipes.step import TrainStep, shard_model
from recipes.stop_signal import StopSignal
from recipes.train import compose_config
from scripts import cli_args

LOOPS = ("bare", "bare+stop", "recipe", "recipe+clip")  # the default
# the stop check without overlap (waiting for its all-reduce every step), and its two parts alone (what bare+stop costs,
# taken apart): its overlapped gloo all-reduce without a flag, and this rank's deferred non-finite flag
PARTS = ("bare+syncstop", "bare+reduce", "bare+flag")
# The GPU preset: the recipe's low-memory preset (BF16 parameters, TE FusedAdam with BF16 moments and int16
# remainders) on the 12-layer, width-1024 model of the measured 2-GPU recipe runs, 1024-token windows.
GPU_PRESET = [
    "experiment=lowmem",
    "model=small",
    "model.n_layers=12",
    "model.d_model=1024",
    "model.n_heads=16",
    "model.d_ff=4096",
    "data=tokens",
    "data.seq_len=1024",
    "data.global_batch_size=16",
    "data.holdout_fraction=0",
]
CPU_PRESET: list[str] = []  # the tiny model on the addition task (the recipe's defaults)
TOKENS = 1 << 20  # tokens in the GPU preset's random token file


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, world: int) -> float:
    if world == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # CPU tensor: gloo
    return float(t)


class Loops:
    """The four loops over one model and optimizer, sharing one step counter (hence the same batches)."""

    def __init__(self, cfg, env, device, data, model, optimizer, run_dir: str):
        self.env, self.device, self.data, self.model, self.optimizer = env, device, data, model, optimizer
        self.step = 0
        self.gc_s, self.gc_runs, self._gc_t0 = 0.0, 0, 0.0  # the garbage collector's pauses (see _gc)
        gc.callbacks.append(self._gc)
        self.recipe_steps = 0  # the recipe loops' own count: StepLog logs every log_every of them
        self.stop = StopSignal()
        self.sync_stop = StopSignal(overlap=False)  # bare+syncstop
        base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        common = dict(warmup_steps=cfg.trainer.warmup_steps, max_steps=cfg.trainer.max_steps)
        rank, world = env.rank, env.world_size
        self.recipe_step = {
            "recipe": TrainStep(model, optimizer, data, device, rank, world, base_lrs, grad_clip=0.0, **common),
            "recipe+clip": TrainStep(
                model, optimizer, data, device, rank, world, base_lrs, grad_clip=cfg.trainer.grad_clip, **common
            ),
        }
        self.bar = progress_bar(total=cfg.trainer.max_steps, initial=0, enabled=False)
        self.step_log = StepLog(
            MetricsWriter(run_dir, rank),
            self.bar,
            world=world,
            start=0,
            end=cfg.trainer.max_steps,
            max_steps=cfg.trainer.max_steps,
            every=cfg.trainer.log_every,
        )

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0
            self.gc_runs += 1

    def close(self) -> None:
        gc.callbacks.remove(self._gc)
        self.stop.should_stop(self.env.world_size)  # reads what is pending
        self.sync_stop.restore()
        self.stop.restore()

    def bare(self, check: str) -> None:
        """``check``: "" (none), "stop" (the recipe's stop check), "syncstop" (the same, waiting for its all-reduce),
        "reduce" (its all-reduce only), "flag" (its deferred flag only, as with one rank)."""
        inputs, targets = self.data.batch(self.step, self.env.rank, self.env.world_size)
        loss = self.model(inputs.to(self.device), targets.to(self.device))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if check:
            flag = None if check == "reduce" else ~torch.isfinite(loss.detach())
            stop = self.sync_stop if check == "syncstop" else self.stop
            stop.should_stop(1 if check == "flag" else self.env.world_size, flag, now=False)

    def recipe(self, name: str) -> None:
        result = self.recipe_step[name](self.step)
        self.recipe_steps += 1
        self.step_log(self.recipe_steps, result)
        self.bar.update(1)
        self.stop.should_stop(self.env.world_size, result.nonfinite, now=False)  # as the loop between saves

    def run(self, name: str, steps: int) -> None:
        for _ in range(steps):
            if name.startswith("bare"):
                self.bare(name.partition("+")[2])
            else:
                self.recipe(name)
            self.step += 1

    def block(self, name: str, steps: int) -> dict:
        """Seconds per step of ``steps`` steps of loop ``name`` and the garbage collector's pauses in them (both
        the slowest rank's)."""
        if self.env.world_size > 1:
            dist.barrier()
        _sync(self.device)
        self.gc_s, self.gc_runs = 0.0, 0
        t0 = time.perf_counter()
        self.run(name, steps)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        return {
            "step_s": _slowest(seconds, self.env.world_size) / steps,
            "gc_s": _slowest(self.gc_s, self.env.world_size),
            "gc_runs": self.gc_runs,
        }

    def probe(self, calls: int, with_flag: bool) -> float:
        """Seconds per call of the stop check alone (the slowest rank's mean over ``calls`` calls)."""
        flag = ~torch.isfinite(torch.ones((), device=self.device)) if with_flag else None
        if self.env.world_size > 1:
            dist.barrier()
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(calls):
            self.stop.should_stop(self.env.world_size, flag)
        return _slowest(time.perf_counter() - t0, self.env.world_size) / calls


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformer_engine

        out["transformer_engine"] = transformer_engine.__version__
    except Exception:  # noqa: BLE001 - optional; any import failure means "not available"
        out["transformer_engine"] = "not available"
    return out


def _hardware(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    return f"{world} CPU process(es), {torch.get_num_threads()} thread(s) each, {platform.processor() or 'cpu'}"


def _token_file(folder: Path, vocab: int) -> Path:
    path = folder / "tokens.bin"
    np.random.default_rng(0).integers(0, vocab, size=TOKENS, dtype=np.uint16).astype("<u2").tofile(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=cli_args.out_dir, required=True, help="folder for bench_recipe_overhead.jsonl and .md (rank 0)"
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--preset", choices=["auto", "gpu", "cpu"], default="auto", help="auto: gpu on CUDA, else cpu")
    ap.add_argument("--warmup", type=cli_args.positive_int, default=10, help="steps of each loop before timing")
    ap.add_argument(
        "--steps",
        type=cli_args.positive_int,
        default=25,
        help="steps per timed block (the recipe's log_every: one log each)",
    )
    ap.add_argument("--repeats", type=cli_args.positive_int, default=10, help="timed blocks of each loop")
    ap.add_argument("--probe", type=cli_args.positive_int, default=2000, help="calls of the stop check timed alone")
    ap.add_argument(
        "--loops", default=",".join(LOOPS), help=f"loops to time, bare first (from {','.join(LOOPS + PARTS)})"
    )
    ap.add_argument("overrides", nargs="*", help="recipe overrides, after the preset's (e.g. model.n_layers=6)")
    args = ap.parse_args()
    loops_run = tuple(args.loops.split(","))
    if loops_run[0] != "bare" or not set(loops_run) <= set(LOOPS + PARTS) or len(set(loops_run)) != len(loops_run):
        ap.error(f"--loops={args.loops!r}: distinct loops from {','.join(LOOPS + PARTS)}, bare first")
    device_kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset if args.preset != "auto" else ("gpu" if device_kind == "cuda" else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="bench_recipe_overhead-") as scratch:
        overrides = [*(GPU_PRESET if preset == "gpu" else CPU_PRESET)]
        if preset == "gpu":
            vocab = int(compose_config([*overrides, *args.overrides]).model.vocab_size)
            overrides.append(f"data.path={_token_file(Path(scratch), vocab)}")  # every rank writes the same file
        overrides += [
            f"trainer.device={device_kind}",
            "trainer.max_steps=1000000",  # the schedule barely moves; log_every stays the config's
            "trainer.eval_every=0",
            "trainer.progress=false",
            "checkpoint.enabled=false",
            f"run_dir={scratch}/run",
            *args.overrides,
        ]
        cfg = compose_config(overrides)
        env, device, data, optim = preflight(cfg)
        mesh = init_distributed(env, device)
        try:
            model = shard_model(build_model(cfg.model, seed=cfg.trainer.seed, device=device), mesh)
            optimizer = build_optimizer(optim, model)
            model.train()
            loops = Loops(cfg, env, device, data, model, optimizer, f"{scratch}/run")
            for name in loops_run:
                loops.run(name, args.warmup)
            blocks = []
            for rep in range(args.repeats):
                for i in range(len(loops_run)):
                    name = loops_run[(i + rep) % len(loops_run)]
                    blocks.append({"kind": "block", "loop": name, "repeat": rep, **loops.block(name, args.steps)})
            probes = [
                {"kind": "probe", "what": what, "calls": args.probe, "call_s": loops.probe(args.probe, flag)}
                for what, flag in (("all-reduce", False), ("all-reduce + device flag", True))
            ]
            loops.close()
            params = sum(p.numel() for p in model.parameters())  # DTensors: global sizes
            optimizer_name = type(optimizer).__name__
        finally:
            shutdown()

    if env.rank != 0:
        return
    loops_summary = []
    for name in loops_run:
        times = [b["step_s"] for b in blocks if b["loop"] == name]
        loops_summary.append(
            {"kind": "loop", "loop": name, "median_step_s": statistics.median(times), "min_step_s": min(times),
             "max_step_s": max(times), "blocks": len(times), "steps_per_block": args.steps,
             "gc_ms_per_block": 1e3 * statistics.mean(b["gc_s"] for b in blocks if b["loop"] == name),
             **paired_ratio(blocks, name)}
        )  # fmt: skip
    bare = loops_summary[0]["median_step_s"]
    for rec in loops_summary:
        rec["ratio_to_bare"] = rec["median_step_s"] / bare
    for rec in probes:
        rec["fraction_of_bare_step"] = rec["call_s"] / bare
    launcher = f"torchrun --nproc_per_node={env.world_size}" if env.world_size > 1 else "python"
    meta = {
        "kind": "meta",
        "command": " ".join(
            [launcher, "-m", "benchmarks.probes.bench_recipe_overhead", *map(shlex.quote, sys.argv[1:])]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": _hardware(device, env.world_size),
        **_versions(),
        "preset": preset,
        "overrides": [o for o in overrides if not o.startswith(("run_dir=", "data.path="))],  # not the temp paths
        "parameters": params,
        "optimizer": optimizer_name,
        "grad_clip": float(cfg.trainer.grad_clip),
        "log_every": int(cfg.trainer.log_every),
    }
    with open(out / "bench_recipe_overhead.jsonl", "w") as f:
        for rec in [meta, *blocks, *loops_summary, *probes]:
            f.write(json.dumps(rec) + "\n")
    (out / "bench_recipe_overhead.md").write_text(markdown(meta, loops_summary, probes))
    print((out / "bench_recipe_overhead.md").read_text())


def paired_ratio(blocks: list[dict], name: str, resamples: int = 2000) -> dict:
    """The loop's step time over bare's, paired by repetition (the blocks of one repetition run back to back,
    so slow drifts of the machine cancel): the median of the per-repetition ratios and a 95 % bootstrap interval
    of that median (``resamples`` resamples of the repetitions, seed 0)."""
    by_rep: dict[int, dict[str, float]] = {}
    for b in blocks:
        by_rep.setdefault(b["repeat"], {})[b["loop"]] = b["step_s"]
    ratios = np.array([r[name] / r["bare"] for r in by_rep.values()])
    picks = np.random.default_rng(0).integers(0, len(ratios), size=(resamples, len(ratios)))
    low, high = np.percentile(np.median(ratios[picks], axis=1), [2.5, 97.5])
    return {"paired_ratio": float(np.median(ratios)), "paired_ci95": [float(low), float(high)]}


def markdown(meta: dict, loops_summary: list[dict], probes: list[dict]) -> str:
    lines = [
        "# The recipe's step against a bare FSDP2 loop",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; hardware: {meta['hardware']}",
        f"- versions: Python {meta['python']}, torch {meta['torch']}, Transformer Engine {meta['transformer_engine']}",
        f"- model: {meta['parameters'] / 1e6:.1f}M parameters, optimizer {meta['optimizer']}; preset "
        f"`{meta['preset']}`, overrides: `{' '.join(meta['overrides'])}`",
        f"- recipe loop: `trainer.log_every={meta['log_every']}`; "
        f"`recipe+clip`: `trainer.grad_clip={meta['grad_clip']}`",
        "",
        "| loop | median step (ms) | min (ms) | max (ms) | blocks x steps | vs bare (medians) "
        "| vs bare (paired) | 95 % interval | GC per block (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in loops_summary:
        low, high = r["paired_ci95"]
        lines.append(
            f"| {r['loop']} | {r['median_step_s'] * 1e3:.3f} | {r['min_step_s'] * 1e3:.3f} | "
            f"{r['max_step_s'] * 1e3:.3f} | {r['blocks']} x {r['steps_per_block']} | "
            f"{(r['ratio_to_bare'] - 1) * 100:+.2f} % | {(r['paired_ratio'] - 1) * 100:+.2f} % | "
            f"{(low - 1) * 100:+.2f} % .. {(high - 1) * 100:+.2f} % | {r['gc_ms_per_block']:.1f} |"
        )
    lines += [
        "",
        "Paired: per repetition the loop's block over bare's block of the same repetition (they run back to back), "
        "the median over repetitions and its 95 % bootstrap interval.",
    ]
    lines += ["", "| synchronous stop check alone | per call (µs) | of a bare step |", "|---|---|---|"]
    for p in probes:
        lines.append(f"| {p['what']} | {p['call_s'] * 1e6:.1f} | {p['fraction_of_bare_step'] * 100:.3f} % |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
