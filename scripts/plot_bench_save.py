"""A PNG from ``scripts/bench_save.py``'s JSON lines: per mode, the training loop's blocking time per checkpoint,
the time until the checkpoint is complete on disk, and the GPU peak at the save (medians of the measured checkpoints).

    python -m scripts.plot_bench_save DIR/bench_save.jsonl --out DIR/bench_save.png    # needs matplotlib
    python -m scripts.plot_bench_save A.jsonl B.jsonl --budget --out budget.png      # loss against the budget

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


def budget_points(runs: list[tuple[dict, list[dict]]]) -> dict[float, dict]:
    """Per FP32 state (GB): the bytes written W, the budgeted modes' (budget, loss) and the loss without a budget
    (``f-titan-ours``, the last run's), from runs of the same model; the stream's rate: W over the two-chunk mode's
    loss."""
    out: dict[float, dict] = {}
    for meta, rows in runs:
        state = round(meta["fp32_state_gb"], 2)
        point = out.setdefault(state, {"W": meta["fp32_state_gb"] * 1e9 + meta["model_bytes"], "budgets": {}})
        for name, s in summarize(rows).items():
            if s.get("budget_bytes") is not None:  # the modes that record their budget (torchtitan's path)
                point["budgets"][name.rsplit("-", 1)[1]] = (s["budget_bytes"], s["lost_s"])
            elif name == "f-titan-ours":
                point["unbudgeted"] = s["lost_s"]
    for point in out.values():
        least = point["budgets"].get("min")
        point["rate"] = point["W"] / least[1] if least else None
    return out


def plot_budget(runs: list[tuple[dict, list[dict]]], out: Path) -> None:
    """The loss to the loop per checkpoint against the host budget, per state, beside (W - B) / the stream's rate
    and the loss without a budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for (state, point), color in zip(sorted(budget_points(runs).items()), ("tab:blue", "tab:orange", "tab:green")):
        measured = sorted(point["budgets"].values())
        ax.plot([b / 1e9 for b, _ in measured], [s for _, s in measured], "o-", color=color, label=f"{state} GB state")
        if point["rate"]:
            bs = [b for b, _ in measured]
            ax.plot([b / 1e9 for b in bs], [max(0.0, point["W"] - b) / point["rate"] for b in bs], ":", color=color,
                    label=f"(W - B) / {point['rate'] / 1e9:.2f} GB/s")  # fmt: skip
        if "unbudgeted" in point:
            ax.axhline(point["unbudgeted"], color=color, linestyle="--", linewidth=1,
                       label=f"no budget ({point['unbudgeted']:.2f} s)")  # fmt: skip
    ax.set_xlabel("host budget B (GB)")
    ax.set_ylabel("lost to the loop per checkpoint (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", type=cli_args.in_file, nargs="+")
    ap.add_argument("--budget", action="store_true", help="the budgeted modes' loss against the budget (any runs)")
    ap.add_argument("--out", type=cli_args.out_file, default=None, help="PNG path (default: next to the JSON lines)")
    args = ap.parse_args(argv)
    runs = [read(path) for path in args.jsonl]
    out = args.out or args.jsonl[0].with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.budget:
        plot_budget(runs, out)
    elif len(runs) == 1:
        plot(*runs[0], out)
    else:
        ap.error("several JSON lines files: only with --budget")
    print(out)


if __name__ == "__main__":
    main()
