"""A PNG from ``scripts/bench_save.py``'s JSON lines: per mode, the training loop's blocking time per checkpoint,
the time until the checkpoint is complete on disk, and the GPU peak at the save (medians of the measured checkpoints).

    python -m scripts.plot_bench_save DIR/bench_save.jsonl --out DIR/bench_save.png    # needs matplotlib

matplotlib is the ``plot`` extra (``pip install -e .[plot]``), not a runtime dependency.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts import cli_args
from scripts.bench_save import read, summarize

PANELS = (  # summary key, axis label, divisor
    ("block_s", "training blocked per checkpoint (s)", 1),
    ("lost_s", "lost to the loop: blocked + slower next 3 steps (s)", 1),
    ("complete_s", "until complete on disk (s, upper bound)", 1),
    ("gpu_peak_at_save_mib", "GPU peak above the step boundary (MiB)", 1),
    ("disk_bytes", "checkpoint on disk (GB)", 1e9),
)


def plot(meta: dict, rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(rows)
    names = list(summary)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4.2))
    for ax, (key, label, scale) in zip(axes, PANELS):
        values = [summary[n].get(key) for n in names]
        ax.barh(names, [0 if v is None else v / scale for v in values], color="tab:blue")
        for i, v in enumerate(values):
            text = "n/a" if v is None else f"{v / scale:.3g}"
            ax.annotate(
                text,
                (0 if v is None else v / scale, i),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        ax.set_xlabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    step = summary.get("a-te-async-pinned", {}).get("step_before_s")
    if step is not None:
        axes[0].axvline(step, color="tab:red", linestyle="--", linewidth=1, label=f"one training step ({step:.3f} s)")
        axes[0].legend(fontsize=7)
    title = f"Save path per checkpoint: {meta.get('optimizer', '?')}, {meta.get('world', '?')} rank(s), "
    title += f"{meta.get('fp32_state_gb', 0):.2f} GB FP32-equivalent optimizer state per rank"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", type=cli_args.in_file)
    ap.add_argument("--out", type=cli_args.out_file, default=None, help="PNG path (default: next to the JSON lines)")
    args = ap.parse_args(argv)
    meta, rows = read(args.jsonl)
    out = args.out or args.jsonl.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(meta, rows, out)
    print(out)


if __name__ == "__main__":
    main()
