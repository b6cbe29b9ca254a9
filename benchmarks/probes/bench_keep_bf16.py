"""BF16 states kept as BF16 against the FP32 export, in one run: bytes, export, save and load times.

    python -m benchmarks.probes.bench_keep_bf16 --out DIR                 # CUDA + TE (optim_factory.FusedAdam)
    python -m benchmarks.probes.bench_keep_bf16 --backend portable --numel 1M --tensors 4 --out DIR   # CPU smoke run

The optimizer: BF16 parameters, FP32 master weights, BF16 moments (the low-memory preset without remainders),
exported chunked into reused host buffers (the recipe's path), prepared before the first export. Each variant
is measured ``--repeats`` times (median): ``state_dict()`` (export), a synchronous ``dcp.save`` to local disk,
``dcp.load`` into the export's own template plus ``load_state_dict``. Bytes are the exported tensors' bytes and
the checkpoint's size on disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from scripts import cli_args

VARIANTS = {"fp32 export": False, "bf16 kept": True}


def _size(text: str) -> int:
    """``--numel``: a positive count with an optional K/M/G suffix (0 or 1X: argparse's error line)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        n = int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive count (e.g. 4M, 65536)")
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for st in sd["state"].values() for v in st.values())


def build(backend: str, tensors: int, numel: int, device: torch.device, keep: bool):
    if backend == "te":
        from optim_factory import FusedAdam as cls
    else:
        from optim_factory import PortableFusedAdam as cls
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen).to(device, torch.bfloat16)) for _ in range(tensors)]
    opt = cls(
        params,
        lr=1e-3,
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=64 << 20,
        state_dict_offload_reuse_buffers=True,
        state_dict_keep_bf16=keep,
    )
    for p in params:
        p.grad = torch.randn(numel, generator=gen).to(device, torch.bfloat16)
    opt.step()
    return opt


def measure(opt, root: Path, repeats: int, device: torch.device) -> dict:
    keep = opt.state_dict_keep_bf16
    opt.prepare_state_dict().result()
    export_s, save_s, load_s, disk = [], [], [], 0
    for i in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        sd = opt.state_dict()
        _sync(device)
        export_s.append(time.perf_counter() - t0)
        nbytes = _state_bytes(sd)
        path = root / f"{'bf16' if keep else 'fp32'}-{i}"
        t0 = time.perf_counter()
        dcp.save({"optim": sd}, checkpoint_id=str(path))
        save_s.append(time.perf_counter() - t0)
        disk = sum(f.stat().st_size for f in path.iterdir())
        opt.release_state_dict(sd)
        template = {"optim": opt.state_dict()}  # the export's own layout (dtypes included)
        t0 = time.perf_counter()
        dcp.load(template, checkpoint_id=str(path))
        opt.load_state_dict(template["optim"])
        _sync(device)
        load_s.append(time.perf_counter() - t0)
        opt.release_state_dict(template["optim"])
        shutil.rmtree(path)
    med = statistics.median
    return dict(
        export_bytes=nbytes,
        disk_bytes=disk,
        export_s=med(export_s),
        save_s=med(save_s),
        load_s=med(load_s),
        export_gbps=nbytes / med(export_s) / 1e9,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["te", "portable"], default="te")
    ap.add_argument("--tensors", type=cli_args.positive_int, default=64)
    ap.add_argument("--numel", type=_size, default="4M", help="elements per parameter (K/M/G suffixes)")
    ap.add_argument("--repeats", type=cli_args.positive_int, default=3)
    ap.add_argument("--out", type=cli_args.out_dir, required=True, help="folder for bench_keep_bf16.md and .jsonl")
    ap.add_argument(
        "--scratch", type=cli_args.out_dir, default=None, help="where checkpoints are written (default: a temp dir)"
    )
    args = ap.parse_args()
    if args.backend == "te":
        cli_args.require_te(ap, "--backend te")
    device = torch.device("cuda" if args.backend == "te" or torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        for name, keep in VARIANTS.items():
            opt = build(args.backend, args.tensors, args.numel, device, keep)  # the same states each time
            rows[name] = measure(opt, Path(tmp), args.repeats, device)
            opt.state_exporter.close()
    fp32 = rows["fp32 export"]
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    lines = [
        f"# BF16 kept vs FP32 export ({time.strftime('%Y-%m-%d')}, {hardware}, torch {torch.__version__}, "
        f"backend {args.backend})",
        "",
        f"{args.tensors} x {args.numel} BF16 parameters, FP32 master, BF16 moments; chunked 64 MiB + reuse, prepared; "
        f"median of {args.repeats}. Ratios are against the FP32 export of the same run.",
        "",
        "| variant | exported MB | on disk MB | export s | save s | load s | export GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        ratio = {k: r[k] / fp32[k] for k in ("export_bytes", "disk_bytes", "export_s", "save_s", "load_s")}
        lines.append(
            f"| {name} | {r['export_bytes'] / 1e6:.0f} ({ratio['export_bytes']:.2f}x) | {r['disk_bytes'] / 1e6:.0f} "
            f"({ratio['disk_bytes']:.2f}x) | {r['export_s']:.3f} ({ratio['export_s']:.2f}x) | {r['save_s']:.3f} "
            f"({ratio['save_s']:.2f}x) | {r['load_s']:.3f} ({ratio['load_s']:.2f}x) | {r['export_gbps']:.1f} |"
        )
    (out / "bench_keep_bf16.md").write_text("\n".join(lines) + "\n")
    with open(out / "bench_keep_bf16.jsonl", "w") as f:
        for name, r in rows.items():
            f.write(json.dumps({"variant": name, "backend": args.backend, **r}) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
