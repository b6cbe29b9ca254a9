"""The first export of a fresh process without a pinned pool, against the pinned link (issue 17, item 2).

    python -m benchmarks.probes.bench_first_export --out DIR  # 1 GPU, then 2 concurrent ranks (cuda:0, cuda:1)
    python -m benchmarks.probes.bench_first_export --out DIR --ranks 1       # one GPU only
    python -m benchmarks.probes.bench_first_export --out DIR --device cpu  # smoke test: small, "link" = memcpy

Every trial runs in fresh processes (multiprocessing spawn), one per rank, started together (a barrier before
each timed part). Each process:

1. builds the optimizer: ``--gib`` GiB of exported FP32 state as N x 4M BF16 parameters with an FP32 master and
   BF16 moments (12 exported bytes per parameter element), Transformer Engine's FusedAdam when it imports (CUDA),
   else PortableFusedAdam; one step;
2. measures its pinned link: device-to-host copies of 512 MiB into memory pinned in place for the measurement
   (``cudaHostRegister``) and then unpinned and unmapped, the median of 5 (on CPU: a host memcpy into touched
   memory, labelled so);
3. times its first export, ``state_dict()`` with 64 MiB chunks and either reuse off (``chunked``: fresh host
   memory, pinned staging for this export only) or reuse on without ``prepare_state_dict()`` (``chunked+reuse``:
   the pool's new pageable buffers), GB/s of the exported bytes and % of its own link; the process's anonymous
   RSS (``RssAnon``; ``VmRSS`` too in the JSON) before, after the export and after freeing it (reuse: after
   ``release_state_dict``, the pool keeps the buffers);
4. times host copies into fresh memory with 1, 2, 4, 8 and 16 threads (the rule behind the unstaging threads).

With ``--ranks 2`` the processes mimic torchrun: ``LOCAL_WORLD_SIZE=2`` and ``OMP_NUM_THREADS=1``. Writes
``first_export.jsonl`` (one line per process and trial) and ``first_export.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from optim_factory import FusedAdam, PortableFusedAdam
from optim_factory.optimizers.export.host_memory import host_empty, register_host, unregister_host
from optim_factory.optimizers.export.staging import unstage_threads
from scripts import cli_args

M = 1 << 20
PARAM_NUMEL = 4 * M
EXPORTED_BYTES_PER_ELEMENT = 12  # FP32 master + two BF16 moments exported as FP32
MODES = {"chunked": False, "chunked+reuse": True}  # mode -> reuse (never prepared)
LINK_BYTES = 512 * M
THREAD_SWEEP = (1, 2, 4, 8, 16)


def rss() -> dict[str, float]:
    """This process's resident memory in MiB: ``VmRSS`` and its anonymous part ``RssAnon`` (what the export
    allocates; file-backed pages such as the mapped libraries can be reclaimed at any time under memory
    pressure, which moves ``VmRSS`` without the export doing anything); and ``AnonHugePages`` (of
    ``/proc/self/smaps_rollup``): how much of it the kernel backed with transparent huge pages."""
    out = {}
    for name, keys in (("/proc/self/status", ("VmRSS", "RssAnon")), ("/proc/self/smaps_rollup", ("AnonHugePages",))):
        try:
            with open(name) as f:
                for line in f:
                    key = line.split(":")[0]
                    if key in keys:
                        out[key] = int(line.split()[1]) / 1024
        except OSError:  # not Linux, or no smaps_rollup (before 4.14)
            pass
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(device: torch.device, gib: float, **export):
    """Parameters of about ``gib`` GiB exported, and an optimizer with the export keyword arguments ``export``."""
    n = max(1, round(gib * (1 << 30) / (PARAM_NUMEL * EXPORTED_BYTES_PER_ELEMENT)))
    kw = dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    backend = "portable"
    gen = torch.Generator(device=device).manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(PARAM_NUMEL, device=device, generator=gen).to(torch.bfloat16)) for _ in range(n)
    ]
    opt = None
    if device.type == "cuda":
        try:  # TE's class; it raises ImportError when built without Transformer Engine
            opt, backend = FusedAdam(params, lr=1e-3, **kw, **export), "te"
        except ImportError:
            pass
    if opt is None:
        opt = PortableFusedAdam(params, lr=1e-3, **kw, **export)
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen).to(torch.bfloat16)
    opt.step()
    for p in params:
        p.grad = None
    sync(device)
    return params, opt, backend


def link(device: torch.device, nbytes: int, repeats: int = 5) -> tuple[str, float]:
    """GB/s of the pinned device-to-host link (CPU: a host memcpy into touched memory). The memory is pinned in
    place for the measurement and unpinned and unmapped afterwards, so it stays out of the export's RSS."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = host_empty(torch.Size([nbytes]), torch.uint8)
    dst.fill_(0)
    cuda = device.type == "cuda"
    pinned = cuda and register_host(dst)
    if cuda and not pinned:
        raise RuntimeError("cudaHostRegister failed: cannot measure the pinned link")
    try:
        times = []
        for _ in range(repeats + 1):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        if pinned:
            unregister_host(dst.data_ptr())
    return ("D2H into pinned memory" if cuda else "host memcpy (CPU run: no device link)"), nbytes / statistics.median(
        times[1:]
    ) / 1e9


def thread_sweep(nbytes: int) -> dict[str, float]:
    """GB/s of copying ``nbytes`` into fresh (never touched) memory with T threads, as the unstaging does."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    out = {}
    for threads in THREAD_SWEEP:
        dst = host_empty(torch.Size([nbytes]), torch.uint8)
        share = -(-nbytes // threads)
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            jobs = [
                pool.submit(ctypes.memmove, dst.data_ptr() + o, src.data_ptr() + o, min(share, nbytes - o))
                for o in range(0, nbytes, share)
            ]
            for j in jobs:
                j.result()
            out[str(threads)] = nbytes / (time.perf_counter() - t0) / 1e9
        del dst
    return out


def worker(rank: int, ranks: int, mode: str, args: dict, barrier, queue) -> None:
    try:
        device = torch.device(f"cuda:{rank}" if args["device"] == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        params, opt, backend = build(
            device,
            args["gib"],
            state_dict_cpu_offload=True,
            state_dict_offload_chunk_bytes=args["chunk_mib"] * M,
            state_dict_offload_reuse_buffers=MODES[mode],
            state_dict_offload_pinning="register",
        )
        barrier.wait()
        link_name, link_gbps = link(device, min(LINK_BYTES, int(args["gib"] * (1 << 30))))
        gc.collect()
        barrier.wait()
        rss_before = rss()
        t0 = time.perf_counter()
        sd = opt.state_dict()
        sync(device)
        seconds = time.perf_counter() - t0
        rss_export = rss()
        nbytes = sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values())
        opt.release_state_dict(sd)
        del sd
        gc.collect()
        rss_freed = rss()
        opt.state_exporter.pool.prepare([]).result()  # reuse: released buffers get pinned; not during the sweep
        barrier.wait()
        sweep = thread_sweep(min(LINK_BYTES, int(args["gib"] * (1 << 30))))
        queue.put(
            dict(
                rank=rank,
                ranks=ranks,
                mode=mode,
                device=str(device),
                backend=backend,
                bytes=nbytes,
                seconds=seconds,
                gbps=nbytes / seconds / 1e9,
                link=link_name,
                link_gbps=link_gbps,
                pct_of_link=100 * nbytes / seconds / 1e9 / link_gbps,
                vmrss_mib=dict(before=rss_before["VmRSS"], export=rss_export["VmRSS"], freed=rss_freed["VmRSS"]),
                anon_huge_pages_mib={
                    k: r.get("AnonHugePages") for k, r in (("before", rss_before), ("export", rss_export))
                },
                rss_before_mib=rss_before["RssAnon"],
                rss_export_mib=rss_export["RssAnon"],
                rss_freed_mib=rss_freed["RssAnon"],
                rss_freed_above_before_mib=rss_freed["RssAnon"] - rss_before["RssAnon"],
                unstage_threads=unstage_threads(),
                intraop_threads=torch.get_num_threads(),
                fresh_copy_gbps_by_threads=sweep,
            )
        )
    except BaseException as e:  # noqa: BLE001  (reported by the parent)
        barrier.abort()
        queue.put(dict(rank=rank, ranks=ranks, mode=mode, error=repr(e)))


def spawn_ranks(ranks: int, target, args: tuple, timeout: float, env: dict[str, str] | None = None) -> list[dict]:
    """Run ``target(rank, ranks, *args, barrier, queue)`` in ``ranks`` fresh spawned processes started together,
    each putting one dict on ``queue``; return them sorted by ``rank``. The children get ``env`` and, with more
    than one rank, ``LOCAL_WORLD_SIZE`` and ``OMP_NUM_THREADS=1`` as torchrun sets them (this process's own
    environment is restored afterwards)."""
    ctx = mp.get_context("spawn")
    extra = dict(env or {})
    if ranks > 1:
        extra.update(LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        barrier, queue = ctx.Barrier(ranks), ctx.Queue()
        procs = [ctx.Process(target=target, args=(r, ranks, *args, barrier, queue)) for r in range(ranks)]
        for p in procs:
            p.start()
        rows = [queue.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return sorted(rows, key=lambda r: r["rank"])


def trial(ranks: int, mode: str, args: dict) -> list[dict]:
    rows = spawn_ranks(ranks, worker, (mode, args), args["timeout"])
    errors = [r for r in rows if "error" in r]
    if errors:
        raise RuntimeError(f"{ranks} rank(s), {mode}: " + "; ".join(f"rank {r['rank']}: {r['error']}" for r in errors))
    return rows


def environment(args: dict) -> list[str]:
    def sysfs(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "n/a"

    lines = [
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, CPUs available "
        f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}",
        f"- transparent huge pages: `{sysfs('/sys/kernel/mm/transparent_hugepage/enabled')}`, defrag "
        f"`{sysfs('/sys/kernel/mm/transparent_hugepage/defrag')}`",
        f"- {args['gib']} GiB of FP32 export per rank, {args['chunk_mib']} MiB chunks, device {args['device']}",
    ]
    if args["device"] == "cuda":
        lines.append(f"- GPU: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
        try:
            import transformer_engine

            lines.append(f"- Transformer Engine {transformer_engine.__version__}")
        except ImportError:
            lines.append("- Transformer Engine not importable: PortableFusedAdam")
    return lines


def render(rows: list[dict], env: list[str], command: str) -> str:
    out = ["# First export without a pinned pool (fresh processes)", "", f"`{command}`", "", *env, ""]
    out += [
        "| ranks | rank | mode | backend | exported GB | s | GB/s | link (GB/s) | % of link | anon RSS before (MiB) "
        "| after export | after freeing (above before) | unstage threads |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['ranks']} | {r['rank']} | {r['mode']} | {r['backend']} | {r['bytes'] / 1e9:.2f} "
            f"| {r['seconds']:.3f} "
            f"| {r['gbps']:.1f} | {r['link_gbps']:.1f} ({r['link']}) | **{r['pct_of_link']:.0f} %** "
            f"| {r['rss_before_mib']:.0f} | {r['rss_export_mib']:.0f} "
            f"| {r['rss_freed_mib']:.0f} ({r['rss_freed_above_before_mib']:+.1f}) | {r['unstage_threads']} |"
        )
    out += ["", "Host copy into fresh memory (GB/s) by threads, per process (after its export):", ""]
    out += ["| ranks | rank | mode | " + " | ".join(f"{t} thr" for t in THREAD_SWEEP) + " |"]
    out += ["|---|---|---|" + "---|" * len(THREAD_SWEEP)]
    for r in rows:
        sweep = r["fresh_copy_gbps_by_threads"]
        out.append(
            f"| {r['ranks']} | {r['rank']} | {r['mode']} | "
            + " | ".join(f"{sweep[str(t)]:.1f}" for t in THREAD_SWEEP)
            + " |"
        )
    out += [
        "",
        "reuse on keeps its buffers in the pool after `release_state_dict` (by design): only `chunked` (reuse off) "
        "is expected back at its RSS before the export.",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=cli_args.out_dir, required=True, help="directory for first_export.jsonl and first_export.md"
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ranks", type=int, choices=(1, 2), help="only this many concurrent ranks (default: 1, then 2)")
    ap.add_argument(
        "--gib", type=cli_args.positive_float, help="GiB of FP32 export per rank (default 2 on CUDA, 0.1 on CPU)"
    )
    ap.add_argument("--chunk-mib", type=cli_args.positive_int, default=64)
    ap.add_argument(
        "--timeout", type=cli_args.positive_float, default=300.0, help="seconds a trial's processes may take"
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or len(set(modes)) != len(modes):
        ap.error(f"--modes {args.modes!r}: distinct modes from {','.join(MODES)}")
    if args.gib is not None and not args.gib > 0:
        ap.error(f"--gib {args.gib}: must be > 0")
    if args.chunk_mib <= 0:
        ap.error(f"--chunk-mib {args.chunk_mib}: must be > 0")
    gib = args.gib if args.gib is not None else (2.0 if args.device == "cuda" else 0.1)
    ranks_list = [args.ranks] if args.ranks else [1, 2]
    if args.device == "cuda" and max(ranks_list) > torch.cuda.device_count():
        ap.error(f"--ranks {max(ranks_list)}: this machine has {torch.cuda.device_count()} GPU(s)")
    opts = dict(device=args.device, gib=gib, chunk_mib=args.chunk_mib, timeout=args.timeout)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.probes.bench_first_export " + " ".join(argv if argv is not None else sys.argv[1:])
    rows: list[dict] = []
    with open(out_dir / "first_export.jsonl", "a") as f:
        for ranks in ranks_list:
            for mode in modes:
                for r in trial(ranks, mode, opts):
                    rows.append(r)
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    print(
                        f"{ranks} rank(s) rank {r['rank']} {mode}: {r['gbps']:.1f} GB/s = {r['pct_of_link']:.0f} % of "
                        f"{r['link_gbps']:.1f}; RSS +{(r['rss_export_mib'] - r['rss_before_mib']):.0f} MiB, "
                        f"{r['rss_freed_above_before_mib']:+.1f} MiB after freeing",
                        flush=True,
                    )
    text = render(rows, environment(opts), command)
    (out_dir / "first_export.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
