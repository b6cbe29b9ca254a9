"""Saver.on_phase (the save points that tests/fault/fault_train.py kills at) and the run summary."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from recipes.checkpoint import MARKER, METADATA, SAVE_PHASES, is_complete
from recipes.job import train
from recipes.train import compose_config
from tests import forked
from tests.fault import fault_injection
from tests.fault.fault_train import main as fault_train_main
from tests.recipe.runs import QUICK


@pytest.mark.parametrize("async_save", [False, True])
def test_on_phase_runs_at_each_save_point_in_order(tmp_path, async_save):
    seen: list[tuple[str, int, bool, bool]] = []  # at every on_phase call: what of the directory is on disk

    def record(phase: str, step: int, path: Path) -> None:
        seen.append((phase, step, (path / METADATA).exists(), (path / MARKER).exists()))

    cfg = compose_config([*QUICK, f"run_dir={tmp_path}", f"checkpoint.async_save={async_save}"])
    train(cfg, on_phase=record)
    assert [(p, s) for p, s, _, _ in seen] == [(p, s) for s in (10, 20) for p in SAVE_PHASES]
    for phase, step, metadata, marker in seen:
        assert not marker, f"{phase} of step {step}: the completion marker is already written"
        if phase == "export":
            assert not metadata, f"export of step {step}: DCP already wrote"
        if phase == "marker" or (phase == "write" and not async_save):
            assert metadata, f"{phase} of step {step}: DCP has not finished writing"
    assert all(is_complete(tmp_path / "checkpoints" / f"step_{s:08d}") for s in (10, 20))


@pytest.mark.slow
def test_fault_train_kills_inside_the_save_and_refuses_an_unreached_or_bad_point(tmp_path, capsys):
    # a process of its own, launched as tests/fault/fault_injection.py launches its trainers
    run_dir = tmp_path / "a"
    proc, stderr = fault_injection.launch(run_dir, "sync", "marker:8")
    assert forked.join([proc], 300) == [-signal.SIGKILL], stderr.read_text()[-2000:]
    step8 = run_dir / "checkpoints" / "step_00000008"
    assert (step8 / METADATA).exists() and not (step8 / MARKER).exists()  # killed between DCP and the marker

    # in this process, through the script's main: a point never reached, a malformed point
    assert fault_train_main(["--kill-at", "write:7", *QUICK, f"run_dir={tmp_path / 'b'}"]) == 3
    assert "--kill-at=write:7 was never reached" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        fault_train_main(["--kill-at", "flush:10", *QUICK, f"run_dir={tmp_path / 'c'}"])
    assert refused.value.code == 2 and "--kill-at='flush:10': must be PHASE:STEP" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_summary_lists_saved_and_kept_checkpoints(tmp_path):
    cfg = compose_config([*QUICK, f"run_dir={tmp_path}", "checkpoint.every_steps=5", "checkpoint.keep_last=2"])
    summary = train(cfg)
    ck = tmp_path / "checkpoints"
    assert summary["saved_checkpoints"] == [str(ck / f"step_{s:08d}") for s in (5, 10, 15, 20)]
    assert summary["kept_checkpoints"] == [str(ck / f"step_{s:08d}") for s in (15, 20)]
    assert sorted(p.name for p in ck.iterdir() if p.name != ".lock") == ["step_00000015", "step_00000020"]
