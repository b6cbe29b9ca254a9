"""Which async saves ``AsyncSaveStager.async_save`` gates (its GatedWriter): DCP plans a gated save while
its export fills; a save it does not gate (``use_collectives=False``, a ``checkpoint_id`` with ``://``, whose writer
DCP picks) is planned once the export is filled and its ranks agreed, and is written the same. A refused gated save
removes every local directory its planning made, and only those."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.checkpoint as dcp

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, SaveRefused, StagerOptions
from tests.unit.saves import (
    OURS,
    PlanWatcher,
    StuckExport,
    assert_checkpoint,
    expected_tensors,
    export_deferred,
    make_model,
    train,
)

COLLECTIVES_OPTION = "use_collectives" in inspect.signature(dcp.async_save).parameters


@pytest.mark.parametrize("how", ["use_collectives=False", "file:// id"])
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
    kwargs = {"use_collectives": False} if how.startswith("use_collectives") else {}
    checkpoint_id = f"file://{where}" if how == "file:// id" else str(where)
    planner = PlanWatcher()
    stuck.gate.clear()
    try:
        stager.async_save(export_deferred(model, opt), checkpoint_id=checkpoint_id, planner=planner, **kwargs)
        assert not planner.planned.wait(0.5), f"planned before the export was filled ({how})"
    finally:
        stuck.gate.set()
    stager.wait()
    assert planner.planned.is_set()
    assert_checkpoint(where, expected)
    stager.close()


def test_a_refused_save_removes_every_directory_its_planning_made_and_no_other(tmp_path):
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(check=lambda staged: "refused by the test"))
    train(model, opt, 1)
    (tmp_path / "runs").mkdir()
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "runs" / "new" / "deeper" / "ck"))
    with pytest.raises(SaveRefused, match=r"refused by the test \(rank 0\)$"):
        stager.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())
    stager.close()
