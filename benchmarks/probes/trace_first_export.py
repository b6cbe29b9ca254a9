"""Where the first export of a fresh process spends its time (issue 17, item 2): a timeline of the staging ring.

    python -m benchmarks.probes.trace_first_export --out DIR [--ranks 1 2] [--variants base,t16,nt] [--repeats 2]
    python -m benchmarks.probes.trace_first_export --out DIR --ranks 2 --same-device     # two ranks on one GPU

A diagnostic, not a benchmark of record (``benchmarks/probes/bench_first_export.py`` is that). Each trial runs fresh
processes as that benchmark does (same optimizer, same sizes, one per rank, started together), and records, for
the export's staging (``optim_factory.optimizers.export.staging``), by wrapping its functions in the child
process only:

* per slice copied by a pool thread: when it was picked up, when the slot's device copy was complete (the
  thread's wait on its event), when its bytes were in the destination;
* per wait of the calling thread: for a ring buffer to be prepared (faulted in and pinned) or drained;
* when the stager was created and closed, relative to the start of ``state_dict()``.

From these it reports where the export's wall time went: the calling thread blocked on the ring (copy-bound),
the pool's threads idle or waiting for the device (device- or issue-bound), the copy rate per thread, and the
time before the first and after the last staged byte.

Variants (names in ``--variants``): ``base`` (the export as shipped); ``tN`` (``MAX_UNSTAGE_THREADS``
set to N: N unstaging threads, but never more than CPUs // ``LOCAL_WORLD_SIZE``; the ``threads`` column says);
``nt`` (glibc told to use non-temporal stores for copies of 1 MiB and more:
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000``, set before the child starts); ``populate``
(each slice's destination range is populated with ``madvise(MADV_POPULATE_WRITE)`` before it is copied into).
Writes ``trace.jsonl`` (one line per process and trial) and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from benchmarks.probes.bench_first_export import build, link, spawn_ranks, sync
from optim_factory.optimizers.export.staging import unstage_threads
from scripts import cli_args

M = 1 << 20
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x100000"


def _threads_of(variant: str) -> int | None:
    """N of a ``tN`` variant (``None``: not one)."""
    return int(variant[1:]) if variant[:1] == "t" and variant[1:].isdigit() and int(variant[1:]) >= 1 else None


def _known_variant(name: str) -> bool:
    return name in ("base", "nt", "populate") or _threads_of(name) is not None


def _instrument(variant: str, log: list) -> None:
    """Wrap the staging module's functions in this (child) process so that they append to ``log``."""
    import optim_factory.optimizers.export.staging as st
    from optim_factory.optimizers.export.host_memory import fault_in

    if _threads_of(variant) is not None:
        st.MAX_UNSTAGE_THREADS = _threads_of(variant)
    populate = variant == "populate"

    def copy(event, part):
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()
        t1 = time.perf_counter()
        for dst, src, n in part:
            if populate:  # the export's own fault_in (MADV_POPULATE_WRITE on the range's whole pages)
                fault_in(torch.frombuffer((ctypes.c_char * n).from_address(dst), dtype=torch.uint8))
            ctypes.memmove(dst, src, n)
        log.append(("copy", threading.get_ident(), t0, t1, time.perf_counter(), sum(n for _, _, n in part)))

    def timed(kind, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                log.append((kind, threading.get_ident(), t0, time.perf_counter()))

        return wrapper

    st._copy = copy
    st.Stager._wait = timed("wait", st.Stager._wait)
    st.Stager._prepare = timed("prepare", st.Stager._prepare)
    st.Stager.__init__ = timed("init", st.Stager.__init__)
    st.Stager.close = timed("close", st.Stager.close)
    st.fault_in = timed("fault", fault_in)
    st.register_host = timed("pin", st.register_host)


def summarize(log: list, t_start: float, t_end: float, threads: int) -> dict:
    wall = t_end - t_start
    copies = [e for e in log if e[0] == "copy"]

    def total(kind):
        return sum(e[3] - e[2] for e in log if e[0] == kind)

    out = dict(wall_s=wall, threads=threads, slices=len(copies))
    if copies:
        staged = sum(e[5] for e in copies)
        copy_s = sum(e[4] - e[3] for e in copies)
        out.update(
            copy_threads=len({e[1] for e in copies}),
            staged_gb=staged / 1e9,
            first_pickup_s=min(e[2] for e in copies) - t_start,
            last_copy_end_s=max(e[4] for e in copies) - t_start,
            copy_thread_s=copy_s,
            event_wait_thread_s=sum(e[3] - e[2] for e in copies),
            per_thread_copy_gbps=staged / copy_s / 1e9 if copy_s else None,
            slice_gbps_median=statistics.median((e[5] / max(e[4] - e[3], 1e-9)) / 1e9 for e in copies),
            pool_copy_busy=copy_s / (threads * wall),
        )
    for kind in ("wait", "prepare", "fault", "pin"):
        out[f"{kind}_s"] = total(kind)
    inits = [e for e in log if e[0] == "init"]
    closes = [e for e in log if e[0] == "close"]
    if inits:
        out["stager_created_s"] = inits[0][3] - t_start
        out["stager_init_s"] = inits[0][3] - inits[0][2]
    if closes:
        out["stager_close_s"] = closes[-1][3] - closes[-1][2]
        out["after_close_s"] = t_end - closes[-1][3]
    return out


def worker(rank: int, ranks: int, variant: str, gib: float, cuda: bool, same: bool, barrier, queue) -> None:
    try:
        device = torch.device(f"cuda:{0 if same else rank}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(device)
        log: list = []
        _instrument(variant, log)
        params, opt, backend = build(
            device,
            gib,
            state_dict_cpu_offload=True,
            state_dict_offload_chunk_bytes=64 * M,
            state_dict_offload_reuse_buffers=False,
            state_dict_offload_pinning="register",
        )
        for turn in range(ranks) if same else [rank]:  # ranks sharing a device measure its link one at a time
            barrier.wait()
            if turn == rank:
                link_window = [time.time()]
                _, link_gbps = link(device, min(512 * M, int(gib * (1 << 30))))
                link_window.append(time.time())
        barrier.wait()
        t0 = time.perf_counter()
        sd = opt.state_dict()
        sync(device)
        t1 = time.perf_counter()
        nbytes = sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values())
        row = dict(rank=rank, ranks=ranks, variant=variant, device=str(device), backend=backend, bytes=nbytes)
        row.update(link_gbps=link_gbps, link_window=link_window)  # window: wall-clock seconds (time.time)
        row.update(summarize(log, t0, t1, unstage_threads()))
        row["pct_of_link"] = 100 * nbytes / (t1 - t0) / 1e9 / link_gbps
        queue.put(row)
    except BaseException as e:  # noqa: BLE001  (reported by the parent)
        barrier.abort()
        queue.put(dict(rank=rank, ranks=ranks, variant=variant, error=repr(e)))


def trial(ranks: int, variant: str, gib: float, cuda: bool, same: bool) -> list[dict]:
    env = {"GLIBC_TUNABLES": NT_TUNABLE} if variant == "nt" else None  # read by glibc when the child starts
    return spawn_ranks(ranks, worker, (variant, gib, cuda, same), 300, env)


COLUMNS = (
    ("pct_of_link", "% link", "{:.0f}"),
    ("wall_s", "wall ms", "{:.0f}", 1e3),
    ("stager_created_s", "ring made ms", "{:.1f}", 1e3),
    ("first_pickup_s", "1st slice ms", "{:.1f}", 1e3),
    ("last_copy_end_s", "last copy ms", "{:.0f}", 1e3),
    ("wait_s", "caller drains ms", "{:.0f}", 1e3),
    ("prepare_s", "caller prep ms", "{:.1f}", 1e3),
    ("event_wait_thread_s", "pool event-wait ms", "{:.0f}", 1e3),
    ("pool_copy_busy", "pool copy busy", "{:.2f}"),
    ("per_thread_copy_gbps", "GB/s per copying thread", "{:.2f}"),
    ("threads", "threads", "{}"),
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=cli_args.out_dir, required=True)
    ap.add_argument("--ranks", type=cli_args.positive_int, nargs="+", default=[1])
    ap.add_argument("--variants", default="base")
    ap.add_argument("--repeats", type=cli_args.positive_int, default=2)
    ap.add_argument("--gib", type=cli_args.positive_float, default=2.0)
    ap.add_argument("--cpu", action="store_true", help="smoke test on CPU (no device link: a host memcpy)")
    ap.add_argument(
        "--same-device",
        action="store_true",
        help="every rank on cuda:0 (two concurrent ranks on a one-GPU machine: they share its link, whose "
        "rate each rank measures alone; not the two-GPU case, a stand-in for the host side of it)",
    )
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if not _known_variant(v)]
    if bad or len(set(variants)) != len(variants):
        ap.error(f"--variants {args.variants!r}: distinct names from base, nt, populate, tN (N >= 1 threads)")
    if any(r not in (1, 2) for r in args.ranks):
        ap.error(f"--ranks {args.ranks}: each 1 or 2")
    if args.repeats < 1 or not args.gib > 0:
        ap.error(f"--repeats {args.repeats} --gib {args.gib}: need repeats >= 1 and gib > 0")
    if not args.cpu and (1 if args.same_device else max(args.ranks)) > torch.cuda.device_count():
        ap.error(f"--ranks {args.ranks}: needs that many CUDA devices ({torch.cuda.device_count()} here)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = "| ranks | rank | variant | " + " | ".join(c[1] for c in COLUMNS) + " |"
    print(header)
    print("|" + "---|" * (3 + len(COLUMNS)))
    with open(out / "trace.jsonl", "a") as f:
        for _ in range(args.repeats):
            for ranks in args.ranks:
                for variant in variants:
                    for row in trial(ranks, variant, args.gib, not args.cpu, args.same_device):
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        if "error" in row:
                            print(f"| {ranks} | {row['rank']} | {variant} | error: {row['error']} |", flush=True)
                            continue
                        cells = []
                        for key, _, fmt, *scale in COLUMNS:
                            v = row.get(key)
                            cells.append("-" if v is None else fmt.format(v * scale[0] if scale else v))
                        print(f"| {ranks} | {row['rank']} | {variant} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
