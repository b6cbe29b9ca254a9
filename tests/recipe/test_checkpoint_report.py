"""The per-checkpoint report's blocking time and written bytes, from a real recipe run on CPU (sync, async, and
async with the background export, whose wait before the next step() counts)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from recipes.checkpoint import MARKER, Saver, read_manifest
from recipes.job import train
from recipes.train import compose_config
from tests.recipe.runs import BACKGROUND, QUICK, metrics

MARKER_DELAY_S = 0.3  # slept at the "marker" phase: inside the part of a save that holds the loop after the call


class TimedSaver(Saver):
    """Times every save() and wait() call from outside the manager, and sleeps at the "marker" phase (async: in the
    wait() of the next save or of close(), after the save call returned)."""

    calls: list[tuple[str, float, float]] = []  # (save|wait|wait_export, start, end)

    def save(self, step, model, optimizer, trainer_state):
        t0 = time.perf_counter()
        try:
            return super().save(step, model, optimizer, trainer_state)
        finally:
            TimedSaver.calls.append(("save", t0, time.perf_counter()))

    def wait(self) -> None:
        t0 = time.perf_counter()
        try:
            super().wait()
        finally:
            TimedSaver.calls.append(("wait", t0, time.perf_counter()))

    def wait_export(self) -> None:
        t0 = time.perf_counter()
        try:
            super().wait_export()
        finally:
            TimedSaver.calls.append(("wait_export", t0, time.perf_counter()))

    def on_phase(self, phase: str, step: int, path: Path) -> None:
        if phase == "marker":
            time.sleep(MARKER_DELAY_S)


def held_bounds(calls: list[tuple[str, float, float]], async_save: bool) -> list[float]:
    """Per save, in order: the longest the loop can have been held by it, as timed from outside the manager.
    Sync: the save call. Async: the save call less the wait for the previous save inside it, plus the waits before
    step() (wait_export) until the first wait() after the call (in the next save, or in close()), plus that wait."""
    saves = [(t0, t1) for kind, t0, t1 in calls if kind == "save"]
    waits = [(t0, t1) for kind, t0, t1 in calls if kind == "wait"]
    export_waits = [(t0, t1) for kind, t0, t1 in calls if kind == "wait_export"]
    bounds = []
    for a, b in saves:
        if not async_save:
            bounds.append(b - a)
            continue
        nested = sum(t1 - t0 for t0, t1 in waits if a <= t0 and t1 <= b)
        after = min((w for w in waits if w[0] >= b), key=lambda w: w[0])
        before_step = sum(t1 - t0 for t0, t1 in export_waits if b <= t0 and t1 <= after[0])
        bounds.append(b - a - nested + before_step + after[1] - after[0])
    return bounds


@pytest.mark.parametrize(
    "async_save,background", [(False, False), (True, False), (True, True)], ids=["sync", "async", "background"]
)
def test_report_has_blocking_time_and_written_bytes(tmp_path, async_save, background):
    TimedSaver.calls = []
    extra = BACKGROUND if background else [f"checkpoint.async_save={async_save}"]
    cfg = compose_config([*QUICK, f"run_dir={tmp_path}", *extra])
    summary = train(cfg, saver_cls=TimedSaver)
    reports = [r for r in metrics(tmp_path) if r["kind"] == "checkpoint"]
    assert [r["step"] for r in reports] == [10, 20]
    log_text = (tmp_path / "train.log").read_text()
    for r, bound in zip(reports, held_bounds(TimedSaver.calls, async_save)):
        step_dir = Path(r["path"])
        on_disk = sum(p.stat().st_size for p in step_dir.iterdir() if p.name != MARKER)
        assert r["written_bytes"] == on_disk > 0, (r, on_disk)
        manifest = read_manifest(step_dir)
        assert manifest["written_bytes"] == on_disk and "blocking_s" not in manifest
        # it holds the export, the save call and the marker phase (slept), and at most what was timed outside
        # (background: export_s ends when the export was filled, which the next forward and backward overlap)
        held = MARKER_DELAY_S + r["save_s"] + (0 if background else r["export_s"])
        assert held < r["blocking_s"] <= bound, (r, bound)
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
