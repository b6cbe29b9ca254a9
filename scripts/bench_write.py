"""Durable checkpoint writes against the disk's sequential write rate, measured in one run on one file system.

    python -m scripts.bench_write --gb 2 --threads 1,2,4,8 --repeats 5 --scratch DIR --out DIR
    python -m scripts.bench_write --recipe "model.d_model=2048 ... trainer.device=cuda" --threads 1,4 \\
        --scratch DIR --out DIR

The reference is ``dd if=/dev/zero bs=64M oflag=direct conv=fsync`` of the same number of bytes into ``--scratch``
(direct I/O, flushed: what the disk takes sequentially). Beside it, in the same repeat, each row writes:

* ``synthetic`` (default): a state of ``--gb`` GB of FP32 tensors of ``--tensor-mib`` each through ``dcp.save``
  with the recipe's writer (``recipes.checkpoint.checksums.ChecksumFileSystemWriter``, ``thread_count=T``, every
  file fsynced, XXH3 of every byte), as the recipe saves; ``+zip-crc32`` rows are the same writer with
  ``torch.save``'s per-record CRC32 left on (DCP's default), to show what it costs.
* ``--recipe OVERRIDES``: the recipe itself in this process (``checkpoint.write_threads=T``, sync saves every
  ``--every`` steps, ``--repeats`` checkpoints); each checkpoint's rate is its ``written_bytes / save_s`` from the
  run's metrics.jsonl (``save_s``: the ``dcp.save`` call, the files fsynced).

Synthetic rows are interleaved repeat by repeat, with a reference before each repeat, so that a drifting disk
moves every row alike; with ``--recipe`` each thread count is one run, followed by one reference. Each row's median
is given as a share of the references' median. A share can exceed 100 %: the checkpoint's files are fsynced at
their end, so the page cache takes bytes while the disk writes, where dd waits for each direct 64 MiB block. A
virtual disk varies from run to run: use several repeats (a write of a few hundred MB says little). Writes
``bench_write.md`` and ``bench_write.jsonl`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from scripts import cli_args
from scripts.bench_export import write_results

BLOCK = 64 * 2**20  # dd's block: the reference writes whole blocks


def dd_rate(scratch: Path, nbytes: int) -> float:
    """GB/s of a direct, fsynced sequential write of ``nbytes`` (rounded up to 64 MiB blocks) into ``scratch``."""
    target, count = scratch / "dd.bin", -(-nbytes // BLOCK)
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", f"bs={BLOCK}", f"count={count}", "oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    target.unlink()
    return count * BLOCK / seconds / 1e9


def synthetic_state(gb: float, tensor_mib: float) -> dict[str, torch.Tensor]:
    numel = int(tensor_mib * 2**20) // 4
    count = max(1, round(gb * 1e9 / (numel * 4)))
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}


def writer_classes():
    from recipes.checkpoint.checksums import ChecksumFileSystem, ChecksumFileSystemWriter

    class KeepZipCrc32(ChecksumFileSystem):
        @contextmanager
        def create_stream(self, path, mode: str):
            with super().create_stream(path, mode) as stream:
                torch.serialization.set_crc32_options(True)  # DCP's default: torch.save's CRC32 on every record
                yield stream

    class WithZipCrc32(ChecksumFileSystemWriter):
        def __init__(self, path, **kwargs) -> None:
            super().__init__(path, **kwargs)
            self.fs = KeepZipCrc32()

    return {"": ChecksumFileSystemWriter, "+zip-crc32": WithZipCrc32}


def synthetic_rate(state: dict[str, torch.Tensor], scratch: Path, threads: int, writer_cls) -> tuple[float, int]:
    """(GB/s, bytes on disk) of one ``dcp.save`` of ``state`` as the recipe writes it."""
    import torch.distributed.checkpoint as dcp

    path = scratch / "checkpoint"
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer_cls(path, thread_count=threads))
    seconds = time.perf_counter() - t0
    written = sum(p.stat().st_size for p in path.iterdir())
    shutil.rmtree(path)
    return written / seconds / 1e9, written


def recipe_rates(overrides: list[str], scratch: Path, threads: int, every: int, count: int) -> list[tuple[float, int]]:
    """(GB/s, bytes) of each of ``count`` sync checkpoints of one recipe run with ``write_threads=threads``."""
    from recipes.job import train
    from recipes.train import compose_config

    run_dir = scratch / f"recipe_t{threads}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = compose_config(
        [
            *overrides,
            f"run_dir={run_dir}",
            f"checkpoint.write_threads={threads}",
            f"checkpoint.every_steps={every}",
            f"trainer.max_steps={every * count}",
            "checkpoint.async_save=false",
            "checkpoint.keep_last=1",
            "checkpoint.resume=never",
            "trainer.eval_every=0",
        ]
    )
    train(cfg)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    reports = [r for r in map(json.loads, lines) if r.get("kind") == "checkpoint"]
    shutil.rmtree(run_dir)
    return [(r["written_bytes"] / r["save_s"] / 1e9, r["written_bytes"]) for r in reports]


def thread_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers separated by commas")
    return values


def table(rows: list[dict], reference: list[float]) -> list[str]:
    ref = statistics.median(reference)
    out = [
        f"Reference (`dd oflag=direct conv=fsync`, {len(reference)} runs): median **{ref:.3f} GB/s** "
        f"(runs {', '.join(f'{r:.2f}' for r in reference)}).",
        "",
        "| case | write threads | bytes on disk | median GB/s | runs (GB/s) | share of dd |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        med = statistics.median(row["gbps"])
        runs = ", ".join(f"{r:.2f}" for r in row["gbps"])
        out.append(
            f"| {row['case']} | {row['threads']} | {row['bytes']} | {med:.3f} | {runs} | **{100 * med / ref:.0f} %** |"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli_args.HelpFormatter)
    ap.add_argument("--scratch", type=cli_args.out_dir, required=True, help="a folder on the file system to measure")
    ap.add_argument("--out", type=cli_args.out_dir, required=True, help="bench_write.md and .jsonl go here")
    ap.add_argument("--threads", type=thread_list, default=[1, 2, 4, 8], help="writer threads per row, e.g. 1,4")
    ap.add_argument("--repeats", type=cli_args.positive_int, default=5)
    ap.add_argument("--gb", type=cli_args.positive_float, default=2.0, help="synthetic state size (GB)")
    ap.add_argument("--tensor-mib", type=cli_args.positive_float, default=64.0, help="synthetic tensor size (MiB)")
    ap.add_argument("--no-crc-rows", action="store_true", help="leave out the +zip-crc32 rows")
    ap.add_argument("--recipe", type=shlex.split, help="measure the recipe with these overrides instead")
    ap.add_argument("--every", type=cli_args.positive_int, default=5, help="--recipe: steps between checkpoints")
    args = ap.parse_args(argv)
    if shutil.which("dd") is None:
        ap.error("dd is not on PATH: it writes the reference")
    args.scratch.mkdir(parents=True, exist_ok=True)

    reference: list[float] = []
    rows: list[dict] = []
    if args.recipe is not None:
        for threads in args.threads:
            row = {"case": "recipe", "threads": threads, "gbps": [], "bytes": None}
            rates = recipe_rates(args.recipe, args.scratch, threads, args.every, args.repeats)
            row["gbps"] = [r for r, _ in rates]
            row["bytes"] = rates[-1][1]
            rows.append(row)
            reference.append(dd_rate(args.scratch, row["bytes"]))  # after each run, on the same file system
    else:
        state = synthetic_state(args.gb, args.tensor_mib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        variants = writer_classes()
        if args.no_crc_rows:
            variants = {"": variants[""]}
        rows = [
            {"case": f"synthetic{suffix}", "threads": t, "gbps": [], "bytes": None, "cls": cls}
            for suffix, cls in variants.items()
            for t in args.threads
        ]
        for _ in range(args.repeats):
            reference.append(dd_rate(args.scratch, nbytes))
            for row in rows:
                rate, written = synthetic_rate(state, args.scratch, row["threads"], row["cls"])
                row["gbps"].append(rate)
                row["bytes"] = written
        for row in rows:
            del row["cls"]

    command = "python -m scripts.bench_write " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    meta = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "scratch": str(args.scratch.resolve()),
        "reference_gbps": reference,
    }
    lines = [
        "# Durable checkpoint writes against the disk",
        "",
        *(f"- {k}: `{v}`" for k, v in meta.items() if k != "reference_gbps"),
        "",
        *table(rows, reference),
    ]
    write_results(args.out, "bench_write", meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
