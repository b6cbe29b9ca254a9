"""What checkpoint checksums cost: hash throughput, and DCP save time with and without them on a large state.

    python -m benchmarks.probes.bench_checksum                       # 1.07 GB state, 3 repeats
    python -m benchmarks.probes.bench_checksum --gb 2 --repeats 5 --dir /some/disk

1. Throughput (GB/s) of XXH3-64 (what recipes/checkpoint/checksums.py uses) and, for comparison, XXH3-128, zlib's crc32
   and adler32, hashlib's blake2b and sha256, over a 256 MiB buffer (best of 3).
2. ``dcp.save`` of a state dict of FP32 tensors (``--gb`` GB in 64 MiB tensors) into ``--dir`` through DCP's
   ``FileSystemWriter`` and through :class:`recipes.checkpoint.checksums.ChecksumFileSystemWriter`, alternating, each
   ``--repeats`` times (files fsynced, as DCP does by default); the median seconds of each and their ratio.
3. The save-time finite check (:func:`optim_factory.optimizers.export.all_finite`) and a verification read
   (:func:`recipes.checkpoint.checksums.file_problem` of every file) of the same state, for reference.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: the repository root
from optim_factory.optimizers.export import all_finite  # noqa: E402
from recipes.checkpoint.checksums import ChecksumFileSystemWriter, file_problem  # noqa: E402
from scripts import cli_args  # noqa: E402

TENSOR = 64 * 2**20  # bytes per tensor


def throughput(buf: bytes) -> dict[str, float]:
    algos = {
        "xxh3_64": lambda b: xxhash.xxh3_64(b).digest(),
        "xxh3_128": lambda b: xxhash.xxh3_128(b).digest(),
        "crc32": lambda b: zlib.crc32(b),
        "adler32": lambda b: zlib.adler32(b),
        "blake2b": lambda b: hashlib.blake2b(b).digest(),
        "sha256": lambda b: hashlib.sha256(b).digest(),
    }
    out = {}
    for name, fn in algos.items():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn(buf)
            best = min(best, time.perf_counter() - t0)
        out[name] = len(buf) / best / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=cli_args.positive_float, default=1.07, help="state size in GB (10^9 bytes)")
    ap.add_argument("--repeats", type=cli_args.positive_int, default=3)
    ap.add_argument("--dir", type=cli_args.out_dir, default=None, help="where to save (default: a temporary directory)")
    args = ap.parse_args(argv)

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(2**26, generator=gen).numpy().tobytes()  # 256 MiB
    for name, gbps in throughput(buf).items():
        print(f"hash {name:8s} {gbps:6.2f} GB/s")
    del buf

    n = max(1, round(args.gb * 1e9 / TENSOR))
    state = {"model": {f"w{i}": torch.randn(TENSOR // 4, generator=gen) for i in range(n)}}
    nbytes = n * TENSOR
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-checksum-"))
    root.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {"plain": [], "checksum": []}
    cpu: dict[str, list[float]] = {"plain": [], "checksum": []}
    try:
        for r in range(args.repeats):
            order = ("plain", "checksum") if r % 2 == 0 else ("checksum", "plain")
            for kind in order:
                path = root / f"{kind}-{r}"
                writer = FileSystemWriter(path) if kind == "plain" else ChecksumFileSystemWriter(path)
                t0, c0 = time.perf_counter(), time.process_time()
                dcp.save(state, storage_writer=writer, no_dist=True)
                times[kind].append(time.perf_counter() - t0)
                cpu[kind].append(time.process_time() - c0)
                if kind == "checksum":
                    sums = writer.checksums()
                    t0 = time.perf_counter()
                    problems = [file_problem(path, name, rec) for name, rec in sums.items()]
                    verify_s = time.perf_counter() - t0
                    assert not any(problems), problems
                shutil.rmtree(path)
        t0 = time.perf_counter()
        assert all_finite(state["model"].values())
        finite_s = time.perf_counter() - t0
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    plain, checked = statistics.median(times["plain"]), statistics.median(times["checksum"])
    print(f"state {nbytes / 1e9:.2f} GB ({n} x 64 MiB FP32), {args.repeats} repeats, into {root}")
    print(f"save plain    median {plain:.3f} s  ({nbytes / plain / 1e9:.2f} GB/s)  all {times['plain']}")
    print(f"save checksum median {checked:.3f} s  ({nbytes / checked / 1e9:.2f} GB/s)  all {times['checksum']}")
    print(f"checksum overhead {100 * (checked / plain - 1):+.1f} % of the save time (median)")
    fast_p, fast_c = min(times["plain"]), min(times["checksum"])
    print(f"fastest: plain {fast_p:.3f} s, checksum {fast_c:.3f} s: {100 * (fast_c / fast_p - 1):+.1f} %")
    cp, cc = statistics.median(cpu["plain"]), statistics.median(cpu["checksum"])
    print(f"CPU time (process, median): plain {cp:.3f} s, checksum {cc:.3f} s: +{cc - cp:.3f} s")
    print(f"finite check (save) {finite_s:.3f} s; verification read (load) {verify_s:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
