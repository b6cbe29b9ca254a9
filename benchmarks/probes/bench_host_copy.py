"""Which host pipeline can copy a device tensor into fresh pageable memory at >= 30 % of the pinned link (issue 17,
item 2)? One run decides between the export's staging ring as it is and no staging at all (the destination
faulted in and pinned in place in pieces, DMA straight into it).

    python -m benchmarks.probes.bench_host_copy --out DIR                                   # 1 GPU
    torchrun --nproc_per_node=2 -m benchmarks.probes.bench_host_copy --out DIR  # 2 concurrent ranks, 1 GPU each
    python -m benchmarks.probes.bench_host_copy --out DIR --device cpu                      # smoke test: small sizes

Each process (rank) fills a ``--mib`` MiB device tensor with an ``int32`` arange and, per trial, copies it in
``--chunk-mib`` chunks into a fresh ``host_empty`` destination, checks one ``int32`` in every 1021 (so every
4 KiB page) plus the last against the arange, frees it and checks that its anonymous RSS is back at its baseline.
The variants (``--variants`` picks some; trials interleave them; with 2 ranks they run concurrently, a barrier
before every trial):

* ``ring``: the export's ``Stager`` as it is (``unstage_threads()`` threads, 8 MiB slots) -- today's export;
* ``ring tT sS``: the same with T threads and S MiB slots;
* ``register tT pP``: no staging: T threads fault the destination in (``fault_in``, ``MADV_POPULATE_WRITE``)
  in pieces of P MiB, ahead of the copies and in parallel within a piece; one thread pins each faulted piece in
  place (``cudaHostRegister``); the main thread copies into each pinned piece on a side stream; one thread
  unpins each piece after its copy's event. Nothing bounds how far ahead faulting and pinning run (the whole
  destination may be pinned at once). On CPU the copy is a plain copy and nothing is pinned.

Before the trials each process measures its pinned link (``bench_first_export.link``: D2H into memory pinned for
the measurement; on CPU a host memcpy) and the host-side rates the variants depend on: a T-thread memcpy into
fresh memory (the ring's unstaging), a T-thread ``fault_in`` of fresh memory, and pinning (then unpinning)
faulted memory in P MiB pieces (the register pipeline). Rank 0 writes ``host_copy_<N>rank.jsonl`` and ``.md``
(N = ranks) to ``--out`` and prints the table; the exit status is 1 if any trial copied wrong bytes or failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.probes.bench_first_export import link, rss, sync
from optim_factory.optimizers.export.host_memory import (
    fault_in,
    host_empty,
    register_host,
    unregister_host,
    worker_threads,
)
from optim_factory.optimizers.export.staging import SLOT_BYTES, Stager, UnstageWorkers, unstage_threads
from scripts import cli_args

M = 1 << 20
HUGE = 2 * M  # fault-in slices are whole huge pages: two threads never fault the same one
SAMPLE_STRIDE = 1021  # int32 elements between checked samples: < 1024, so every 4 KiB page is checked
TARGET_PCT = 30
RATE_BYTES = 512 * M  # bytes of each host-side rate measurement (at most --mib)


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # ring | register
    threads: int
    mib: int  # staging slot (ring) or pinned piece (register), MiB

    @property
    def grain(self) -> str:
        return f"{'slot' if self.kind != 'register' else 'piece'} {self.mib} MiB"


def variants() -> list[Variant]:
    """Today's ring first, then the grid (without a duplicate of today's ring)."""
    today = Variant("ring", "ring", unstage_threads(), SLOT_BYTES // M)
    out = [today]
    for kind, grains in (("ring", (8, 32)), ("register", (64, 256))):
        for mib in grains:
            for threads in (8, 16):
                v = Variant(f"{kind} t{threads} {'p' if kind == 'register' else 's'}{mib}", kind, threads, mib)
                if (v.kind, v.threads, v.mib) != (today.kind, today.threads, today.mib):
                    out.append(v)
    return out


def copy_ring(src: torch.Tensor, dst: torch.Tensor, chunk: int, v: Variant, stream) -> dict:
    """The export's staging path: ``src`` (bytes) into ``dst`` (bytes) chunk by chunk through a ``Stager``."""
    n = src.numel()
    workers = UnstageWorkers(v.threads, None if stream is None else stream.device)
    with workers, Stager(n, stream, workers, slot_bytes=v.mib * M) as stager:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for c in range(0, n, chunk):
                stager.put(src[c : c + chunk], dst[c : c + chunk])
        stager.flush()
    return {}


def _fault_slices(a: int, b: int, threads: int) -> list[tuple[int, int]]:
    share = -(-(b - a) // threads // HUGE) * HUGE or HUGE
    return [(x, min(x + share, b)) for x in range(a, b, share)]


def copy_register(src: torch.Tensor, dst: torch.Tensor, chunk: int, v: Variant, stream) -> dict:
    """No staging: fault ``dst`` in ahead in parallel, pin it in place piece by piece, DMA into the pinned pieces,
    unpin each after its copy. Returns the seconds the copying thread waited for pieces to be ready."""
    n, piece = src.numel(), v.mib * M
    pieces = [(a, min(a + piece, n)) for a in range(0, n, piece)]
    cuda = stream is not None
    pinned = [False] * len(pieces)

    def pin(k: int, faults: list[Future]) -> None:
        for f in faults:
            f.result()
        a, b = pieces[k]
        if cuda:
            if not register_host(dst[a:b]):
                raise RuntimeError(f"cudaHostRegister refused piece {k} ({b - a} bytes)")
            pinned[k] = True

    def unpin(k: int, event) -> None:
        event.synchronize()
        unregister_host(dst[pieces[k][0] :].data_ptr())
        pinned[k] = False

    waited = 0.0
    faulter = ThreadPoolExecutor(v.threads, thread_name_prefix="bench-fault")
    pinner = worker_threads(1, "bench-pin", src.device)  # the CUDA threads make the copy's device current
    unpinner = worker_threads(1, "bench-unpin", src.device)
    try:
        # every piece's faults are queued now, in order (the pool runs them first in, first out): faulting runs
        # ahead of the pinning, the pinning ahead of the copies
        faults = [[faulter.submit(fault_in, dst[x:y]) for x, y in _fault_slices(a, b, v.threads)] for a, b in pieces]
        ready = [pinner.submit(pin, k, f) for k, f in enumerate(faults)]
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for k, (a, b) in enumerate(pieces):
                t0 = time.perf_counter()
                ready[k].result()
                waited += time.perf_counter() - t0
                for c in range(a, b, chunk):
                    dst[c : min(c + chunk, b)].copy_(src[c : min(c + chunk, b)], non_blocking=cuda)
                if cuda:
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
                    unpinner.submit(unpin, k, event)
    finally:
        for pool in (faulter, pinner, unpinner):
            pool.shutdown(wait=True)
        if cuda:
            stream.synchronize()
        for k, is_pinned in enumerate(pinned):  # after a failure: nothing stays pinned
            if is_pinned:
                unregister_host(dst[pieces[k][0] :].data_ptr())
    return {"wait_for_pieces_s": waited}


def check(dst: torch.Tensor) -> bool:
    """One int32 in every 1021 (every 4 KiB page) and the last equal the arange the source holds."""
    d = dst.view(torch.int32)
    idx = torch.arange(0, d.numel(), SAMPLE_STRIDE)
    return torch.equal(d[idx], idx.to(torch.int32)) and int(d[-1]) == d.numel() - 1


def host_rates(nbytes: int, threads: list[int], pieces_mib: list[int], cuda: bool) -> dict:
    """GB/s of what the variants depend on, on the host: T-thread memcpy into fresh memory, T-thread fault_in of
    fresh memory; with CUDA, pinning / unpinning faulted memory in P MiB pieces."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    out: dict[str, float] = {}
    for t in threads:
        for what in ("memcpy_fresh", "fault_in"):
            dst = host_empty(torch.Size([nbytes]), torch.uint8)
            slices = _fault_slices(0, nbytes, t)
            with ThreadPoolExecutor(t) as pool:
                t0 = time.perf_counter()
                if what == "memcpy_fresh":
                    base, sbase = dst.data_ptr(), src.data_ptr()  # as the unstaging threads copy
                    jobs = [pool.submit(ctypes.memmove, base + x, sbase + x, y - x) for x, y in slices]
                else:
                    jobs = [pool.submit(fault_in, dst[x:y]) for x, y in slices]
                for j in jobs:
                    j.result()
                out[f"{what}_t{t}"] = nbytes / (time.perf_counter() - t0) / 1e9
            del dst
    if cuda:
        dst = host_empty(torch.Size([nbytes]), torch.uint8)
        fault_in(dst)
        for p in pieces_mib:
            done: list[int] = []
            try:
                t0 = time.perf_counter()
                for a in range(0, nbytes, p * M):
                    if not register_host(dst[a : a + p * M]):
                        raise RuntimeError(f"cudaHostRegister refused {p} MiB of faulted memory")
                    done.append(a)
                t1 = time.perf_counter()
            except RuntimeError as e:  # recorded: the trials still run
                out[f"register_p{p}_error"] = repr(e)
                t1 = None
            finally:
                t2 = time.perf_counter()
                for a in done:
                    unregister_host(dst[a:].data_ptr())
            if t1 is not None:
                out[f"register_p{p}"] = nbytes / (t1 - t0) / 1e9
                out[f"unregister_p{p}"] = nbytes / (time.perf_counter() - t2) / 1e9
        del dst
    gc.collect()
    return out


def depends_on(v: Variant, rates: dict) -> str:
    if v.kind == "register":
        fault, reg = rates[f"fault_in_t{v.threads}"], rates.get(f"register_p{v.mib}")
        return f"fault-in {fault:.1f}" + (f", pin {reg:.1f}, unpin {rates[f'unregister_p{v.mib}']:.1f}" if reg else "")
    return f"memcpy fresh {rates[f'memcpy_fresh_t{v.threads}']:.1f}"


def trial(v: Variant, src: torch.Tensor, chunk: int, stream, device: torch.device) -> dict:
    gc.collect()
    before = rss()["RssAnon"]
    t0 = time.perf_counter()
    dst = host_empty(src.shape, torch.uint8)
    extra = (copy_register if v.kind == "register" else copy_ring)(src, dst, chunk, v, stream)
    sync(device)
    seconds = time.perf_counter() - t0
    filled = rss()["RssAnon"]
    ok = check(dst)
    del dst
    gc.collect()
    freed = rss()["RssAnon"]
    return dict(
        seconds=seconds,
        gbps=src.numel() / seconds / 1e9,
        bytes_ok=ok,
        rss_before_mib=before,
        rss_filled_mib=filled,
        rss_freed_above_before_mib=freed - before,
        **extra,
    )


def environment(args, ranks: int) -> list[str]:
    def sysfs(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "n/a"

    probe = host_empty(torch.Size([HUGE]), torch.uint8)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, host {platform.node()}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, kernel {platform.release()}, "
        f"CPUs available per process {cpus}, unstage_threads() {unstage_threads()}, fault_in by {fault_in(probe)}",
        f"- transparent huge pages: `{sysfs('/sys/kernel/mm/transparent_hugepage/enabled')}`, defrag "
        f"`{sysfs('/sys/kernel/mm/transparent_hugepage/defrag')}`",
        f"- {ranks} concurrent rank(s), {args.mib} MiB per rank in {args.chunk_mib} MiB chunks, {args.trials} "
        f"trial(s) per variant (median), device {args.device}",
    ]
    if args.device == "cuda":
        lines.append(f"- GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    return lines


def render(rows: list[dict], env: list[str], command: str, ranks: int) -> str:
    out = [f"# Device to fresh pageable host memory, {ranks} rank(s)", "", f"`{command}`", "", *env, ""]
    out += [
        "| variant | threads | grain | rank | GB/s (median) | min-max | link GB/s | % of link (median) "
        f"| >= {TARGET_PCT} % | bytes ok | RSS after free (MiB above before, max) | waited for pieces (s) "
        "| host-side rate it depends on (GB/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["variant"], r["rank"]) for r in rows))
    for name, rank in keys:
        rs = [r for r in rows if r["variant"] == name and r["rank"] == rank]
        good = [r for r in rs if "error" not in r]
        first = rs[0]
        head = f"| {name} | {first['threads']} | {first['grain']} | {rank} "
        if not good:
            out.append(head + f"| failed: {rs[0]['error'][:120]} |" + " |" * 8)
            continue
        gbps = [r["gbps"] for r in good]
        med = statistics.median(gbps)
        pct = 100 * med / first["link_gbps"]
        waits = [r["wait_for_pieces_s"] for r in good if "wait_for_pieces_s" in r]
        out.append(
            head + f"| {med:.1f} | {min(gbps):.1f}-{max(gbps):.1f} | {first['link_gbps']:.1f} | **{pct:.0f} %** "
            f"| {'yes' if pct >= TARGET_PCT else 'no'} "
            f"| {'yes' if all(r['bytes_ok'] for r in good) else '**NO**'}"
            f"{'' if len(good) == len(rs) else f' ({len(rs) - len(good)} failed)'} "
            f"| {max(r['rss_freed_above_before_mib'] for r in good):+.1f} "
            f"| {f'{statistics.median(waits):.3f}' if waits else '-'} | {first['depends_on']} |"
        )
    out += [
        "",
        f"Link: {rows[0]['link'] if rows else 'n/a'}. Host-side rates are measured in each process before the trials "
        f"({RATE_BYTES // M} MiB at most; with 2 ranks concurrently): `memcpy fresh` = T threads copying host "
        "memory into never-touched memory (the ring's unstaging), `fault-in` = T threads faulting never-touched "
        "memory in (`madvise(MADV_POPULATE_WRITE)`), `pin` = `cudaHostRegister` of faulted memory in pieces.",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=cli_args.out_dir, required=True, help="directory for host_copy_<N>rank.jsonl and .md")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mib", type=cli_args.positive_int, help="MiB copied per rank (default 2048 on CUDA, 80 on CPU)")
    ap.add_argument(
        "--chunk-mib", type=cli_args.positive_int, help="MiB per device copy (default 64 on CUDA, 16 on CPU)"
    )
    ap.add_argument("--trials", type=cli_args.positive_int, default=3)
    ap.add_argument("--variants", help="comma-separated variant names (default: all; see the table)")
    args = ap.parse_args(argv)
    args.mib = args.mib if args.mib is not None else (2048 if args.device == "cuda" else 80)
    args.chunk_mib = args.chunk_mib if args.chunk_mib is not None else (64 if args.device == "cuda" else 16)
    for key in ("mib", "chunk_mib", "trials"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} {getattr(args, key)}: must be >= 1")
    chosen = variants()
    if args.variants:
        names = [s.strip() for s in args.variants.split(",")]
        unknown = [s for s in names if s not in {v.name for v in chosen}]
        if unknown:
            ap.error(f"--variants {unknown[0]!r}: expected some of {', '.join(v.name for v in chosen)}")
        chosen = [v for v in chosen if v.name in names]
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ranks > 1 else 0
    barrier = dist.barrier if ranks > 1 else (lambda: None)
    device = torch.device(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    nbytes = args.mib * M
    src = torch.arange(nbytes // 4, dtype=torch.int32, device=device).view(torch.uint8)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    sync(device)

    barrier()
    link_name, link_gbps = link(device, min(512 * M, nbytes))
    barrier()
    rates = host_rates(
        min(RATE_BYTES, nbytes),
        sorted({v.threads for v in chosen}),
        sorted({v.mib for v in chosen if v.kind == "register"}),
        device.type == "cuda",
    )
    print(
        f"rank {rank}: link {link_gbps:.1f} GB/s ({link_name}); host rates "
        + ", ".join(f"{k} {x:.1f}" for k, x in rates.items()),
        flush=True,
    )
    rows = []
    for t in range(args.trials):
        for v in chosen:
            barrier()
            row = dict(
                rank=rank,
                ranks=ranks,
                trial=t,
                variant=v.name,
                **asdict(v),
                grain=v.grain,
                link=link_name,
                link_gbps=link_gbps,
                depends_on=depends_on(v, rates),
                host_rates=rates,
            )
            try:
                row.update(trial(v, src, args.chunk_mib * M, stream, device))
                row["pct_of_link"] = 100 * row["gbps"] / link_gbps
                print(
                    f"rank {rank} trial {t} {v.name}: {row['gbps']:.1f} GB/s = {row['pct_of_link']:.0f} % of link, "
                    f"bytes ok {row['bytes_ok']}, RSS {row['rss_freed_above_before_mib']:+.1f} MiB",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001  (recorded; the other variants still run)
                row["error"] = repr(e)
                print(f"rank {rank} trial {t} {v.name}: FAILED {e!r}", flush=True)
            rows.append(row)
    if ranks > 1:
        gathered: list = [None] * ranks
        dist.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    bad = [r for r in rows if "error" in r or not r.get("bytes_ok", False)]
    if rank == 0:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"host_copy_{ranks}rank"
        launcher = f"torchrun --nproc_per_node={ranks}" if ranks > 1 else "python"
        command = f"{launcher} -m benchmarks.probes.bench_host_copy " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        with open(out_dir / f"{stem}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        text = render(rows, environment(args, ranks), command, ranks)
        (out_dir / f"{stem}.md").write_text(text)
        print(text, flush=True)
        if bad:
            print(f"{len(bad)} trial(s) failed or copied wrong bytes: see the table", flush=True)
    if ranks > 1:
        dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
