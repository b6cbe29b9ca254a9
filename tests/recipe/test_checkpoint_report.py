"""The per-checkpoint report's blocking time and written bytes, from a real recipe run on CPU (sync, async, and
async with the background export, whose wait before the next step() counts)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from recipes.checkpoint import MARKER, read_manifest
from recipes.job import train
from recipes.train import compose_config
from tests.recipe.runs import BACKGROUND, QUICK, metrics
from tests.recipe.timed_saves import TimedSaves

MARKER_DELAY_S = 0.3  # slept at the "marker" phase: inside the part of a save that holds the loop after the call


def _sleep_at_the_marker(phase: str, step: int, path: Path) -> None:
    if phase == "marker":
        time.sleep(MARKER_DELAY_S)


@pytest.mark.parametrize(
    "async_save,background", [(False, False), (True, False), (True, True)], ids=["sync", "async", "background"]
)
def test_blocking_time_is_at_most_what_the_calls_took_seen_from_outside(tmp_path, async_save, background):
    """A hand-written loop times the saver's calls: each checkpoint's ``blocking_s`` holds its export, its save
    call and its marker phase (slept), and at most what the calls around it took."""
    loop = TimedSaves(tmp_path, async_save=async_save, background=background, on_phase=_sleep_at_the_marker)
    reports = loop.run(steps=6, every=2)
    assert [r.step for r in reports] == [2, 4, 6]
    for r, bound in zip(reports, loop.held_bounds(async_save), strict=True):
        held = MARKER_DELAY_S + r.save_s + (0 if background else r.export_s)
        assert held < r.blocking_s <= bound, (r, bound)


@pytest.mark.parametrize(
    "async_save,background", [(False, False), (True, False), (True, True)], ids=["sync", "async", "background"]
)
def test_report_has_blocking_time_and_written_bytes(tmp_path, async_save, background):
    extra = BACKGROUND if background else [f"checkpoint.async_save={async_save}"]
    cfg = compose_config([*QUICK, f"run_dir={tmp_path}", *extra])
    summary = train(cfg, on_phase=_sleep_at_the_marker)
    reports = [r for r in metrics(tmp_path) if r["kind"] == "checkpoint"]
    assert [r["step"] for r in reports] == [10, 20]
    log_text = (tmp_path / "train.log").read_text()
    for r in reports:
        step_dir = Path(r["path"])
        on_disk = sum(p.stat().st_size for p in step_dir.iterdir() if p.name != MARKER)
        assert r["written_bytes"] == on_disk > 0, (r, on_disk)
        manifest = read_manifest(step_dir)
        assert manifest["written_bytes"] == on_disk and "blocking_s" not in manifest
        # it holds the export, the save call and the marker phase (slept) (background: export_s ends when the
        # export was filled, which the next forward and backward overlap); the upper bound: the hand-written loop's
        held = MARKER_DELAY_S + r["save_s"] + (0 if background else r["export_s"])
        assert held < r["blocking_s"], r
        # held on the host for the write: a sync save writes the live states as they are (only the trainer's
        # tensors are made for it); an async save holds its copies and the export's host buffers
        assert (r["host_bytes"] < r["export_bytes"]) if not async_save else (r["host_bytes"] > r["export_bytes"]), r
        line = f"checkpoint step {r['step']}: "
        said = next(text for text in log_text.splitlines() if line in text)
        assert f"blocked training {r['blocking_s']:.3f} s, wrote {r['written_bytes'] / 1e6:.2f} MB" in said
        assert f", host peak {r['host_bytes'] / 1e6:.2f} MB; save " in said
    keys = ("step", "blocking_s", "written_bytes", "host_bytes")
    assert summary["checkpoints"] == [{k: r[k] for k in keys} for r in reports]
    recorded = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert recorded["kind"] == "summary" and recorded["checkpoints"] == summary["checkpoints"]
