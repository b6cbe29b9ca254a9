"""scripts/bench_recipe_overhead.py end to end on CPU: two gloo ranks under torchrun, the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts.bench_recipe_overhead import LOOPS
from tests.scripts.test_scripts_as_modules import ENV, ROOT


@pytest.mark.slow
def test_bench_recipe_overhead_two_ranks_on_cpu(tmp_path):
    args = ["--device", "cpu", "--warmup", "1", "--steps", "2", "--repeats", "2", "--probe", "20"]
    args += ["--out", str(tmp_path)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "scripts.bench_recipe_overhead", *args, "trainer.log_every=3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "bench_recipe_overhead.jsonl").read_text().splitlines()]
    meta = records[0]
    assert meta["kind"] == "meta" and meta["hardware"].startswith("2 CPU process(es)")
    assert meta["command"].startswith("torchrun --nproc_per_node=2 -m scripts.bench_recipe_overhead --device cpu")
    assert meta["log_every"] == 3 and "trainer.log_every=3" in meta["overrides"]
    blocks = [r for r in records if r["kind"] == "block"]
    # every loop once per repetition, in an order rotated per repetition
    assert [b["loop"] for b in blocks] == [LOOPS[(i + rep) % 4] for rep in range(2) for i in range(4)]
    assert all(b["step_s"] > 0 for b in blocks)
    loops = {r["loop"]: r for r in records if r["kind"] == "loop"}
    assert list(loops) == list(LOOPS)
    for name, rec in loops.items():
        times = sorted(b["step_s"] for b in blocks if b["loop"] == name)
        assert rec["median_step_s"] == pytest.approx(sum(times) / 2) and rec["min_step_s"] == times[0]
        assert rec["ratio_to_bare"] == pytest.approx(rec["median_step_s"] / loops["bare"]["median_step_s"])
        # paired: the per-repetition ratios to bare's block of the same repetition (median of 2 = their mean)
        ratios = [
            next(b["step_s"] for b in blocks if b["loop"] == name and b["repeat"] == rep)
            / next(b["step_s"] for b in blocks if b["loop"] == "bare" and b["repeat"] == rep)
            for rep in range(2)
        ]
        assert rec["paired_ratio"] == pytest.approx(sum(ratios) / 2)
        assert min(ratios) - 1e-12 <= rec["paired_ci95"][0] <= rec["paired_ratio"] <= rec["paired_ci95"][1]
        assert rec["gc_ms_per_block"] >= 0 and all(b["gc_s"] >= 0 and b["gc_runs"] >= 0 for b in blocks)
    probes = [r for r in records if r["kind"] == "probe"]
    assert [p["what"] for p in probes] == ["all-reduce", "all-reduce + device flag"]
    assert all(p["call_s"] > 0 and p["calls"] == 20 for p in probes)
    table = (tmp_path / "bench_recipe_overhead.md").read_text()
    for name in LOOPS:
        assert sum(line.startswith(f"| {name} |") for line in table.splitlines()) == 1, table
    assert "| all-reduce + device flag |" in table


def test_bench_recipe_overhead_loops_option(tmp_path):
    """--loops picks the loops (bare first); a wrong list is one line naming the option."""
    args = [
        "--device",
        "cpu",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--repeats",
        "3",
        "--probe",
        "5",
        "--out",
        str(tmp_path),
    ]
    cmd = [sys.executable, "-m", "scripts.bench_recipe_overhead", *args, "--loops", "bare,bare+flag"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "bench_recipe_overhead.jsonl").read_text().splitlines()]
    blocks = [r for r in records if r["kind"] == "block"]
    assert [b["loop"] for b in blocks] == ["bare", "bare+flag", "bare+flag", "bare", "bare", "bare+flag"]
    assert [r["loop"] for r in records if r["kind"] == "loop"] == ["bare", "bare+flag"]
    bad = subprocess.run([*cmd[:-1], "recipe,bare"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert bad.returncode == 2 and "--loops='recipe,bare'" in bad.stderr.strip().splitlines()[-1], bad.stderr


@pytest.mark.slow
def test_bench_recipe_overhead_stop_check_parts_on_two_ranks(tmp_path):
    """bare+syncstop (the check waiting for its all-reduce), bare+reduce (the check's all-reduce alone) and bare+flag
    (its flag alone) run on 2 gloo ranks."""
    args = ["--device", "cpu", "--warmup", "1", "--steps", "2", "--repeats", "2", "--probe", "5"]
    args += ["--out", str(tmp_path)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "scripts.bench_recipe_overhead", *args, "--loops", "bare,bare+syncstop,bare+reduce,bare+flag"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "bench_recipe_overhead.jsonl").read_text().splitlines()]
    assert [r["loop"] for r in records if r["kind"] == "loop"] == ["bare", "bare+syncstop", "bare+reduce", "bare+flag"]
    assert all(r["step_s"] > 0 for r in records if r["kind"] == "block")
