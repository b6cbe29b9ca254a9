"""The recipe's async save with ``optim.state_dict_offload_background`` (issue 17 item 3): the save returns before
the optimizer's export is filled, the loop's next forward and backward overlap it, the wait before ``step()`` is
counted in the checkpoint's ``blocking_s``, the checkpoint equals a synchronous one bitwise, and a non-finite state
is refused on every rank when the save is finalised (no marker, the directory removed). A background export that
fails on one of 2 ranks: tests/distributed/test_dcp_portable.py (background_export_failure)."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers.export import export_state
from recipes.checkpoint import CheckpointError, CheckpointManager, read_checkpoint, read_manifest
from recipes.config import CheckpointConfig
from recipes.job import train
from recipes.train import compose_config
from tests import forked
from tests.distributed.launch import PRELOAD, recipe_ranks
from tests.helpers import assert_bitwise, run_steps
from tests.recipe.runs import BACKGROUND, QUICK, metrics, stopped
from tests.recipe.timed_saves import TimedSaves
from tests.unit.saves import StuckExport

HOLD_S = 0.3  # how long an export is held unfilled after its save call is about to return


def test_the_loop_resumes_before_the_export_is_filled_and_blocking_counts_the_wait(tmp_path, monkeypatch):
    """Each export is held unfilled until its save call is about to return (a loaded machine could fill it before),
    so the call returning first is the saver's doing; the loop's wait for the fill (``wait_export`` before
    ``step()``, timed from outside by the hand-written loop) then counts in ``blocking_s``."""
    gate = StuckExport(monkeypatch).gate
    filling_after_save: list[bool | None] = []

    def open_at_the_write(phase, step, path):
        if phase == "write":  # the save is in flight, the save call is about to return to the loop
            filling_after_save.append(loop.manager.saver.export_filling)
            gate.set()

    loop = TimedSaves(tmp_path, async_save=True, background=True, on_phase=open_at_the_write)
    reports = loop.run(steps=6, every=2, before_save=gate.clear)  # each export held until its call is returning
    assert filling_after_save == [True, True, True]  # every save call returned while its export was being filled
    assert [r.step for r in reports] == [2, 4, 6]
    waits = [t1 - t0 for kind, t0, t1 in loop.calls if kind == "wait_export"]
    assert sum(waits) > 0
    for r, bound in zip(reports, loop.held_bounds(async_save=True), strict=True):
        assert 0 < r.blocking_s <= bound, (r, bound)


def test_the_recipe_s_loop_defers_its_exports_and_counts_the_wait_before_step(tmp_path, monkeypatch):
    """The recipe wired as the hand-written loop above: step 20's export is held until 0.3 s after its save call
    is about to return, so its checkpoint is deferred and the loop's wait before ``step()`` (``wait_export``,
    counted in ``blocking_s``) holds at least the rest of that time."""
    gate = StuckExport(monkeypatch).gate

    def hold_step_20(phase, step, path):
        if (phase, step) == ("marker", 10):  # inside save 20's call, before its export
            gate.clear()
        if (phase, step) == ("write", 20):
            threading.Timer(HOLD_S, gate.set).start()

    train(compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=30", *BACKGROUND]), on_phase=hold_step_20)
    records = {r["step"]: r for r in metrics(tmp_path) if r["kind"] == "checkpoint"}
    assert sorted(records) == [10, 20, 30] and all(r["deferred"] for r in records.values()), records
    assert records[20]["blocking_s"] >= HOLD_S and records[20]["export_s"] >= HOLD_S, records[20]


def test_the_deferred_checkpoints_equal_synchronous_ones_bitwise(tmp_path):
    train(compose_config([*QUICK, f"run_dir={tmp_path / 'bg'}", *BACKGROUND]))
    sync = [
        o.replace("async_save=true", "async_save=false").replace("background=true", "background=false")
        for o in BACKGROUND
    ]
    train(compose_config([*QUICK, f"run_dir={tmp_path / 'sync'}", *sync]))
    for step in (10, 20):
        name = f"step_{step:08d}"
        a = read_checkpoint(tmp_path / "bg" / "checkpoints" / name)
        b = read_checkpoint(tmp_path / "sync" / "checkpoints" / name)
        assert a.keys() == b.keys()
        assert sum(1 for k in a if k.startswith("optim.") and isinstance(a[k], torch.Tensor)) > 0
        for key, value in a.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
            else:
                assert value == b[key], key


def test_async_saves_written_in_a_writer_process_are_the_thread_s_files_and_resume(tmp_path):
    """``checkpoint.write_in_process=true``: each rank's async saves are written by its writer process (the
    forkserver's; the recipe's checksumming writer hands its checksums back), the same data files, recorded in the
    manifest with the same checksums, as the writer thread's; the next launch verifies them and resumes."""
    forked.start_forkserver(PRELOAD)  # the writer process forks from it, torch imported already
    runs = {m: tmp_path / m for m in ("thread", "process")}
    writers: dict[str, set[str]] = {mode: set() for mode in runs}
    for mode, run_dir in runs.items():
        process = f"checkpoint.write_in_process={str(mode == 'process').lower()}"

        def seen(phase: str, step: int, path, mode=mode) -> None:  # the save's write is over at its marker
            writers[mode].update(p.name for p in multiprocessing.active_children() if phase == "marker")

        train(compose_config([*QUICK, f"run_dir={run_dir}", "checkpoint.async_save=true", process]), on_phase=seen)
    assert "optim-factory-writer" in writers["process"] and "optim-factory-writer" not in writers["thread"], writers
    for step in (10, 20):
        files = [read_manifest(run_dir / "checkpoints" / f"step_{step:08d}")["files"] for run_dir in runs.values()]
        data = [{k: v for k, v in f.items() if k.endswith(".distcp")} for f in files]
        assert data[0] == data[1] and len(data[0]) == 2, files
    again = train(compose_config([*QUICK, f"run_dir={runs['process']}", "trainer.max_steps=22"]))
    assert again["resumed_from"].endswith("step_00000020") and again["end_step"] == 22


def test_a_non_finite_deferred_export_is_refused_when_the_save_is_finalised(tmp_path):
    """lr=1e39: step 1's update is inf; the save of step 1 returns, its background check finds it, and the
    wait at the next save or at exit (here: the divergence stop at step 2) refuses it: no step directory."""
    with pytest.raises(CheckpointError) as info:
        train(compose_config([*QUICK, f"run_dir={tmp_path}", "optim.lr=1e39", "checkpoint.every_steps=1", *BACKGROUND]))
    assert str(info.value).startswith("not saving step 1: the model or optimizer state holds non-finite values")
    assert not (tmp_path / "checkpoints").exists()  # made by this launch, which saved nothing: removed again


@pytest.mark.slow
def test_a_non_finite_deferred_export_is_refused_on_both_of_two_ranks(tmp_path):
    run_dir = tmp_path / "run"
    args = [*QUICK, f"run_dir={run_dir}", "optim.lr=1e39", "checkpoint.every_steps=1", *BACKGROUND]
    ranks = recipe_ranks(args, 2, tmp_path / "ranks")
    for rank in ranks:
        assert stopped(rank).startswith("not saving step 1: the model or optimizer state holds non-finite")
    left = [str(p) for p in (run_dir / "checkpoints").rglob("*")]
    assert not (run_dir / "checkpoints").exists(), left  # made by this launch (either rank), saved nothing: removed


@pytest.mark.parametrize("waits_before_step", [False, True], ids=["waits-in-save", "deferred"])
def test_a_step_without_wait_export_never_changes_a_state_being_exported(tmp_path, waits_before_step):
    """A loop that skips wait_export(): step() still waits for the export (the stager takes the export's outcome
    only once it is finished), so the checkpoint holds the state of its step; without ``waits_before_step`` the
    save does not defer at all."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = PortableFusedAdam(
        model.parameters(),
        exp_avg_dtype=torch.bfloat16,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=64,
        state_dict_offload_reuse_buffers=True,
        state_dict_offload_background=True,
    )
    params = list(model.parameters())
    cfg = CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=1, async_save=True)
    manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"), waits_before_step=waits_before_step)
    expected = {}
    for step in (1, 2, 3):
        run_steps(opt, params, step, 1)
        expected[step] = export_state(opt, cpu_offload=True)
        manager.saver.save(step, model, opt, {"step": step})
        assert (manager.saver.export_filling is not None) == waits_before_step  # deferred (filled or not) or not
    manager.saver.close()
    names = {id(p): n for n, p in model.named_parameters()}
    for step, sd in expected.items():
        written = read_checkpoint(tmp_path / "ck" / f"step_{step:08d}")
        for k, st in sd["state"].items():
            for name, v in st.items():
                assert_bitwise(written[f"optim.state.{names[id(params[k])]}.{name}"], v, f"step {step} {k}.{name}")
