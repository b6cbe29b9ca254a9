"""What a run writes as it trains: ``metrics.jsonl`` (:class:`MetricsWriter`), ``train.log`` and the console
(:func:`setup_logging`), and the per-step lines (:class:`StepLog`)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recipes.checkpoint import ExportReport
from recipes.progress import ConsoleHandler
from recipes.step import StepResult

log = logging.getLogger("recipes.train")  # the training loop's lines: recipes/job.py logs through this logger too

FILE_ONLY = "file_only"  # a log record's attribute (``extra``): train.log only, not the console


class MetricsWriter:
    """Appends JSON lines to ``<run_dir>/metrics.jsonl`` (rank 0 only)."""

    def __init__(self, run_dir: str, rank: int):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = rank == 0
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def checkpoint(self, report: ExportReport) -> None:
        self.write({"kind": "checkpoint", **report.record()})

    def summary(self, summary: dict[str, Any], *, trained: bool) -> None:
        """Append ``summary`` as the run's last record. A launch that trained no step (a relaunch of a finished
        run) keeps the last summary record instead where it ends at this launch's step: the run's losses and
        evaluation, which this launch has none of."""
        last = self.last_summary() if self.enabled and not trained else None
        if last is None or last.get("end_step") != summary["end_step"]:
            self.write({"kind": "summary", **summary})

    def last_summary(self) -> dict[str, Any] | None:
        """The last ``summary`` record of ``metrics.jsonl`` (without ``kind``), or None."""
        if not self.path.is_file():
            return None
        for line in reversed(self.path.read_text().splitlines()):
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by a killed launch
                continue
            if isinstance(record, dict) and record.get("kind") == "summary":
                return {k: v for k, v in record.items() if k != "kind"}
        return None


_HANDLERS: set[logging.Handler] = set()  # the handlers this module added to the root logger


def setup_logging(rank: int, run_dir: str) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    root = logging.getLogger()
    root.setLevel(level)
    for h in list(root.handlers):
        if h in _HANDLERS:  # ours from an earlier run in this process; leave others' handlers
            root.removeHandler(h)
            h.close()
    fmt = logging.Formatter(f"[%(asctime)s][rank{rank}][%(name)s][%(levelname)s] %(message)s", "%H:%M:%S")
    console = ConsoleHandler()
    console.setFormatter(fmt)
    console.addFilter(lambda record: not getattr(record, FILE_ONLY, False))
    _HANDLERS.add(console)
    root.addHandler(console)
    if rank == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(Path(run_dir) / "train.log")
        fh.setFormatter(fmt)
        _HANDLERS.add(fh)
        root.addHandler(fh)


def eval_text(ev: dict[str, Any]) -> str:
    held = "held-out sums" if "accuracy" in ev else "held-out windows"
    acc = f"accuracy {ev['accuracy']:.3f} " if "accuracy" in ev else ""
    loss = "answer loss" if "accuracy" in ev else "loss"
    return f"step {ev['step']}: {acc}{loss} {ev['eval_loss']:.4f} ({ev['eval_examples']} {held}, {ev['eval_s']:.2f} s)"


def done_text(summary: dict[str, Any], metrics: Path, checkpoint_dir: str | None, limit: str) -> str:
    """The run's last line, for a person: steps and loss, the last evaluation, the checkpoints a resume can use
    (rank 0's ``kept_checkpoints``; ``checkpoint_dir`` None: checkpoints off), how to go on (``limit``: the key
    whose value ended the run, ``trainer.max_steps`` or ``trainer.stop_at``), and where the whole summary is
    (``metrics``: its last record)."""
    end = summary["end_step"]
    parts = [f"steps {summary['start_step']}-{end}"]
    if summary["first_loss"] is not None:
        parts[0] += f", loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
    if summary["eval"]:
        ev = summary["eval"]
        acc = f"accuracy {ev['accuracy']:.3f}" if "accuracy" in ev else f"eval loss {ev['eval_loss']:.4f}"
        parts.append(f"{acc} at step {ev['step']}")
    kept = summary["kept_checkpoints"] or []
    if checkpoint_dir is None:
        parts.append("no checkpoints (checkpoint.enabled=false)")
    else:
        newest = f", newest {Path(kept[-1]).name}" if kept else ""
        parts.append(f"{len(kept)} checkpoint(s) in {checkpoint_dir}{newest}")
    if summary["stopped_at"] is not None:
        resumes = f": the same command resumes at step {end}" if checkpoint_dir is not None else ""
        parts.append(f"stopped by {summary['stopped_by']}{resumes}")
    elif kept:
        parts.append(f"to train on: the same command with {limit} above {end}")
    return f"done: {'; '.join(parts)} (the summary: the last record of {metrics})"


def eval_postfix(ev: dict[str, Any]) -> dict[str, str]:
    out = {"eval_loss": f"{ev['eval_loss']:.3f}"}
    if "accuracy" in ev:
        out["acc"] = f"{ev['accuracy']:.3f}"
    return out


class StepLog:
    """The loop's per-step bookkeeping: at the first step, every ``log_every`` steps and the last, the loss
    averaged over ranks (one all-reduce), tokens/s since the last log line, a metrics line, a log line and the
    progress bar's postfix."""

    def __init__(self, metrics: MetricsWriter, bar, *, world: int, start: int, end: int, max_steps: int, every: int):
        self.metrics, self.bar, self.world = metrics, bar, world
        self.start, self.end, self.max_steps, self.every = start, end, max_steps, every
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.postfix: dict[str, str] = {}
        self.tokens_since, self.t_since = 0, time.perf_counter()

    def __call__(self, done: int, result: StepResult) -> None:
        self.tokens_since += result.tokens
        if not (done == self.start + 1 or done % self.every == 0 or done == self.end):
            return
        value = result.loss.detach().float()
        if self.world > 1:
            dist.all_reduce(value)  # SUM: gloo has no AVG
            value = value / self.world
        self.last_loss = float(value)
        self.first_loss = self.last_loss if self.first_loss is None else self.first_loss
        elapsed = time.perf_counter() - self.t_since
        tps = self.tokens_since / elapsed if elapsed > 0 else 0.0
        self.metrics.write(
            {"kind": "train", "step": done, "loss": self.last_loss, "lr": result.lr, "tokens_per_s": tps}
        )
        log.info("step %d/%d loss %.4f lr %.3g tokens/s %.0f", done, self.max_steps, self.last_loss, result.lr, tps)
        self.postfix["loss"] = f"{self.last_loss:.3f}"
        self.bar.set_postfix(**self.postfix)
        self.tokens_since, self.t_since = 0, time.perf_counter()
