"""Benchmark FusedAdam checkpoint export: GPU peak and time of state_dict() per mode, vs. the host link.

    python scripts/bench_export.py                          # all cases, TE backend, prints a markdown table
    python scripts/bench_export.py --cases 8x4M --dtypes bf16 --repeats 3 --out results.md --png peak.png
    python scripts/bench_export.py --backend portable --device cpu --cases 1x1M --repeats 1   # smoke test

Modes:
  default       TE's FusedAdam.state_dict(): every state converted to FP32 on the GPU, all kept until it returns
  default+cpu   the same, then every tensor copied to CPU (what DCP's StateDictOptions(cpu_offload=True) does)
  offload       state_dict_cpu_offload=True: one state converted, copied to CPU and dropped at a time

GPU peak is torch.cuda.max_memory_allocated() above the level before the call (the largest of the repeats);
time is the median of --repeats runs after one warm-up; GB/s counts the FP32 bytes exported. In the same run
the device-to-host copy bandwidth is measured into pinned memory, fresh pageable memory and reused pageable
memory (1 GiB, median of 5), and each export's GB/s is reported against the pinned figure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes.checkpoint import state_bytes  # noqa: E402

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
MODES = ("default", "default+cpu", "offload")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2h_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """GB/s of a device-to-host copy into pinned, fresh pageable and reused pageable memory."""
    if device.type != "cuda":
        return {}
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
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
    }
    return out


def build(case: str, dtype_name: str, backend: str, device: torch.device):
    param_dtype, kw = DTYPES[dtype_name]
    if backend == "te":
        from optim_factory import FusedAdam as cls
    else:
        from optim_factory import PortableFusedAdam as cls
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen).to(param_dtype)) for s in CASES[case]]
    opt = cls(params, lr=1e-3, **kw)
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen).to(param_dtype)
    opt.step()
    for p in params:
        p.grad = None
    return params, opt


def run_mode(opt, mode: str, device: torch.device) -> tuple[int, int]:
    """One export in ``mode``; returns (exported bytes, GPU peak bytes above the level before)."""
    opt.state_dict_cpu_offload = mode == "offload"
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
    del sd
    return nbytes, peak


def bench_case(case: str, dtype_name: str, backend: str, device: torch.device, repeats: int) -> list[dict]:
    params, opt = build(case, dtype_name, backend, device)
    n_params = sum(p.numel() for p in params)
    rows = []
    for mode in MODES:
        run_mode(opt, mode, device)  # warm-up
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
                peak_mib=max(peaks) / M,
                time_ms=t * 1e3,
                bytes=nbytes,
                gbps=nbytes / t / 1e9,
            )
        )
    del params, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


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


def render(rows: list[dict], bw: dict[str, float], env: list[str], argv: list[str]) -> str:
    out = [
        "# FusedAdam export benchmark",
        "",
        *env,
        f"- command: `python scripts/bench_export.py {' '.join(argv)}`",
        "",
    ]
    if bw:
        out += ["Device-to-host copy bandwidth (1 GiB, median of 5):", "", "| destination | GB/s |", "|---|---|"]
        out += [f"| {k} | {v:.1f} |" for k, v in bw.items()]
        out.append("")
    pinned = bw.get("pinned")
    out += [
        "| case | params | state dtypes | mode | GPU peak (MiB) | time (ms) | exported (MiB) | GB/s | % of pinned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pct = f"{100 * r['gbps'] / pinned:.0f}%" if pinned else "n/a"
        out.append(
            f"| {r['case']} | {r['params'] / 1e6:.1f}M | {r['dtype']} | {r['mode']} | {r['peak_mib']:.1f} | "
            f"{r['time_ms']:.1f} | {r['bytes'] / M:.0f} | {r['gbps']:.2f} | {pct} |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype_name in sorted({r["dtype"] for r in rows}):
        for mode, style in (("default", "o-"), ("offload", "s--")):
            pts = sorted((r["params"], r["peak_mib"]) for r in rows if r["dtype"] == dtype_name and r["mode"] == mode)
            if pts:
                ax.plot([p / 1e6 for p, _ in pts], [max(m, 0.1) for _, m in pts], style, label=f"{dtype_name} {mode}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("GPU peak during state_dict() (MiB)")
    ax.set_title("FusedAdam export: GPU peak, default vs state_dict_cpu_offload")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {','.join(DTYPES)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", choices=("te", "portable"), default="te")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--png", help="also plot GPU peak vs parameter count here")
    args = ap.parse_args(argv)
    for name, known, what in ((args.cases, CASES, "--cases"), (args.dtypes, DTYPES, "--dtypes")):
        bad = [x for x in name.split(",") if x not in known]
        if bad:
            ap.error(f"{what}: unknown {bad}; allowed: {','.join(known)}")
    device = torch.device(args.device)
    bw = d2h_bandwidth(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for case in args.cases.split(","):
        big = sum(torch.Size(s).numel() for s in CASES[case]) > 128 * M
        for dtype_name in args.dtypes.split(","):
            rows += bench_case(case, dtype_name, args.backend, device, min(args.repeats, 3) if big else args.repeats)
            print(f"done {case} {dtype_name}", file=sys.stderr, flush=True)
    text = render(rows, bw, environment(device, args.backend), argv)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
