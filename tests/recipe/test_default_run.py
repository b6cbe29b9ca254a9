"""The README's first command: the default job (the schema's steps on the embedded addition task) as a process."""

from __future__ import annotations

import pytest

from recipes.checkpoint import is_complete
from recipes.config import TrainerConfig
from recipes.job import train
from recipes.train import compose_config
from scripts.readme_figures import figures
from tests.recipe.runs import metrics, run_cli


@pytest.mark.slow
def test_default_run_learns_checkpoints_and_resumes(tmp_path):
    """The README's first command, as a process (its exit code), then resumed in this process for 20 more steps."""
    steps, every = TrainerConfig.max_steps, TrainerConfig.eval_every
    run_dir = tmp_path / "run"
    proc = run_cli([f"run_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = metrics(run_dir)
    train_recs = [r for r in recs if r["kind"] == "train"]
    ckpts = [r for r in recs if r["kind"] == "checkpoint"]
    assert train_recs[-1]["loss"] < 0.5 * train_recs[0]["loss"], (train_recs[0], train_recs[-1])
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == list(range(every, steps + 1, every))
    # measured (1000 steps), 1 thread (as here) and 2: 0.91 and 0.88 at step 500, 1.000 and 0.996 at 750, 1.000 at 1000
    assert evals[-1]["accuracy"] >= 0.9, evals
    assert len(ckpts) >= 2 and ckpts[-1]["step"] == train_recs[-1]["step"] == steps
    for r in ckpts:
        assert r["export_bytes"] > 0 and r["export_s"] > 0 and r["export_gbps"] > 0 and "gpu_peak_mib" in r
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if is_complete(p))
    assert done[-1] == f"step_{steps:08d}"
    # the last line, for a person: what was reached, where the checkpoints are, how to go on, where the figures are
    last, summary = proc.stderr.strip().splitlines()[-1], [r for r in recs if r["kind"] == "summary"][-1]
    assert last.endswith(
        f"done: steps 0-{steps}, loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; accuracy "
        f"{evals[-1]['accuracy']:.3f} at step {steps}; {len(done)} checkpoint(s) in {run_dir / 'checkpoints'}, newest "
        f"{done[-1]}; to train on: the same command with trainer.max_steps above {steps} (the summary: the last "
        f"record of {run_dir / 'metrics.jsonl'})"
    ), last
    # scripts/readme_figures.py reads the README's figures off this line
    assert figures(last) == (str(steps), f"{summary['first_loss']:.4f}", f"{summary['last_loss']:.4f}",
                             f"{evals[-1]['accuracy']:.3f}", str(steps)), last  # fmt: skip

    again = train(compose_config([f"run_dir={run_dir}", f"trainer.max_steps={steps + 20}"]))
    assert again["start_step"] == steps and again["resumed_from"].endswith(f"step_{steps:08d}")
    assert [r for r in metrics(run_dir) if r["kind"] == "train"][-1]["step"] == steps + 20
