"""Where the first export's time goes, and staging configurations compared in one process per rank (the
diagnostic behind benchmarks/results/2026-11-30-h200-fourth/first_export/staging_configs_*.log):

    python -m benchmarks.probes.staging_configs 1   # then 2 (concurrent ranks)

It wraps the staging module's functions in this process only (timers; ``Stager``'s slot size and the thread count
per configuration), exports the state of benchmarks/probes/bench_first_export.py 15 times without a pool (3 interleaved
trials of 5 configurations) and prints one JSON line per (trial, configuration, rank), then medians. It patches
private names of the staging module (``staging._copy``, ``Stager._wait``): a change to them needs a change here."""

import functools
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from benchmarks.probes.bench_first_export import build, link, rss
from optim_factory.optimizers.export import staging
from optim_factory.optimizers.export import stream as stream_mod

M = 1 << 20
CONFIGS = [(8, 8), (16, 32), (16, 16), (12, 32), (16, 64)]  # (threads, slot MiB)


def worker(rank, ranks, barrier, q):
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    params, opt, backend = build(dev, 2.0, state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=64 * M)
    barrier.wait()
    _, lk = link(dev, 512 * M)
    barrier.wait()
    stats = {}
    orig_init, orig_close, orig_wait = staging.Stager.__init__, staging.Stager.close, staging.Stager._wait

    def timed(name, fn):
        @functools.wraps(fn)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                stats[name] = stats.get(name, 0) + time.perf_counter() - t

        return w

    staging.Stager.__init__ = timed("stager_init", orig_init)
    staging.Stager.close = timed("stager_close", orig_close)
    staging.Stager._wait = timed("ring_wait", orig_wait)
    copyt = timed("memmove_thread_s", staging._copy)
    staging._copy = copyt
    orig_stream = stream_mod.StateExporter.stream
    stream_mod.StateExporter.stream = timed("stream", orig_stream)
    for trial in range(3):
        for threads, mib in CONFIGS:
            stream_mod.unstage_threads = lambda t=threads: t
            stream_mod.Stager = functools.partial(staging.Stager, slot_bytes=mib * M)
            stats.clear()
            gc.collect()
            barrier.wait()
            a0 = rss().get("AnonHugePages")
            t0 = time.perf_counter()
            sd = opt.state_dict()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            a1 = rss().get("AnonHugePages")
            nbytes = sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values())
            opt.release_state_dict(sd)
            del sd
            gc.collect()
            q.put(
                dict(
                    rank=rank,
                    ranks=ranks,
                    trial=trial,
                    threads=threads,
                    slot_mib=mib,
                    s=s,
                    pct=100 * nbytes / s / 1e9 / lk,
                    huge_mib=(a1 or 0) - (a0 or 0),
                    **{k: round(v, 4) for k, v in stats.items()},
                )
            )
            barrier.wait()
    q.put(None)


if __name__ == "__main__":
    ranks = int(sys.argv[1])
    ctx = mp.get_context("spawn")
    b = ctx.Barrier(ranks)
    q = ctx.Queue()
    if ranks > 1:
        os.environ.update(LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    ps = [ctx.Process(target=worker, args=(r, ranks, b, q)) for r in range(ranks)]
    [p.start() for p in ps]
    done = 0
    rows = []
    while done < ranks:
        r = q.get(timeout=600)
        if r is None:
            done += 1
            continue
        rows.append(r)
        print(json.dumps(r), flush=True)
    for t, m in CONFIGS:
        for rk in range(ranks):
            v = [r["pct"] for r in rows if r["threads"] == t and r["slot_mib"] == m and r["rank"] == rk]
            pct = f"pct median {statistics.median(v):.1f} all {[round(x) for x in v]}"
            print(f"ranks={ranks} rank={rk} threads={t} slot={m}MiB {pct}")
