"""What host memory costs on this machine: the numbers behind the streaming export's design choices.

    python -m benchmarks.probes.probe_host_memory [--gib 2]     # CUDA machine; prints a markdown table
    python -m benchmarks.probes.probe_host_memory --stall [--backend te]   # training steps during background pinning

In one fresh process, for --gib GiB: first touch of fresh pageable memory (4 KiB pages vs transparent huge
pages, torch's parallel fill), host memcpy into fresh and into reused memory, pinning by allocation
(cudaHostAlloc through torch's host allocator) and by registration of touched memory (cudaHostRegister), and
device-to-host copies into pinned and registered memory. Each figure is one timed run (GB/s of --gib GiB).

--stall answers whether the export's background work slows training: the time of optimizer steps (the
bench's 64x4M case, BF16 moments: 268M parameters, 2 GiB of exported FP32 state) alone, while
``prepare_state_dict()`` allocates, first-touches and pins the export buffers on its thread, and while the
buffers of a released export are pinned in place (``cudaHostRegister``) on that thread.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from optim_factory.optimizers.export import host_empty
from scripts import cli_args
from scripts.bench_export import M, build, sync


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def sysfs(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "n/a"


def step_times(opt, params, grads, until, device: torch.device) -> list[float]:
    """Seconds of each optimizer step (launch to completion) until ``until(steps done)`` is true."""
    out: list[float] = []
    while not until(len(out)):
        t0 = time.perf_counter()
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def stall(backend: str, device: torch.device) -> None:
    row = "| {} | {} | {:.2f} | {:.2f} | {:.2f} | {} |"
    print(f"- torch {torch.__version__}, backend {backend}, case 64x4M (BF16 moments), 64 MiB chunks, reuse on")
    print()
    print("| optimizer steps | steps | median (ms) | p90 (ms) | max (ms) | background work (s) |")
    print("|---|---|---|---|---|---|")
    params, opt = build("64x4M", "bf16", backend, device, "chunked+reuse", 64 * M)
    grads = [torch.randn_like(p) for p in params]

    def report(name: str, times: list[float], seconds: float | None) -> None:
        ms = sorted(t * 1e3 for t in times)
        if not ms:
            print(f"| {name} | 0 | - | - | - | {seconds:.2f} |")
            return
        p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
        print(row.format(name, len(ms), ms[len(ms) // 2], p90, ms[-1], "-" if seconds is None else f"{seconds:.2f}"))

    step_times(opt, params, grads, lambda n: n >= 10, device)  # warm-up
    report("alone", step_times(opt, params, grads, lambda n: n >= 50, device), None)
    t0 = time.perf_counter()
    preparing = opt.prepare_state_dict()
    times = step_times(opt, params, grads, lambda n: preparing.done(), device)
    report("during prepare_state_dict() (allocate, first touch, pin)", times, time.perf_counter() - t0)
    sd = opt.state_dict()  # into the prepared buffers
    opt.release_state_dict(sd)
    del sd
    # a second optimizer without preparation: its first export fills fresh buffers, released ones get pinned
    params2, opt2 = build("64x4M", "bf16", backend, device, "chunked+reuse", 64 * M)
    sd = opt2.state_dict()
    t0 = time.perf_counter()
    opt2.release_state_dict(sd)
    pinning = opt2.state_exporter.pool.prepare([])  # done once the pool's thread has pinned the released buffers
    times = step_times(opt, params, grads, lambda n: pinning.done(), device)
    report("during the pinning of a released export (cudaHostRegister)", times, time.perf_counter() - t0)
    report("alone, after", step_times(opt, params, grads, lambda n: n >= 50, device), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=cli_args.positive_float, help="the table's size (default 2; not with --stall)")
    ap.add_argument("--stall", action="store_true", help="measure optimizer steps during background pinning")
    ap.add_argument("--backend", choices=("te", "portable"), help="with --stall (default portable)")
    ap.add_argument("--device", type=cli_args.device, help="with --stall (default cuda; cpu: a smoke run)")
    args = ap.parse_args()
    if args.stall:  # --gib goes with the table only (--stall is a fixed case), --device and --backend with --stall
        if args.gib is not None:
            ap.error("--gib sizes the table; --stall measures the fixed 64x4M case: leave one out")
        if args.backend == "te":
            cli_args.require_te(ap, "--backend te")
        stall(args.backend or "portable", args.device or cli_args.device("cuda"))
        return
    if args.backend is not None or args.device is not None:
        ap.error("--backend and --device go with --stall; the table always runs on cuda")
    if not torch.cuda.is_available():
        ap.error(f"the table needs a CUDA device (this torch, {torch.__version__}, sees none)")
    n = int((args.gib or 2.0) * 2**30)
    gb = n / 1e9
    torch.cuda.init()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(7)
    rows: list[tuple[str, float]] = []

    def rate(name: str, seconds: float) -> None:
        rows.append((name, gb / seconds))

    plain = torch.empty(n, dtype=torch.uint8)
    rate("first touch, 4 KiB pages (parallel fill_)", timed(lambda: plain.fill_(1)))
    huge = host_empty(torch.Size([n]), torch.uint8)
    rate("first touch, huge pages advised (parallel fill_)", timed(lambda: huge.fill_(1)))
    fresh = torch.empty(n, dtype=torch.uint8)
    rate("memcpy into fresh memory, 4 KiB pages", timed(lambda: fresh.copy_(plain)))
    fresh_huge = host_empty(torch.Size([n]), torch.uint8)
    rate("memcpy into fresh memory, huge pages advised", timed(lambda: fresh_huge.copy_(plain)))
    rate("memcpy into reused memory", timed(lambda: fresh.copy_(huge)))
    rate("D2H into reused pageable memory", timed(lambda: fresh.copy_(dev)))
    cudart = torch.cuda.cudart()
    register_s = timed(lambda: cudart.cudaHostRegister(huge.data_ptr(), n, 0))
    rate("cudaHostRegister of touched memory (pinning in place)", register_s)
    rate("D2H into registered memory", timed(lambda: huge.copy_(dev, non_blocking=True)))
    rate("cudaHostUnregister", timed(lambda: cudart.cudaHostUnregister(huge.data_ptr())))
    pinned_holder: list[torch.Tensor] = []
    rate(
        "cudaHostAlloc (torch.empty(pin_memory=True))",
        timed(lambda: pinned_holder.append(torch.empty(n, dtype=torch.uint8, pin_memory=True))),
    )
    pinned = pinned_holder[0]
    rate("D2H into pinned memory (first)", timed(lambda: pinned.copy_(dev, non_blocking=True)))
    rate("D2H into pinned memory (again)", timed(lambda: pinned.copy_(dev, non_blocking=True)))

    print(
        f"- transparent huge pages: enabled `{sysfs('/sys/kernel/mm/transparent_hugepage/enabled')}`, "
        f"defrag `{sysfs('/sys/kernel/mm/transparent_hugepage/defrag')}`"
    )
    print(f"- torch {torch.__version__}, intra-op threads {torch.get_num_threads()}, {args_gib(n)} GiB per figure")
    print()
    print("| operation | GB/s |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |")


def args_gib(n: int) -> str:
    return f"{n / 2**30:g}"


if __name__ == "__main__":
    main()
