"""The scripts, and the fault-injection tools of tests/fault/: each through its own ``main([...])`` in this
process (argparse's refusals are its ``SystemExit(2)`` with one line on stderr); as processes (``python -m
scripts.<name>`` from the repository root, without sys.path edits) where the process is what is tested: the
imports, torchrun's ranks."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# no PYTHONPATH: from the repository root, ``-m`` alone must find scripts, optim_factory and recipes
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
PACKAGES = {"fault_injection": "tests.fault", "fault_train": "tests.fault"}  # the others: scripts


def run_script(script: str, args: list[str], monkeypatch, capsys) -> tuple[object, str]:
    """``python -m <package>.<script> ARGS`` (``scripts``, or ``tests.fault`` for the fault-injection tools) through
    its ``main(ARGS)`` here: (its exit code, stderr). argparse names the program after ``sys.argv[0]``, as the
    process would (``<script>.py``)."""
    package = PACKAGES.get(script, "scripts")
    module = importlib.import_module(f"{package}.{script}")
    monkeypatch.setattr(sys, "argv", [str(ROOT.joinpath(*package.split("."), f"{script}.py"))])
    capsys.readouterr()
    try:
        code = module.main(args)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_bench_export_runs_with_fresh_processes_on_cpu(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.md"
    args = ["--backend", "portable", "--device", "cpu", "--cases", "1x1M", "--dtypes", "bf16", "--modes", "chunked"]
    code, err = run_script(
        "bench_export", [*args, "--repeats", "1", "--fresh", "2", "--out", str(out)], monkeypatch, capsys
    )
    assert code is None, err[-3000:]
    text = out.read_text()
    assert "- command: `python -m scripts.bench_export --backend portable" in text
    fresh = [ln for ln in text.splitlines() if ln.startswith("| 1x1M | bf16 | chunked | 2 |")]
    assert len(fresh) == 1, text  # the row of the fresh process (started as -m scripts.bench_export)


@pytest.mark.parametrize("reuse", [True, False])
def test_pool_buffers_records_the_buffers_each_export_leased(reuse):
    import torch

    from optim_factory import PortableFusedAdam
    from scripts.bench_export import PoolBuffers

    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 70)]
    options = dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=64)
    opt = PortableFusedAdam(params, lr=1e-3, state_dict_offload_reuse_buffers=reuse, **options)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    counted = PoolBuffers(opt)
    exported = opt.state_dict()
    leased = [t for st in exported["state"].values() for t in st.values() if opt.is_leased_export_buffer(t)]
    assert len(leased) == (4 if reuse else 0)  # exp_avg and exp_avg_sq of each parameter, pooled with reuse
    assert {id(t) for t in counted.buffers.values()} == {id(t) for t in leased}
    assert counted.pinned_bytes() == 0  # CPU states: the pool pins nothing
    opt.release_state_dict(exported)


def test_bench_save_runs_every_mode_on_cpu(tmp_path, monkeypatch, capsys):
    """Every mode but the frameworks' (test_bench_save_runs_the_framework_modes_on_cpu)."""
    from scripts.bench_save import FW
    from scripts.bench_save import MODES as ALL

    MODES = [m for m in ALL if not m.startswith(FW)]
    args = ["--device", "cpu", "--width", "64", "--layers", "2", "--tokens", "16", "--repeats", "1"]
    args += ["--out", str(tmp_path), "--scratch", str(tmp_path / "s"), "--profile", str(tmp_path / "prof")]
    args += ["--steps-after", "2"]
    code, err = run_script("bench_save", [*args, "--modes", ",".join(MODES)], monkeypatch, capsys)
    assert code is None, err[-3000:]

    # --profile: the measured save call of every mode, profiled (the function the mode's save went through)
    for m in MODES:
        profile = (tmp_path / "prof" / f"{m}_rank0.txt").read_text()
        assert profile.startswith("1 save calls") and "(save)" in profile, (m, profile[:500])

    lines = (tmp_path / "bench_save.jsonl").read_text().splitlines()
    rows = [json.loads(ln) for ln in lines[1:]]
    assert [(r["mode"], r["repeat"]) for r in rows] == [(m, i) for m in MODES for i in (-1, 0)]
    assert all(r["disk_bytes"] > 0 and r["block_s"] > 0 for r in rows)  # every checkpoint was written
    # the baseline step: the median of as many steps before the save as are counted after it (--steps-after)
    assert all(len(r["steps_before_s"]) == len(r["steps_after_s"]) == 2 for r in rows)
    assert all(r["step_before_s"] == statistics.median(r["steps_before_s"]) for r in rows)
    table = (tmp_path / "bench_save.md").read_text()
    assert all(f"| {m} |" in table for m in MODES) and "## Goals" in table
    assert "the slowdown of 2 steps after each save counted against the median of the 2 before it" in table
    assert not list((tmp_path / "s" / "bench_save").iterdir())  # each mode's checkpoints deleted
    # --render writes the same table again from the JSON lines alone
    again = tmp_path / "again"
    code, err = run_script("bench_save", ["--out", str(again), "--render", str(tmp_path / "bench_save.jsonl")],
                           monkeypatch, capsys)  # fmt: skip
    assert code is None, err[-3000:]
    assert (again / "bench_save.md").read_text() == table


def test_bench_save_counts_the_gen2_collections_in_each_save_s_window(tmp_path, monkeypatch, capsys, unowned_collector):
    """Each row counts the generation-2 collections that ended in its save's window (here one forced at the save
    call's start) and how many objects were frozen then: the setup's with ``--gc frozen`` (the default), none with
    ``--gc automatic``; after the run nothing is frozen and the recorder's callback is gone."""
    import gc

    from recipes.checkpoint import Saver
    from scripts.bench_save import Gen2Pauses

    pauses, t0 = Gen2Pauses(), time.perf_counter()
    try:
        gc.collect(1)  # a younger generation's: not counted
        gc.collect()
        assert len(pauses.since(t0)) == 1 and pauses.since(time.perf_counter()) == []
        (detail,) = pauses.details_since(t0)  # what it scanned (the unfrozen objects) and freed, and where it ran
        assert detail["scanned"] >= detail["collected"] >= 0 and detail["scanned"] > 0, detail
        assert detail["thread"] == "MainThread" and detail["ms"] == pauses.since(t0)[0], detail
        assert 0 <= detail["cpu_ms"] <= detail["ms"] * 1.01 + 0.1, detail  # the collecting thread's CPU time in it
    finally:
        pauses.close()

    save, callbacks = Saver.save, list(gc.callbacks)
    monkeypatch.setattr(Saver, "save", lambda *a, **k: (gc.collect(), save(*a, **k))[1])
    args = ["--device", "cpu", "--width", "64", "--layers", "2", "--tokens", "16", "--repeats", "1"]
    args += ["--modes", "e-ours-sync", "--scratch", str(tmp_path / "s")]
    for policy in ("default", "automatic"):
        out = tmp_path / policy
        extra = [] if policy == "default" else ["--gc", policy]
        code, err = run_script("bench_save", [*args, "--out", str(out), *extra], monkeypatch, capsys)
        assert code is None, err[-3000:]
        assert gc.get_freeze_count() == 0 and callbacks == gc.callbacks  # unfrozen, and the recorder's callback gone
        rows = [json.loads(ln) for ln in (out / "bench_save.jsonl").read_text().splitlines()]
        assert rows[0]["meta"]["gc"] == ("frozen" if policy == "default" else policy)
        assert all(r["gen2_count"] >= 1 and r["gen2_max_ms"] > 0 for r in rows[1:]), rows[1:]
        assert all(len(r["gen2_details"]) == r["gen2_count"] for r in rows[1:]), rows[1:]
        assert all(any(d["thread"] == "MainThread" for d in r["gen2_details"]) for r in rows[1:]), rows[1:]
        frozen = [r["frozen_objects"] for r in rows[1:]]
        assert all(n > 10_000 for n in frozen) if policy == "default" else frozen == [0, 0], frozen
    assert "longest gen-2 collection in the window (ms)" in (out / "bench_save.md").read_text()


def test_bench_save_with_param_remainders_exports_the_master_as_int16(tmp_path, monkeypatch, capsys):
    """--store-param-remainders: the FP32 master is exported as its int16 remainder, so (d) exports 6 of (c)'s 10
    bytes per parameter (remainder 2 + BF16 moments 2 + 2 against 2 + FP32 moments 4 + 4: 0.6). Broken on purpose
    (the flag ignored): an FP32 master, 8 of 12 bytes (0.667)."""
    args = ["--device", "cpu", "--width", "64", "--layers", "2", "--tokens", "16", "--repeats", "1"]
    args += ["--modes", "c-ours,d-ours-keep-bf16", "--store-param-remainders"]
    code, err = run_script("bench_save", [*args, "--out", str(tmp_path), "--scratch", str(tmp_path / "s")],
                           monkeypatch, capsys)  # fmt: skip
    assert code is None, err[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "bench_save.jsonl").read_text().splitlines()]
    assert rows[0]["meta"]["master"] == "remainders"
    optim = {r["mode"]: r["optim_bytes"] for r in rows[1:] if r["repeat"] == 0}
    assert optim["d-ours-keep-bf16"] / optim["c-ours"] == pytest.approx(0.6, abs=0.005)  # steps: a few bytes more
    assert "stored as BF16 parameter + int16 remainder" in (tmp_path / "bench_save.md").read_text()


def test_bench_save_refuses_a_profile_path_that_is_a_file(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "profile.txt"
    a_file.write_text("")
    code, err = run_script("bench_save", ["--out", str(tmp_path), "--profile", str(a_file)], monkeypatch, capsys)
    assert code == 2, err[-2000:]
    last = err.splitlines()[-1]
    assert last.endswith(f"argument --profile: {a_file} exists and is not a directory"), last
    assert not (tmp_path / "bench_save.md").exists()


def test_bench_save_lost_time_counts_blocking_and_slower_steps():
    from scripts.bench_save import lost_s

    row = {"block_s": 0.1, "step_before_s": 1.0, "steps_after_s": [1.5, 0.9, 1.2]}
    assert lost_s(row) == pytest.approx(0.1 + 0.5 + 0.0 + 0.2)  # a faster step gives nothing back


@pytest.mark.parametrize("stager", ["reuse", "fresh"])
def test_bench_save_dcp_stager_per_save_or_kept(tmp_path, monkeypatch, capsys, stager):
    """--stager fresh (what users of torch 2.11 get: its DefaultStager serves one save) builds one stager per
    save."""
    from scripts.bench_save import stager_reusable

    if stager == "reuse" and not stager_reusable():
        pytest.skip("this torch's DefaultStager serves one save (pytorch/pytorch#183413): --stager reuse is refused")
    args = ["--device", "cpu", "--width", "64", "--layers", "2", "--tokens", "16", "--repeats", "2"]
    args += ["--modes", "a-te-async-pinned,b-te-cpu-offload", "--stager", stager]
    code, err = run_script("bench_save", [*args, "--out", str(tmp_path), "--scratch", str(tmp_path / "s")],
                           monkeypatch, capsys)  # fmt: skip
    assert code is None, err[-3000:]
    lines = (tmp_path / "bench_save.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["meta"]["fresh_stagers"] is (stager == "fresh")
    for mode in ("a-te-async-pinned", "b-te-cpu-offload"):
        built = [json.loads(ln)["stagers_built"] for ln in lines[1:] if json.loads(ln)["mode"] == mode]
        assert built == ([1, 2, 3] if stager == "fresh" else [1, 1, 1]), (mode, built)


def torch_211_stager():
    """torch 2.11's ``DefaultStager`` on this torch (pytorch/pytorch#183413): its ``_stage()`` closes the
    deep-copier it needs for the next save."""
    from torch.distributed.checkpoint.staging import DefaultStager

    class Torch211Stager(DefaultStager):
        def _stage(self, state_dict, **kwargs):
            try:
                return super()._stage(state_dict, **kwargs)
            finally:
                self._state_dict_stager.close()

    return Torch211Stager


def test_kept_stager_serves_every_save_where_the_torch_s_stager_serves_one():
    """KeptStager's staging replaces torch 2.11's (simulated: its own class under it), so one stager serves a
    second save. Broken on purpose (KeptStager._stage calling the base's): not reusable."""
    from scripts.dcp_stagers import KeptStager, stager_reusable

    torch_211 = torch_211_stager()

    class Kept211(KeptStager, torch_211):  # KeptStager's _stage first, 2.11's below it
        pass

    assert not stager_reusable(torch_211)
    assert stager_reusable(Kept211) and stager_reusable(KeptStager)


@pytest.mark.parametrize("torch_211", [False, True])
def test_bench_save_a_keeps_one_stager_across_saves_and_says_how(tmp_path, monkeypatch, capsys, torch_211):
    """--stager auto (the default) keeps one stager across (a)'s saves: this torch's DefaultStager where it serves
    a second save (torch 2.13), found by trying one; with torch 2.11's stager (simulated here) the bench's
    KeptStager (2.13's staging), and the output and the table say so."""
    import scripts.bench_save as bench_save

    Torch211Stager = torch_211_stager()
    if torch_211:
        monkeypatch.setattr(bench_save, "DefaultStager", Torch211Stager)
    elif not bench_save.stager_reusable():
        pytest.skip("this torch's DefaultStager serves one save (pytorch/pytorch#183413)")
    args = ["--device", "cpu", "--width", "64", "--layers", "2", "--tokens", "16", "--repeats", "1"]
    args += ["--modes", "a-te-async-pinned", "--out", str(tmp_path), "--scratch", str(tmp_path / "s")]
    monkeypatch.setattr(sys, "argv", ["bench_save.py"])
    capsys.readouterr()
    assert bench_save.main(args) is None
    out = capsys.readouterr().out
    lines = (tmp_path / "bench_save.jsonl").read_text().splitlines()
    meta, rows = json.loads(lines[0])["meta"], [json.loads(ln) for ln in lines[1:]]
    assert (meta["stager_reusable"], meta["stager_emulated"]) == (not torch_211, torch_211)
    assert not meta["fresh_stagers"]
    assert [r["stagers_built"] for r in rows] == [1, 1]  # warm-up + 1 measured save, one stager
    assert [r["stager"] for r in rows] == ["KeptStager" if torch_211 else "DefaultStager"] * 2
    note = "one kept across saves" + (" (torch 2.13's, emulated: this torch's DefaultStager" if torch_211 else "")
    assert f"DCP's `DefaultStager` for (a) and (b): {note}" in out
    assert f"- DCP's `DefaultStager` for (a) and (b): {note}" in (tmp_path / "bench_save.md").read_text()


@pytest.mark.slow  # torchtitan's async_with_pinned_mem writes from a process of DCP's
def test_bench_save_runs_the_framework_modes_on_cpu(tmp_path, monkeypatch, capsys):
    """torchtitan's CheckpointManager and Automodel's Checkpointer, TE's class (here its portable twin with TE's
    export) and ours, each through the framework's own async save, with torch 2.11's stager simulated: torchtitan's
    kept stager is the bench's KeptStager (2.13's staging), which serves the second save. Automodel's own async
    Checkpointer needs an accelerator: without one it is skipped in one line (so is ours where its integration
    builds Automodel's stager). Broken on purpose (the stager slot left to torchtitan): torchtitan's stager refuses
    CPU staging with non-blocking copies."""
    pytest.importorskip("torchtitan", reason="needs tests/integrations/requirements.txt")
    pytest.importorskip("nemo_automodel", reason="needs tests/integrations/requirements.txt")
    pytest.importorskip("torch_checkpointing", reason="needs tests/integrations/requirements.txt")
    import torch

    from tests import forked
    from tests.distributed.launch import PRELOAD

    forked.start_forkserver(PRELOAD)  # the -process modes' writer processes fork from it (torch imported once)

    import scripts.bench_save as bench_save

    monkeypatch.setattr(bench_save, "DefaultStager", torch_211_stager())
    modes = ["f-titan-te", "f-titan-ours", "f-titan-ours-process", "g-automodel-te", "g-automodel-ours"]
    modes += ["g-automodel-ours-process", "h-checkpointing-te", "f-titan-ours-process-budget-all"]
    args = ["--device", "cpu", "--width", "64", "--layers", "2", "--tokens", "16", "--repeats", "1"]
    args += ["--modes", ",".join(modes), "--out", str(tmp_path), "--scratch", str(tmp_path / "s")]
    code, err = run_script("bench_save", args, monkeypatch, capsys)
    assert code is None, err[-3000:]
    lines = (tmp_path / "bench_save.jsonl").read_text().splitlines()
    meta, rows = json.loads(lines[0])["meta"], [json.loads(ln) for ln in lines[1:]]
    skipped = meta["skipped"]
    ran = [m for m in modes if m not in skipped]
    assert [(r["mode"], r["repeat"]) for r in rows] == [(m, i) for m in ran for i in (-1, 0)]
    assert all(r["disk_bytes"] > 0 and r["optim_bytes"] > 0 for r in rows)  # written, the export counted
    assert meta["stagers"]["f-titan-te"].startswith("KeptStager (torch 2.13's, emulated")
    assert meta["stagers"]["f-titan-ours-process"] == "AsyncSaveStager (write_in_process)"
    assert meta["stagers"]["f-titan-ours-process-budget-all"] == "AsyncSaveStager (write_in_process)"
    accelerator = torch.accelerator.is_available()
    assert set(skipped) <= ({"g-automodel-te", "g-automodel-ours"} if not accelerator else set())
    assert accelerator or "g-automodel-te" in skipped
    for reason in skipped.values():
        assert "\n" not in reason and reason.endswith("the current accelerator is available."), reason
    table = (tmp_path / "bench_save.md").read_text()
    assert all(f"| {m} |" in table for m in ran)
    assert "] f-titan-te loses " in table and "what c-ours loses" not in table  # without c-ours: not that goal
    assert all(f"- {m}: skipped: " in table for m in skipped)
    assert not list((tmp_path / "s" / "bench_save").iterdir())  # every mode's folder deleted, a skipped one's too


def test_bench_save_refuses_a_framework_mode_whose_framework_does_not_import(tmp_path, monkeypatch, capsys):
    """Before any measurement (a GPU run would otherwise measure every other mode first). Broken on purpose (the
    check not called): the mode fails at its import after the others ran."""
    import scripts.bench_save_frameworks as frameworks

    monkeypatch.setitem(frameworks.IMPORTS, "f-", ("no_such_framework_here",))
    args = ["--device", "cpu", "--width", "64", "--layers", "2", "--tokens", "16", "--repeats", "1"]
    args += ["--modes", "c-ours,f-titan-te", "--out", str(tmp_path / "o"), "--scratch", str(tmp_path / "s")]
    code, _ = run_script("bench_save", args, monkeypatch, capsys)
    assert code == (
        "--modes='c-ours,f-titan-te': no_such_framework_here does not import (No module named "
        "'no_such_framework_here'); pip install --no-deps -r tests/integrations/requirements.txt"
    )
    assert not (tmp_path / "o").exists()


def test_bench_save_s_floor_is_the_copy_less_the_overlapping_forward_and_backward():
    from scripts.bench_save import floor_s

    meta = {"link_gbps": 50.0, "forward_backward_s": 0.03, "model_bytes": 1e9}
    assert floor_s(4e9, meta) == pytest.approx(5e9 / 50e9 - 0.03)  # optimizer export + model parameters
    assert floor_s(0.5e9, {**meta, "forward_backward_s": 1.0}) == 0.0  # all of it hidden
    assert floor_s(4e9, {**meta, "link_gbps": None}) is None  # CPU: no link


def test_bench_write_sets_every_writer_row_beside_dd(tmp_path, monkeypatch, capsys):
    args = ["--gb", "0.02", "--tensor-mib", "1", "--threads", "1,2", "--repeats", "2"]
    code, err = run_script(
        "bench_write", [*args, "--scratch", str(tmp_path / "s"), "--out", str(tmp_path)], monkeypatch, capsys
    )
    assert code is None, err[-3000:]
    lines = (tmp_path / "bench_write.jsonl").read_text().splitlines()
    meta, rows = json.loads(lines[0])["meta"], [json.loads(ln) for ln in lines[1:]]
    assert len(meta["reference_gbps"]) == 2 and min(meta["reference_gbps"]) > 0
    assert [(r["case"], r["threads"]) for r in rows] == [
        ("synthetic", 1),
        ("synthetic", 2),
        ("synthetic+zip-crc32", 1),
        ("synthetic+zip-crc32", 2),
    ]
    from scripts.bench_write import synthetic_state

    nbytes = sum(t.numel() * t.element_size() for t in synthetic_state(0.02, 1).values())
    for r in rows:  # the tensors' bytes, and each file's framing on top
        assert len(r["gbps"]) == 2 and min(r["gbps"]) > 0 and nbytes < r["bytes"] < nbytes + 2**20, r
    assert "| synthetic | 2 |" in (tmp_path / "bench_write.md").read_text()
    assert list((tmp_path / "s").iterdir()) == []  # every checkpoint and the dd file deleted


def test_bench_write_measures_the_recipe_s_own_checkpoints(tmp_path, monkeypatch, capsys):
    args = ["--recipe", "experiment=quick trainer.threads=1", "--threads", "1,2", "--repeats", "2", "--every", "5"]
    code, err = run_script(
        "bench_write", [*args, "--scratch", str(tmp_path / "s"), "--out", str(tmp_path)], monkeypatch, capsys
    )
    assert code is None, err[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "bench_write.jsonl").read_text().splitlines()[1:]]
    assert [(r["case"], r["threads"], len(r["gbps"])) for r in rows] == [("recipe", 1, 2), ("recipe", 2, 2)]
    assert all(r["bytes"] > 0 for r in rows)


def test_bench_trust_saves_and_verifies_each_state_with_and_without_a_key(tmp_path, monkeypatch, capsys):
    args = ["--gb", "0.01", "--repeats", "1", "--scratch", str(tmp_path / "s"), "--out", str(tmp_path)]
    code, err = run_script("bench_trust", args, monkeypatch, capsys)
    assert code is None, err[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "bench_trust.jsonl").read_text().splitlines()[1:]]
    assert [(r["state"], r["mode"]) for r in rows] == [
        ("default job", "xxh3"),
        ("default job", "keyed"),
        ("0.01 GB", "xxh3"),
        ("0.01 GB", "keyed"),
    ]
    assert rows[0]["bytes"] == rows[1]["bytes"] > 0 and rows[2]["bytes"] == rows[3]["bytes"] > 10**7
    assert all(r["save_s"] > 0 and r["verify_s"] > 0 and r["load_dcp_s"] > 0 and r["load_safe_s"] > 0 for r in rows)
    assert "| default job |" in (tmp_path / "bench_trust.md").read_text()
    assert list((tmp_path / "s").iterdir()) == []  # the run and every checkpoint deleted


def test_bench_resume_loads_every_state_bitwise_on_cpu(tmp_path, monkeypatch, capsys):
    args = ["--device", "cpu", "--width", "32", "--layers", "2", "--out", str(tmp_path), "--scratch", str(tmp_path)]
    code, err = run_script("bench_resume", args, monkeypatch, capsys)
    assert code is None, err[-3000:]
    lines = (tmp_path / "bench_resume.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["meta"]["command"].startswith("python -m scripts.bench_resume --device cpu")
    assert not (tmp_path / "bench_resume").exists()  # the checkpoint deleted
    rows = [json.loads(ln) for ln in lines[1:]]
    assert [(r["case"], r["states_equal_saved"], r["step"]) for r in rows] == [
        ("ours", True, [2]),
        ("ours-dcp-init", True, [2]),
    ]


@pytest.mark.slow
def test_every_script_imports_as_a_module_from_the_root_without_pythonpath():
    code = "import scripts.bench_export, tests.fault.fault_injection, tests.fault.fault_train, scripts.bench_save, "
    code += "scripts.plot_bench_save, scripts.compare_backends, scripts.bench_write, scripts.bench_resume, "
    code += "scripts.bench_save_frameworks, scripts.dcp_stagers, scripts.bench_trust"
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_fault_train_config_error_is_one_line(monkeypatch, capsys):
    """As recipes/train.py gives it: one line and exit 2, not a ConfigError traceback."""
    code, err = run_script("fault_train", ["optim.nope=1"], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == ["error: optim.nope: not a config key"], err[-2000:]


@pytest.mark.parametrize(
    "args,ending",
    [
        (["--modes", "bogus"], "modes from sync,async"),
        (["--modes", "sync,Async"], "modes from sync,async"),
        (["--trials", "0"], "argument --trials: '0' is not a positive integer"),
    ],
)
def test_fault_injection_refuses_what_it_would_not_test(args, ending, monkeypatch, capsys):
    """An unknown mode would run sync saves under its own name, and 0 trials would pass having tested nothing."""
    code, err = run_script("fault_injection", args, monkeypatch, capsys)
    assert code == 2, err[-2000:]
    assert err.splitlines()[-1].endswith(ending), err


# (script, arguments, the end of its one error line); {tmp} is the test's folder, {file} a file in it. Unchecked,
# each would run into a traceback: an empty median for 0 repeats, a CUDA call on a CPU machine, or a write at the
# very end of the run into a path that is a file or a folder (the results lost)
BAD_ARGUMENTS = [
    ("bench_export", ["--repeats", "0", "--device", "cpu"], "argument --repeats: '0' is not a positive integer"),
    (
        "bench_export",
        ["--device", "cpu", "--out", "{tmp}"],
        "argument --out: {tmp} is a directory, expected a file name",
    ),
    ("bench_export", ["--device", "cuda:7"], "argument --device: cuda:7: "),
    ("bench_save", ["--out", "{tmp}", "--width", "0"], "argument --width: '0' is not a positive integer"),
    ("compare_backends", ["--max-rel", "nan", "--device", "cpu"], "argument --max-rel: 'nan' is not a positive number"),
    ("fault_injection", ["--json", "{file}/x.json"], "argument --json: {file}/x.json: {file} is not a directory"),
    ("bench_export", ["--device", "cpu"], "--backend te needs Transformer Engine, which does not import here"),
    ("bench_export", ["--device", "cpu", "--backend", "portable", "--fresh", "1"], "--fresh 1: a fresh process"),
    ("bench_export", ["--device", "cpu", "--backend", "portable", "--chunk-mib", "1e-5"], "an int >= 64"),
    ("bench_save", ["--out", "{tmp}/o", "--chunk", "12XB"], "argument --chunk: --chunk='12XB': expected"),
    ("plot_bench_save", ["{tmp}/none.jsonl"], "argument jsonl: {tmp}/none.jsonl: no such file"),
    ("compare_backends", ["--device", "cpu"], "--against te needs Transformer Engine, which does not import here"),
    ("bench_write", ["--scratch", "{tmp}/s", "--out", "{tmp}/o", "--threads", "0"], "expected positive integers"),
    ("bench_resume", ["--out", "{tmp}/o", "--cases", "ours,bogus"], "--cases='ours,bogus': cases from te,"),
    ("bench_trust", ["--scratch", "{tmp}/s", "--out", "{tmp}/o", "--gb", "0"], "argument --gb: "),
]


@pytest.mark.parametrize("script,args,ending", BAD_ARGUMENTS, ids=[f"{s}{' '.join(a)}" for s, a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_before_any_work(tmp_path, monkeypatch, capsys, script, args, ending):
    if "Transformer Engine" in ending and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine imports here")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    fill = dict(tmp=tmp_path, file=a_file)
    code, err = run_script(script, [a.format(**fill) for a in args], monkeypatch, capsys)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and err.splitlines()[-1].startswith(f"{script}.py: error: ")
    assert ending.format(**fill) in err.splitlines()[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_readme_figures_reads_the_readme_s_done_line():
    """The README quotes the default job's done line where scripts/readme_figures.py finds it (its steps, losses and
    accuracy); the script's run of the job compares with it (tests/recipe/test_default_run.py reads a real line)."""
    from scripts.readme_figures import figures

    steps, first, last, accuracy, at = figures((ROOT / "README.md").read_text())
    assert steps == at and float(first) > float(last) and 0 < float(accuracy) <= 1


def test_readme_figures_times_the_readme_s_test_command():
    """``--suite`` runs the README's test command from its ``-m pytest`` on: CI's tier, its markers' quotes undone."""
    from scripts.readme_figures import suite_arguments

    arguments = suite_arguments((ROOT / "README.md").read_text())
    assert arguments[:2] == ["-m", "pytest"] and arguments[-2:] == ["-m", "not slow"], arguments


def test_count_hops_follows_a_save_onto_the_threads_that_write_it(tmp_path):
    """The recipe's save, traced: the calls on the loop's thread and those on DCP's upload thread (the gate)."""
    from scripts.count_hops import recipe_save

    hops = recipe_save(tmp_path)
    assert ("recipes.checkpoint.save._write", "optim_factory.checkpoint._stager.async_save") in hops.edges
    assert ("optim_factory.checkpoint._gated_planner.gate", "optim_factory.checkpoint._agreement.agree") in hops.edges
    assert hops.count == 2 * len(hops.edges) and 0 < hops.ours < hops.count
