"""The recipe runs on the base install: tqdm (dev extra only) is optional, a missing one is said in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.recipe.runs import QUICK, ROOT


@pytest.mark.slow
def test_recipe_trains_and_saves_without_tqdm(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "tqdm.py").write_text("raise ImportError('tqdm is not installed (test shim)')\n")
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "recipes/train.py", *QUICK, "trainer.progress=true", f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if "tqdm is not installed" in ln]
    assert len(warnings) == 1 and "trainer.progress=true: no progress bar" in warnings[0], proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["end_step"] for r in records if r["kind"] == "summary"] == [20]
    assert "step 20/20 loss" in proc.stderr  # the log lines are the progress
