"""What signing checkpoints costs (``checkpoint.key_env``: HMAC-SHA256 of every file and a MAC of the manifest)
against the XXH3 checksums alone, on a save and on the verification before a load, measured in one run side by side.

    python -m scripts.bench_trust --gb 1 --repeats 3 --scratch DIR --out DIR

Two states: the default job's first checkpoint (the recipe trained one step with ``checkpoint.every_steps=1``,
read back: the same tensors and items a save of it writes) and ``--gb`` GB of FP32 tensors of 64 MiB. For each,
repeat by repeat, a save through the recipe's writer (``ChecksumFileSystemWriter``, one thread, files fsynced)
without and with a key, and a verification of every file (``file_problem``, the loader's check: XXH3, or the keyed
digest with a key) read back from the page cache. Each row is the median over ``--repeats``; the ratio is keyed
over XXH3. After each save, a load of it through DCP's own reader and planner and through the safe pair
(``SafeFileSystemReader``, ``SafeLoadPlanner``: ``.metadata`` allow-listed and read twice, the items checked
first), alternating which goes first. Writes ``bench_trust.md`` and ``bench_trust.jsonl`` into ``--out``.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from scripts import cli_args
from scripts.bench_export import write_results
from scripts.bench_write import synthetic_state

KEY = b"a key of the benchmark's"


def default_job_state(scratch: Path) -> dict:
    """The default job's first checkpoint, read back as the flat state a save writes."""
    from recipes.checkpoint import read_checkpoint
    from recipes.job import train
    from recipes.train import compose_config

    run_dir = scratch / "default-job"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        "trainer.max_steps=1",
        "trainer.warmup_steps=0",
        "checkpoint.every_steps=1",
        "trainer.progress=false",
        "trainer.eval_every=0",
    ]
    train(compose_config([*overrides, f"run_dir={run_dir}"]))
    state = read_checkpoint(run_dir / "checkpoints" / "step_00000001")
    shutil.rmtree(run_dir)
    return state


def load_seconds(state: dict, path: Path, safe: bool) -> float:
    """Seconds of one ``dcp.load`` of the checkpoint ``path`` into a template of ``state`` (zeros, placeholders):
    through DCP's ``FileSystemReader`` and ``DefaultLoadPlanner``, or (``safe``) ``SafeFileSystemReader`` and
    ``SafeLoadPlanner``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    from optim_factory.checkpoint import SafeFileSystemReader, SafeLoadPlanner

    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    t0 = time.perf_counter()
    reader = SafeFileSystemReader(str(path)) if safe else FileSystemReader(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            template, storage_reader=reader, planner=SafeLoadPlanner() if safe else DefaultLoadPlanner(), no_dist=True
        )
    return time.perf_counter() - t0


def save_and_verify(state: dict, path: Path, key: bytes | None) -> tuple[float, float, int, float, float]:
    """(save seconds, verify seconds, bytes, DCP's load seconds, the safe load's seconds) of one save of ``state``
    into ``path``, the check of its files and its load through DCP's reader and through the safe one (alternating
    which goes first)."""
    import torch.distributed.checkpoint as dcp

    from recipes.checkpoint.checksums import ChecksumFileSystemWriter, file_problem

    shutil.rmtree(path, ignore_errors=True)
    writer = ChecksumFileSystemWriter(path, key=key, thread_count=1)
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer)
    save_s = time.perf_counter() - t0
    records = writer.checksums()
    t0 = time.perf_counter()
    problems = [file_problem(path, name, record, key) for name, record in sorted(records.items())]
    verify_s = time.perf_counter() - t0
    assert not any(problems), problems
    written = sum(int(r["size"]) for r in records.values())
    first_safe = key is not None  # the two modes' saves alternate which load reads first
    loads = {
        first_safe: load_seconds(state, path, first_safe),
        not first_safe: load_seconds(state, path, not first_safe),
    }
    shutil.rmtree(path)
    return save_s, verify_s, written, loads[False], loads[True]


def measure(states: dict[str, dict], scratch: Path, repeats: int) -> list[dict]:
    times: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for _ in range(repeats):  # the modes interleaved, repeat by repeat: a drifting machine moves both alike
        for name, state in states.items():
            for mode, key in (("xxh3", None), ("keyed", KEY)):
                times.setdefault((name, mode), []).append(save_and_verify(state, scratch / "checkpoint", key))
    rows = []
    for (name, mode), runs in times.items():
        rows.append(
            {
                "state": name,
                "mode": mode,
                "bytes": runs[0][2],
                "save_s": statistics.median(r[0] for r in runs),
                "verify_s": statistics.median(r[1] for r in runs),
                "load_dcp_s": statistics.median(r[3] for r in runs),
                "load_safe_s": statistics.median(r[4] for r in runs),
            }
        )
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| state | bytes | save, XXH3 (s) | save, keyed (s) | ratio | verify, XXH3 (s) | verify, keyed (s) | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["state"], r["mode"]): r for r in rows}
    for state in dict.fromkeys(r["state"] for r in rows):
        plain, keyed = by[(state, "xxh3")], by[(state, "keyed")]
        lines.append(
            f"| {state} | {plain['bytes']:,} | {plain['save_s']:.4f} | {keyed['save_s']:.4f} | "
            f"{keyed['save_s'] / plain['save_s']:.2f}x | {plain['verify_s']:.4f} | {keyed['verify_s']:.4f} | "
            f"{keyed['verify_s'] / plain['verify_s']:.2f}x |"
        )
    lines += [
        "",
        "| state | load, DCP's reader and planner (s) | load, SafeFileSystemReader and SafeLoadPlanner (s) | ratio |",
    ]
    lines.append("|---|---|---|---|")
    for state in dict.fromkeys(r["state"] for r in rows):
        runs = [r for r in rows if r["state"] == state]
        dcp_s = statistics.median(r["load_dcp_s"] for r in runs)
        safe_s = statistics.median(r["load_safe_s"] for r in runs)
        lines.append(f"| {state} | {dcp_s:.4f} | {safe_s:.4f} | {safe_s / dcp_s:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=cli_args.positive_float, default=1.0, help="the synthetic state's size (GB)")
    ap.add_argument("--repeats", type=cli_args.positive_int, default=3)
    ap.add_argument("--scratch", type=cli_args.out_dir, required=True, help="where the checkpoints are written")
    ap.add_argument("--out", type=cli_args.out_dir, required=True)
    args = ap.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    states = {"default job": default_job_state(args.scratch), f"{args.gb:g} GB": synthetic_state(args.gb, 64)}
    rows = measure(states, args.scratch, args.repeats)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "command": "python -m scripts.bench_trust " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    head = f"# Signed checkpoints against XXH3 ({meta['date']}, torch {meta['torch']}, {meta['command']})\n\n"
    write_results(args.out, "bench_trust", meta, rows, head + "\n".join(table(rows)) + "\n")


if __name__ == "__main__":
    main()
