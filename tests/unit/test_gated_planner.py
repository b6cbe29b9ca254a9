"""Which async saves ``AsyncSaveStager.async_save`` gates (its GatedPlanner): DCP plans a save with its default
planner while its export fills, and the planning's last step waits for the ranks' verdict (tests/unit/
test_async_save.py); a save it does not gate (a planner of the caller's, ``use_collectives=False``, ``no_dist``:
DCP plans each rank alone, so no rank may wait at a gate for the others) is planned once the export is filled and
its ranks agreed, and is written the same. A refused gated save removes every local directory its planning made,
and only those."""

from __future__ import annotations

import inspect
import sys
import threading
import time

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, SaveRefused, StagerOptions
from optim_factory.checkpoint._gated_planner import GatedPlanner
from optim_factory.checkpoint._record import StagedSave
from tests.unit.saves import (
    OURS,
    PlannedWriter,
    PlanWatcher,
    StuckExport,
    assert_checkpoint,
    expected_tensors,
    export_deferred,
    make_model,
    train,
)

COLLECTIVES_OPTION = "use_collectives" in inspect.signature(dcp.async_save).parameters


@pytest.mark.parametrize("how", ["a planner of the caller's", "use_collectives=False", "no_dist=True"])
def test_a_save_that_is_not_gated_is_planned_after_the_fill_and_written(tmp_path, monkeypatch, how):
    if how.startswith("use_collectives") and not COLLECTIVES_OPTION:
        pytest.skip("this torch's dcp.async_save has no use_collectives")
    stuck = StuckExport(monkeypatch)
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    where = tmp_path / "ck"
    writer = PlannedWriter(str(where))
    kwargs = {"use_collectives": False} if how.startswith("use_collectives") else {}
    kwargs |= {"planner": PlanWatcher()} if how.startswith("a planner") else {}
    kwargs |= {"no_dist": True} if how.startswith("no_dist") else {}
    stuck.gate.clear()
    try:
        stager.async_save(export_deferred(model, opt), storage_writer=writer, **kwargs)
        assert not writer.planned.wait(0.5), f"planned before the export was filled ({how})"
    finally:
        stuck.gate.set()
    stager.wait()
    assert writer.planned.is_set()
    assert_checkpoint(where, expected)
    stager.close()


@pytest.mark.parametrize("given", ["checkpoint_id", "storage_writer", "storage_writer and checkpoint_id", "file:// id"])
def test_a_refused_save_removes_every_directory_its_planning_made_and_no_other(tmp_path, given):
    """A gated save is planned (its writer made the directories) before the refusal removes them; a ``file://`` id
    without a writer (DCP picks fsspec's, whose directories the gate cannot tell) is refused before DCP plans."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(check=lambda staged: "refused by the test"))
    train(model, opt, 1)
    (tmp_path / "runs").mkdir()
    where, elsewhere = tmp_path / "runs" / "new" / "deeper" / "ck", tmp_path / "runs" / "elsewhere"
    writer = PlannedWriter(str(elsewhere if given.endswith("checkpoint_id") else where))
    kwargs = {
        "checkpoint_id": {"checkpoint_id": str(where)},
        "storage_writer": {"storage_writer": writer},
        "storage_writer and checkpoint_id": {"storage_writer": writer, "checkpoint_id": str(where)},
        "file:// id": {"checkpoint_id": f"file://{where}"},
    }[given]
    stager.async_save(export_deferred(model, opt), **kwargs)
    with pytest.raises(SaveRefused, match=r"refused by the test \(rank 0\)$"):
        stager.wait()
    assert writer.planned.is_set() == given.startswith("storage_writer")  # planned: its directories were made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())
    stager.close()


def _waits_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is inside a call of ``function`` (a name of ``_save_end.py``'s) right now."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith("_save_end.py"):
            return True
        frame = frame.f_back
    return False


def test_a_save_started_while_the_previous_is_in_flight_notes_its_directories_once_that_one_is_over(tmp_path):
    """The second save's call waits for the first (in flight, held at its verdict after its planning made ``a/s1``
    and ``a``); both are refused. The first's refusal removes ``a``, the second's planning makes it again, and its
    refusal removes it too: it did not exist when the second save's directories were noted."""
    release = threading.Event()
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(check=lambda staged: release.wait(60) and "refused by the test"))
    train(model, opt, 1)
    first = stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "a" / "s1"))
    while not (tmp_path / "a" / "s1").exists() and not first.upload_completion.done():
        time.sleep(0.01)  # DCP's planning makes the directory before the gate waits for the held verdict
    responses = []
    second = threading.Thread(
        target=lambda: responses.append(
            stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "a" / "s2"))
        )
    )
    second.start()
    while not _waits_in(second, "previous"):  # the second save's call waits for the first to be over
        time.sleep(0.01)
    release.set()
    second.join(60)
    for response in (first, *responses):
        with pytest.raises(SaveRefused, match=r"refused by the test \(rank 0\)$"):
            response.upload_completion.result(60)
    assert len(responses) == 1 and sorted(tmp_path.iterdir()) == []
    stager.close()


def test_a_refusal_removes_the_parents_of_a_directory_another_rank_removed_and_leaves_one_not_empty(tmp_path):
    """The gate's refusal removes what its planning made, deepest first: a directory already gone (another rank's
    refusal removed it) is passed over, its parents still removed; one that is not empty stays."""

    (tmp_path / "kept").mkdir()
    planner = GatedPlanner(None, local=True)  # one process: the agreement is this rank's verdict
    for name in ("gone", "full"):
        planner.save = StagedSave({})
        planner.save.verdict.set_result("refused by the test")
        planner.set_up_planner({}, StorageMeta(checkpoint_id=str(tmp_path / "kept" / name / "ck")))
        (tmp_path / "kept" / name / "ck").mkdir(parents=True)  # the writer's planning
        if name == "gone":
            (tmp_path / "kept" / name / "ck").rmdir()  # another rank's refusal came first
        else:
            (tmp_path / "kept" / name / "file").write_text("someone else's")
        with pytest.raises(SaveRefused, match=r"written: refused by the test \(rank 0\)$"):
            planner.finish_plan(SavePlan([]))
        assert planner.save.refused is not None  # the refusal its save's upload completes with
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["full"]
    assert sorted(p.name for p in (tmp_path / "kept" / "full").iterdir()) == ["file"]
