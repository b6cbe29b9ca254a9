"""The scripts run as modules (``python -m scripts.<name>``) from the repository root, without sys.path edits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# no PYTHONPATH: from the repository root, ``-m`` alone must find scripts, optim_factory and recipes
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def test_bench_export_runs_with_fresh_processes_on_cpu(tmp_path):
    out = tmp_path / "bench.md"
    args = ["--backend", "portable", "--device", "cpu", "--cases", "1x1M", "--dtypes", "bf16", "--modes", "chunked"]
    cmd = [sys.executable, "-m", "scripts.bench_export", *args, "--repeats", "1", "--fresh", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "- command: `python -m scripts.bench_export --backend portable" in text
    fresh = [ln for ln in text.splitlines() if ln.startswith("| 1x1M | bf16 | chunked | 2 |")]
    assert len(fresh) == 1, text  # the row of the fresh process (started as -m scripts.bench_export)


def test_every_script_imports_as_a_module():
    code = "import scripts.bench_export, scripts.bench_keep_bf16, scripts.probe_host_memory, scripts.fault_injection, "
    code += "scripts.fault_train"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
