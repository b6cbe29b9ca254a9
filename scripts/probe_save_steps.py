"""What slows the training steps after a save: ``scripts.bench_save`` run as it is, with every step logged (the CPU
time until it is enqueued and its total), every garbage collection of generation 1 or 2, each save call, and when
each save's DCP local plan and data write start and end (on DCP's upload thread), one JSON object per line in
``PROBE_LOG`` (default ``probe_steps.jsonl``). A step whose enqueue time is its total
waited on the CPU (for the GIL); one that only runs longer waited on the device.

Environment variables change one thing each (benchmarks/results/2026-12-04-h200-frameworks/README.md, second
pass): ``PROBE_GC=off`` turns automatic garbage collection off (as torchtitan's Trainer runs);
``PROBE_WRITER=fs1|fs4|csum4`` makes ``AsyncSaveStager.async_save`` write with DCP's ``FileSystemWriter`` of 1 or
4 threads or the recipe's ``ChecksumFileSystemWriter`` of 4 threads; ``PROBE_C_THREADS=N`` gives the recipe's modes
N writer threads.

    PROBE_LOG=steps.jsonl torchrun --standalone --nproc_per_node=1 -m scripts.probe_save_steps --out DIR \\
        --scratch S --layers 22 --repeats 3 --modes c-ours,f-titan-ours
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import threading
import time

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from optim_factory.checkpoint import AsyncSaveStager
from scripts import bench_save

WRITERS = {"fs1": ("dcp", 1), "fs4": ("dcp", 4), "csum4": ("checksums", 4)}


class StepLog:
    """The JSON lines of one run, timed from its start (written from the training thread and DCP's upload thread)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a")  # noqa: SIM115  (open for the process's whole run)
        self.t0 = time.perf_counter()
        self._gc_start = 0.0
        self._lock = threading.Lock()

    def write(self, **row) -> None:
        line = json.dumps({"t": round(time.perf_counter() - self.t0, 4), **row}) + "\n"
        with self._lock:
            self.file.write(line)
            self.file.flush()

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif info["generation"] >= 1:
            self.write(ev="gc", gen=info["generation"], ms=round((time.perf_counter() - self._gc_start) * 1e3, 2))


def logged_step(log: StepLog):
    """``bench_save.Trainer.step`` with each step's enqueue time and total logged."""
    step = bench_save.Trainer.step

    def logged(self, before_step=None):
        total, hook_s = step(self, before_step)
        log.write(ev="step", enq=round(self.enqueued_s, 4), hook=round(hook_s, 4), total=round(total, 4))
        return total, hook_s

    return logged


def logged_phase(log: StepLog, method, ev: str):
    """``method`` with ``<ev>_start`` and ``<ev>_end`` lines around each call (on the thread that calls it)."""

    @functools.wraps(method)
    def logged(self, *args, **kwargs):
        log.write(ev=f"{ev}_start")
        try:
            return method(self, *args, **kwargs)
        finally:
            log.write(ev=f"{ev}_end")

    return logged


def writer_for(name: str, checkpoint_id: str):
    kind, threads = WRITERS[name]
    if kind == "dcp":
        return FileSystemWriter(checkpoint_id, thread_count=threads)
    from recipes.checkpoint.checksums import ChecksumFileSystemWriter

    return ChecksumFileSystemWriter(checkpoint_id, thread_count=threads)


def install(env: dict[str, str]) -> StepLog:
    """Patch ``scripts.bench_save`` (and, for ``PROBE_WRITER``, ``AsyncSaveStager.async_save``) in this process."""
    log = StepLog(env.get("PROBE_LOG", "probe_steps.jsonl"))
    gc.callbacks.append(log.on_gc)
    if env.get("PROBE_GC") == "off":
        gc.disable()
    bench_save.Trainer.step = logged_step(log)
    # where each save's DCP work falls among the steps: its local plan, and its data files' write
    DefaultSavePlanner.create_local_plan = logged_phase(log, DefaultSavePlanner.create_local_plan, "plan")
    FileSystemWriter.write_data = logged_phase(log, FileSystemWriter.write_data, "write")
    writer = env.get("PROBE_WRITER", "")
    if writer:
        if writer not in WRITERS:
            raise SystemExit(f"PROBE_WRITER={writer}: expected one of {', '.join(WRITERS)}")
        async_save = AsyncSaveStager.async_save

        def with_writer(self, state_dict, **kwargs):
            if kwargs.get("storage_writer") is None:
                kwargs["storage_writer"] = writer_for(writer, kwargs["checkpoint_id"])
            return async_save(self, state_dict, **kwargs)

        AsyncSaveStager.async_save = with_writer
    threads = env.get("PROBE_C_THREADS")
    if threads:
        bench_save.CheckpointConfig = functools.partial(bench_save.CheckpointConfig, write_threads=int(threads))
    make_mode = bench_save.make_mode

    def logged_mode(name, ctx):
        mode = make_mode(name, ctx)
        save = mode.save

        def logged_save(step, path):
            log.write(ev="save", mode=name, writer=writer, c_threads=threads)
            return save(step, path)

        mode.save = logged_save
        return mode

    bench_save.make_mode = logged_mode
    return log


def main(argv: list[str] | None = None) -> None:
    install(dict(os.environ))
    bench_save.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
