"""AsyncSaveStager's rules through plain DCP, in one process: a save started with DCP's own
``dcp.async_save(..., async_stager=stager)`` gives the export's buffers back at the next save (two sets at most,
reused); every optimizer's failed export refuses the save, not only the first one's; a save within a host budget
whose largest tensor and the copies made at its start exceed the budget is refused in one line, not started."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, BudgetRefused, SaveRefused, deferred_export, least_host_budget
from optim_factory.rules.export import size_text
from tests.unit.saves import OURS, Optim, make_model, train
from tests.unit.test_budget import STATE, _trained
from tests.unit.test_budget import train as one_step


def _leased(opt, osd: dict) -> list[torch.Tensor]:
    return [t for st in osd["state"].values() for t in st.values() if opt.is_leased_export_buffer(t)]


def test_dcp_s_own_async_save_with_the_stager_gives_the_buffers_back_at_the_next_save(tmp_path):
    """Six saves through ``dcp.async_save(..., async_stager=stager)``: each one's buffers go back when the next is
    staged, so the exports alternate between two sets of buffers (the export in between takes the second)."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt)
    seen: set[int] = set()
    per_save = None
    for save in range(6):
        train(model, opt, 1)
        with deferred_export(opt):
            msd, osd = get_state_dict(model, opt)
        buffers = _leased(opt, osd)
        per_save = per_save or len(buffers)
        assert len(buffers) == per_save > 0
        seen |= {t.data_ptr() for t in buffers}
        response = dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / f"s{save}"), async_stager=stager, no_dist=True
        )
        response.upload_completion.result()
    assert len(seen) <= 2 * per_save, f"six saves used {len(seen)} export buffers, not two sets of {per_save}"
    stager.close()
    assert not _leased(opt, osd), "close() kept the last save's buffers"


def test_any_optimizer_s_failed_export_refuses_the_save_not_only_the_first_s(tmp_path):
    model = make_model()
    first = PortableFusedAdam(model[0].parameters(), lr=1e-3, **OURS)
    second = PortableFusedAdam(model[2].parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager([first, second])
    for opt in (first, second):
        train(model, opt, 1)
    state = next(iter(second.state.values()))["exp_avg"]  # the second's export fails reading it (no mock)
    nbytes = state.untyped_storage().nbytes()
    state.untyped_storage().resize_(0)
    with deferred_export(first), deferred_export(second):
        saved = {"model": get_state_dict(model, [])[0], "first": first.state_dict(), "second": second.state_dict()}
    response = stager.async_save(saved, checkpoint_id=str(tmp_path / "bad"))
    response.staging_completion.result()
    with pytest.raises(SaveRefused, match="^not saved, nothing was written: the optimizer's background export fail"):
        stager.wait()
    assert not (tmp_path / "bad").exists()
    state.untyped_storage().resize_(nbytes)
    stager.close()


def test_a_budget_below_the_largest_tensor_and_the_copies_made_at_the_start_is_refused_in_one_line(tmp_path):
    """Budget 8 MiB: a tensor the optimizer's ``step()`` does not change (6 MiB, copied when the save starts) fits
    it alone, and so does the largest state (4 MiB), but not both: refused before anything is written, and the
    next ``step()`` runs."""
    model, opt = _trained(2 * STATE)
    stager = AsyncSaveStager(opt)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": torch.ones(6 << 18)}
    outcome: list[BaseException | None] = []

    def save() -> None:  # on a thread: a save that does not refuse holds the writer and step() (the test ends)
        try:
            stager.async_save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True).upload_completion.result()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    thread.join(60)
    assert outcome, "the save neither refused nor finished"
    line = str(outcome[0])
    assert isinstance(outcome[0], (ValueError, SaveRefused)) and "\n" not in line, repr(outcome[0])
    assert "state_dict_offload_host_budget=8388608: the tensors the optimizer's step() does not" in line, line
    assert f"a budget of at least {size_text(STATE + (6 << 20))} ({STATE + (6 << 20)} bytes)" in line, line
    one_step(model, opt)
    assert not list(tmp_path.glob("ck/*.distcp"))
    stager.close()


@pytest.mark.parametrize("no_dist", [False, True], ids=["collectives", "no_dist"])
def test_copies_at_the_start_beyond_the_budget_are_refused_in_one_line_naming_the_least_budget(tmp_path, no_dist):
    """9 MiB copied when the save starts, beyond the budget (8 MiB) alone: the save's refusal is that line with the
    least budget (the copies and the largest state), agreed before DCP plans (a save within a budget plans with its
    own planner), not DCP's planning of a save that never started."""
    model, opt = _trained(2 * STATE)
    stager = AsyncSaveStager(opt)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": torch.ones(9 << 18)}
    response = stager.async_save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=no_dist)
    with pytest.raises((BudgetRefused, SaveRefused)) as info:
        response.upload_completion.result()
    line = str(info.value)
    least = f"take {9 << 20} bytes, and the largest tensor it fills {STATE}: a budget of at least "
    least += f"{size_text(STATE + (9 << 20))} ({STATE + (9 << 20)} bytes)"
    assert "state_dict_offload_host_budget=8388608: the tensors the optimizer's step() does not" in line, line
    assert least in line and "\n" not in line, line
    one_step(model, opt)
    assert not list(tmp_path.glob("ck/*.distcp"))
    stager.close()


@pytest.mark.parametrize("where", ["the caller's block", "async_save's own export of a Stateful"])
def test_the_stager_s_exporting_block_defers_a_background_export_into_pooled_buffers(tmp_path, where):
    """``with stager.exporting():`` is the one block around a save's export, and ``async_save`` exports a
    ``Stateful`` inside it itself: a background export into pooled buffers returns unfilled there, and the save
    writes what the export holds."""
    from tests.helpers import record_exports
    from tests.unit.saves import assert_checkpoint, expected_tensors

    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    exports = record_exports(opt)
    if where == "the caller's block":
        with stager.exporting():
            msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": model.state_dict(), "optim": Optim(model, opt)}
    stager.async_save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert [pending for _, pending in exports] == [True]
    stager.wait()
    assert_checkpoint(tmp_path / "ck", expected)


@pytest.mark.parametrize("short", [0, 1], ids=["least", "one-byte-less"])
def test_least_host_budget_is_the_budget_a_save_needs_to_the_byte(tmp_path, short):
    """``least_host_budget`` (the rule a trainer checks before its first step) is the planner's own: a save within
    exactly that budget is written, one byte less is refused at its start in the line naming that least budget."""
    extra = torch.ones(3 << 18)  # 3 MiB copied at the start
    least = None
    for budget in (64 << 20, None):  # the least budget of this save, then a save within it (or one byte less)
        model, opt = _trained(budget or least.nbytes - short)
        stager = AsyncSaveStager(opt)
        with stager.exporting():
            msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": extra}
        least = least or least_host_budget(opt, state)
        if budget:
            stager.close()
    assert (least.early, least.largest) == (3 << 20, STATE)
    response = stager.async_save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    if short:
        with pytest.raises((ValueError, SaveRefused), match=rf"a budget of at least \S+ \({least.nbytes} bytes\)"):
            response.upload_completion.result()
    else:
        response.upload_completion.result()
        assert list(tmp_path.glob("ck/*.distcp"))
    stager.close()
