"""Benchmark FusedAdam checkpoint export: GPU peak and time of state_dict() per mode, vs. the host link.

    python -m scripts.bench_export                          # all cases, TE backend, prints a markdown table
    python -m scripts.bench_export --cases 8x4M --dtypes bf16 --repeats 3 --out results.md --png peak.png
    python -m scripts.bench_export --cases 64x4M --dtypes bf16 --modes chunked,chunked+reuse --fresh 10
    python -m scripts.bench_export --backend portable --device cpu --cases 1x1M --repeats 1   # smoke test

Modes:
  default       TE's FusedAdam.state_dict(): every state converted to FP32 on the GPU, all kept until it returns
  default+cpu   the same, then every tensor copied to CPU (what DCP's StateDictOptions(cpu_offload=True) does)
  offload       state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=0: one state converted, copied to
                CPU and dropped at a time
  chunked       state_dict_cpu_offload=True (chunks of --chunk-mib): streamed in chunks into fresh pageable memory
                through a per-export pinned staging ring emptied by host threads, conversion overlapped with
                the copies on a side stream
  chunked+reuse + state_dict_offload_reuse_buffers: into pooled buffers, released after each export (as the
                recipe's CheckpointManager does once the checkpoint is written); new buffers are pageable (huge
                pages, through the staging buffers) and pinned in place in the background once released
  chunked+reuse-alloc     pooled buffers allocated pinned (cudaHostAlloc), copied into directly
  chunked+reuse-pageable  pooled buffers never pinned (always through the staging buffers)

GPU peak is torch.cuda.max_memory_allocated() above the level before the call (the largest of the repeats);
time is the median of --repeats runs after one warm-up; GB/s counts the FP32 bytes exported. In the same run
the device-to-host copy bandwidth is measured into pinned memory, fresh pageable memory and reused pageable
memory (1 GiB, median of 5), and each export's GB/s is reported against the pinned figure.

``--fresh N`` also runs, for each chunked mode, a fresh process per case that times its very first export
(staging or pool buffers allocated, pages first touched) and then N - 1 more (released each time), and
reports the first, the last, and the process's RSS and pinned host bytes after the 2nd and the Nth export; with
chunked+reuse, one more whose buffers ``prepare_state_dict()`` readied before the first export (timed apart).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch

from optim_factory.optimizers.export import ExportOptions, Pinning
from optim_factory.tree import local_tensors
from recipes.checkpoint import state_bytes
from scripts import cli_args

ROOT = Path(__file__).resolve().parent.parent  # the fresh processes run ``-m scripts.bench_export`` from here

M = 1 << 20
FP8 = torch.uint8


def gpt_shapes(d: int = 1024, layers: int = 24, vocab: int = 50304) -> list[tuple[int, ...]]:
    """A GPT-2-medium-sized model (~355M parameters)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


CASES: dict[str, list[tuple[int, ...]]] = {
    "1x1M": [(M,)] * 1,
    "8x1M": [(M,)] * 8,
    "32x1M": [(M,)] * 32,
    "8x4M": [(4 * M,)] * 8,
    "64x4M": [(4 * M,)] * 64,
    "gpt-355M": gpt_shapes(),
    "1x1G": [(1 << 30,)],  # one state of 1.07e9 elements (4 GiB in FP32)
}
DTYPES: dict[str, tuple[torch.dtype, dict]] = {
    "bf16": (torch.float32, dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)),
    "fp16": (torch.float32, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)),
    "fp8": (torch.float32, dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8)),
    "bf16-params+fp16-master": (
        torch.bfloat16,
        dict(
            master_weights=True,
            master_weight_dtype=torch.float16,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        ),
    ),
}
MODES = (
    "default",
    "default+cpu",
    "offload",
    "chunked",
    "chunked+reuse",
    "chunked+reuse-alloc",
    "chunked+reuse-pageable",
)
PREPARED = ", prepared"
CHUNK_OPTIONS = {  # mode -> (reuse, pinning of the pooled buffers)
    "chunked": (False, "register"),  # no pool: the pinning option does not apply
    "chunked+reuse": (True, "register"),
    "chunked+reuse-alloc": (True, "alloc"),
    "chunked+reuse-pageable": (True, "none"),
}


def write_results(out, name: str, meta: dict, rows: list[dict], markdown: str) -> None:
    """``out/name.jsonl`` (the meta line, then a line per row) and ``out/name.md``; the markdown is printed too."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.jsonl", "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown, end="" if markdown.endswith("\n") else "\n", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2h_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """GB/s of a device-to-host copy into pinned, fresh pageable and reused pageable memory."""
    if device.type != "cuda":
        return {}
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    sync(device)
    t0 = time.perf_counter()
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)  # the process's first pinned allocation
    alloc_s = time.perf_counter() - t0
    reused = torch.empty(src.shape, dtype=src.dtype)
    reused.fill_(0)  # touch the pages once

    def timed(fn) -> float:
        fn()
        sync(device)
        times = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9

    out = {
        "pinned": timed(lambda: pinned.copy_(src, non_blocking=True)),
        "pageable (fresh)": timed(lambda: src.to("cpu")),
        "pageable (reused)": timed(lambda: reused.copy_(src)),
        "pinned allocation (first 1 GiB, not a copy)": nbytes / alloc_s / 1e9,
    }
    return out


def build(case: str, dtype_name: str, backend: str, device: torch.device, mode: str = "default", chunk_bytes: int = 0):
    """The case's parameters and an optimizer that exports as ``mode`` says (its export options are fixed at
    construction), after one step."""
    param_dtype, kw = DTYPES[dtype_name]
    if backend == "te":
        from optim_factory import FusedAdam as cls
    else:
        from optim_factory import PortableFusedAdam as cls
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen).to(param_dtype)) for s in CASES[case]]
    opt = cls(params, lr=1e-3, **kw, **export_options(mode, chunk_bytes))
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen).to(param_dtype)
    opt.step()
    for p in params:
        p.grad = None
    return params, opt


def export_options(mode: str, chunk_bytes: int) -> dict:
    """The optimizer's export keyword arguments for ``mode``."""
    chunked = mode in CHUNK_OPTIONS
    reuse, pinning = CHUNK_OPTIONS.get(mode, (False, "register"))
    return dict(
        state_dict_cpu_offload=mode == "offload" or chunked,
        state_dict_offload_chunk_bytes=chunk_bytes if chunked else 0,
        state_dict_offload_reuse_buffers=reuse,
        state_dict_offload_pinning=pinning,
    )


def wait_pinning(opt) -> float:
    """Seconds until the pool's background pinning of released buffers is done (between checkpoints): the pool's
    one background thread pins them in order, then runs this preparation of nothing."""
    t0 = time.perf_counter()
    opt.state_exporter.pool.prepare([]).result()
    return time.perf_counter() - t0


class PoolBuffers:
    """The pooled host buffers that ``opt``'s exports leased, where its options reuse buffers pinned in place
    (``cudaHostRegister``): seen by a state-dict post-hook (torch's ``Optimizer.register_state_dict_post_hook``,
    which the optimizer runs on the exported dictionary) and held weakly, so that a buffer is forgotten once freed.
    A buffer the pool prepared counts from the first export that leases it."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self.buffers: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        o = opt.export_options
        if o.cpu_offload and o.reuse_buffers and o.pinning is Pinning.register:
            opt.register_state_dict_post_hook(self._record)

    def _record(self, opt, exported: dict) -> None:
        for t in local_tensors(exported):
            if opt.is_leased_export_buffer(t):
                self.buffers[id(t)] = t

    def pinned_bytes(self) -> int:
        """Bytes of those buffers that the pool has pinned (those whose registration CUDA refused stay pageable
        and are not counted); after :func:`wait_pinning`, every released one the pool could pin."""
        pool = self.opt.state_exporter.pool
        return sum(t.numel() * t.element_size() for t in self.buffers.values() if pool.is_pinned(t))


def run_mode(opt, mode: str, device: torch.device) -> tuple[int, int]:
    """One export in ``mode``; returns (exported bytes, GPU peak bytes above the level before)."""
    on_cuda = device.type == "cuda"
    sync(device)
    if on_cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    sd = opt.state_dict()
    if mode == "default+cpu":
        sd = {"state": {k: {n: v.to("cpu") for n, v in st.items()} for k, st in sd["state"].items()}}
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base if on_cuda else 0
    nbytes = state_bytes(sd["state"])
    opt.release_state_dict(sd)  # reuse modes: the checkpoint is written, the buffers go back to the pool
    del sd
    return nbytes, peak


def bench_case(
    case: str, dtype_name: str, backend: str, device: torch.device, repeats: int, modes, chunk_bytes: int
) -> list[dict]:
    rows = []
    for mode in modes:
        params, opt = build(case, dtype_name, backend, device, mode, chunk_bytes)
        n_params = sum(p.numel() for p in params)
        gc.collect()
        t0 = time.perf_counter()
        run_mode(opt, mode, device)  # warm-up (the first export of this mode in this process)
        first = time.perf_counter() - t0
        wait_pinning(opt)  # as between two checkpoints: released buffers get pinned in the background
        times, peaks, nbytes = [], [], 0
        for _ in range(repeats):
            gc.collect()
            t0 = time.perf_counter()
            nbytes, peak = run_mode(opt, mode, device)
            times.append(time.perf_counter() - t0)
            peaks.append(peak)
        t = statistics.median(times)
        rows.append(
            dict(
                case=case,
                params=n_params,
                dtype=dtype_name,
                mode=mode,
                chunk_mib=chunk_bytes / M if mode in CHUNK_OPTIONS else None,
                peak_mib=max(peaks) / M,
                time_ms=t * 1e3,
                first_ms=first * 1e3,
                last_ms=times[-1] * 1e3,
                bytes=nbytes,
                gbps=nbytes / t / 1e9,
                last_gbps=nbytes / times[-1] / 1e9,
            )
        )
        opt.state_exporter.close()
        del params, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def host_memory(pool_buffers: PoolBuffers) -> dict[str, int]:
    """This process's resident set and its pinned host bytes: torch's host allocator's plus those the export
    pool pinned with cudaHostRegister (:class:`PoolBuffers`)."""
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    pinned = 0
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        pinned = int(stats.get("allocated_bytes.current", 0)) + pool_buffers.pinned_bytes()  # blocks in use + cached
    return {"rss": rss, "pinned": pinned}


def fresh_process(case: str, dtype_name: str, backend: str, device: torch.device, mode: str, n: int, chunk: int):
    """Body of the ``--_fresh`` child: the first export of a new process, then n - 1 more; prints one JSON line.
    Mode ``chunked+reuse, prepared``: ``prepare_state_dict()`` runs (and is awaited, timed apart) first."""
    params, opt = build(case, dtype_name, backend, device, mode.removesuffix(PREPARED), chunk)
    pool_buffers = PoolBuffers(opt)
    prepare_s = 0.0
    if mode.endswith(PREPARED):
        t0 = time.perf_counter()
        opt.prepare_state_dict().result()
        prepare_s = time.perf_counter() - t0
    times, pin_waits, memory = [], [], {}
    for i in range(n):
        t0 = time.perf_counter()
        nbytes, peak = run_mode(opt, mode, device)
        times.append(time.perf_counter() - t0)
        pin_waits.append(wait_pinning(opt))  # not timed: as between two checkpoints
        gc.collect()
        if i + 1 in (2, n):
            memory[i + 1] = host_memory(pool_buffers)
    print(
        "FRESH "
        + json.dumps(
            dict(
                case=case,
                dtype=dtype_name,
                mode=mode,
                n=n,
                bytes=nbytes,
                peak_mib=peak / M,
                times=times,
                pin_waits=pin_waits,
                prepare_s=prepare_s,
                memory=memory,
            )
        ),
        flush=True,
    )


def run_fresh(case: str, dtype_name: str, args, mode: str, alloc_conf: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "scripts.bench_export", "--_fresh", mode, "--cases", case, "--dtypes", dtype_name]
    cmd += ["--fresh", str(args.fresh), "--backend", args.backend, "--device", str(args.device)]
    cmd += ["--chunk-mib", str(args.chunk_mib)]
    env = dict(os.environ)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("FRESH ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"fresh-process run failed ({out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(lines[-1].removeprefix("FRESH "))
    if alloc_conf:
        result["mode"] += f" ({alloc_conf})"
    return result


def environment(device: torch.device, backend: str) -> list[str]:
    lines = [
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, backend {backend}",
    ]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        try:
            driver = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                .stdout.strip()
                .splitlines()[0]
            )
        except Exception:  # noqa: BLE001
            driver = "unknown"
        lines.append(
            f"- GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver}, CUDA {torch.version.cuda}"
        )
    if backend == "te":
        import transformer_engine

        lines.append(f"- Transformer Engine {transformer_engine.__version__}")
    lines.append(f"- host: {platform.node()}, {os.cpu_count()} CPUs")
    return lines


def render(rows: list[dict], fresh: list[dict], bw: dict[str, float], env: list[str], argv: list[str]) -> str:
    out = [
        "# FusedAdam export benchmark",
        "",
        *env,
        f"- command: `python -m scripts.bench_export {' '.join(argv)}`",
        "",
    ]
    if bw:
        out += ["Device-to-host copy bandwidth (1 GiB, median of 5):", "", "| destination | GB/s |", "|---|---|"]
        out += [f"| {k} | {v:.1f} |" for k, v in bw.items()]
        out.append("")
    pinned = bw.get("pinned")

    def pct(gbps: float) -> str:
        return f"{100 * gbps / pinned:.0f}%" if pinned else "n/a"

    out += [
        "Time: median of the repeats; first: the warm-up (first export of that mode in this process); last: the "
        "last repeat. Chunked modes: the GPU peak bound is 2 x chunk.",
        "",
        "| case | params | state dtypes | mode | GPU peak (MiB) | <= 2 x chunk | time (ms) | first (ms) | "
        "last (ms) | exported (MiB) | GB/s | % of pinned | last GB/s | last % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = "" if r["chunk_mib"] is None else ("yes" if r["peak_mib"] <= 2 * r["chunk_mib"] else "**no**")
        out.append(
            f"| {r['case']} | {r['params'] / 1e6:.1f}M | {r['dtype']} | {r['mode']} | {r['peak_mib']:.1f} | {bound} | "
            f"{r['time_ms']:.1f} | {r['first_ms']:.1f} | {r['last_ms']:.1f} | {r['bytes'] / M:.0f} | "
            f"{r['gbps']:.2f} | {pct(r['gbps'])} | {r['last_gbps']:.2f} | {pct(r['last_gbps'])} |"
        )
    if fresh:
        out += [
            "",
            "Fresh processes: the first export of a new process, then the rest (released after each; the "
            "background pinning of released buffers is awaited between exports, untimed, and its wait reported); "
            "host memory (RSS; pinned bytes: torch's host allocator + registered by the pool) after the 2nd and "
            "the last export.",
            "",
            "| case | state dtypes | mode | exports | first GB/s | first % | last GB/s | last % | GPU peak (MiB) | "
            "prepare (s) | pin wait after 1st (s) | RSS after 2nd / last (MiB) | pinned after 2nd / last (MiB) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for f in fresh:
            first, last = f["bytes"] / f["times"][0] / 1e9, f["bytes"] / f["times"][-1] / 1e9
            m2, mn = f["memory"]["2"], f["memory"][str(f["n"])]
            out.append(
                f"| {f['case']} | {f['dtype']} | {f['mode']} | {f['n']} | {first:.2f} | {pct(first)} | {last:.2f} | "
                f"{pct(last)} | {f['peak_mib']:.1f} | {f.get('prepare_s', 0.0):.2f} | {f['pin_waits'][0]:.2f} | "
                f"{m2['rss'] / M:.0f} / {mn['rss'] / M:.0f} | "
                f"{m2['pinned'] / M:.0f} / {mn['pinned'] / M:.0f} |"
            )
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype_name in sorted({r["dtype"] for r in rows}):
        for mode, style in (("default", "o-"), ("offload", "s--"), ("chunked+reuse", "^:")):
            pts = sorted((r["params"], r["peak_mib"]) for r in rows if r["dtype"] == dtype_name and r["mode"] == mode)
            if pts:
                ax.plot([p / 1e6 for p, _ in pts], [max(m, 0.1) for _, m in pts], style, label=f"{dtype_name} {mode}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("GPU peak during state_dict() (MiB)")
    ax.set_title("FusedAdam export: GPU peak, default vs offload (per state, chunked)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(c for c in CASES if c != "1x1G"), help=f"of {','.join(CASES)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {','.join(DTYPES)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--repeats", type=cli_args.positive_int, default=5)
    ap.add_argument(
        "--chunk-mib", type=cli_args.positive_float, default=64.0, help="chunk budget of the chunked modes (MiB)"
    )
    ap.add_argument(
        "--fresh",
        type=cli_args.non_negative_int,
        default=0,
        help="also run N exports in a fresh process per chunked mode",
    )
    ap.add_argument(
        "--fresh-alloc-conf",
        default="pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
        help="with --fresh: one more chunked+reuse-alloc process under this PYTORCH_CUDA_ALLOC_CONF ('' skips it)",
    )
    ap.add_argument("--backend", choices=("te", "portable"), default="te")
    ap.add_argument("--device", type=cli_args.device, default="cuda")
    ap.add_argument("--out", type=cli_args.out_file, help="also write the markdown table here")
    ap.add_argument("--jsonl", type=cli_args.out_file, help="also append every row as JSON here")
    ap.add_argument("--png", type=cli_args.out_file, help="also plot GPU peak vs parameter count here")
    ap.add_argument("--_fresh", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, known, what in (
        (args.cases, CASES, "--cases"),
        (args.dtypes, DTYPES, "--dtypes"),
        (args.modes, MODES, "--modes"),
    ):
        bad = [x for x in name.split(",") if x not in known]
        if bad:
            ap.error(f"{what}: unknown {bad}; allowed: {','.join(known)}")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        ap.error(f"--png {args.png}: needs matplotlib (pip install matplotlib), or leave --png out")
    if args.backend == "te":
        cli_args.require_te(ap, "--backend te")
    try:
        ExportOptions(cpu_offload=True, chunk_bytes=int(args.chunk_mib * M))
    except ValueError as exc:
        ap.error(f"--chunk-mib {args.chunk_mib}: {exc}")
    if args.fresh == 1:
        ap.error("--fresh 1: a fresh process measures its first export against later ones; use 0 or >= 2")
    device = torch.device(args.device)
    chunk = int(args.chunk_mib * M)
    if args._fresh:
        fresh_process(args.cases, args.dtypes, args.backend, device, args._fresh, args.fresh, chunk)
        return
    bw = d2h_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    modes = args.modes.split(",")
    rows, fresh = [], []
    for case in args.cases.split(","):
        big = sum(torch.Size(s).numel() for s in CASES[case]) > 128 * M
        for dtype_name in args.dtypes.split(","):
            rows += bench_case(
                case, dtype_name, args.backend, device, min(args.repeats, 3) if big else args.repeats, modes, chunk
            )
            print(f"done {case} {dtype_name}", file=sys.stderr, flush=True)
            if args.fresh:
                fresh += [run_fresh(case, dtype_name, args, m) for m in modes if m in CHUNK_OPTIONS]
                if "chunked+reuse" in modes:
                    fresh.append(run_fresh(case, dtype_name, args, "chunked+reuse" + PREPARED))
                if args.fresh_alloc_conf and "chunked+reuse-alloc" in modes and device.type == "cuda":
                    fresh.append(run_fresh(case, dtype_name, args, "chunked+reuse-alloc", args.fresh_alloc_conf))
    text = render(rows, fresh, bw, environment(device, args.backend), argv)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.jsonl:
        args.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with open(args.jsonl, "a") as f:
            for r in [*rows, *({"fresh": True, **x} for x in fresh)]:
                f.write(json.dumps({**r, "pinned_gbps": bw.get("pinned")}) + "\n")
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.png)


if __name__ == "__main__":
    main()
