"""What host memory costs on this machine: the numbers behind the streaming export's design choices.

    python scripts/probe_host_memory.py [--gib 2]     # CUDA machine; prints a markdown table

In one fresh process, for --gib GiB: first touch of fresh pageable memory (4 KiB pages vs transparent huge
pages, torch's parallel fill), host memcpy into fresh and into reused memory, pinning by allocation
(cudaHostAlloc through torch's host allocator) and by registration of touched memory (cudaHostRegister), and
device-to-host copies into pinned and registered memory. Each figure is one timed run (GB/s of --gib GiB).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from optim_factory.optimizers.export import host_empty  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=2.0)
    n = int(ap.parse_args().gib * 2**30)
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
