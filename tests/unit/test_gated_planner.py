"""Which async saves ``AsyncSaveStager.async_save`` gates (its GatedPlanner): DCP plans a save with its default
planner while its export fills, and the planning's last step waits for the ranks' verdict (tests/unit/
test_async_save.py); a save it does not gate (a planner of the caller's, ``use_collectives=False``, ``no_dist``:
DCP plans each rank alone, so no rank may wait at a gate for the others) is planned once the export is filled and
its ranks agreed, and is written the same. A refused gated save removes every local directory its planning made,
and only those."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.checkpoint as dcp

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, SaveRefused, StagerOptions
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
