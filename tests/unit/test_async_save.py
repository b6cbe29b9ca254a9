"""optim_factory.checkpoint.AsyncSaveStager through plain DCP: the export's buffers go to the writer uncopied and
back once written, a background export completes beside training, any other optimizer is staged as DCP stages
it, and every failure (the export's, the write's, an export that never fills, one rank's) is one line on every
rank with nothing written and the previous checkpoint intact (2 forked gloo ranks for the last)."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, SaveRefused, StagerOptions
from optim_factory.tree import state_bytes
from recipes.checkpoint import read_checkpoint
from tests.distributed.launch import spawn
from tests.helpers import assert_bitwise
from tests.unit.saves import (
    OURS,
    PlannedWriter,
    StuckExport,
    assert_checkpoint,
    expected_tensors,
    export_deferred,
    make_model,
    train,
)


def _leased(opt, state: dict) -> list[torch.Tensor]:
    return [t for st in state["optim"]["state"].values() for t in st.values() if opt.is_leased_export_buffer(t)]


class _HeldWriter(PlannedWriter):
    """DCP's file writer whose ``write_data`` waits until the test opens the gate (a write still in flight), or
    fails when ``fail`` is set (a write that fails); ``planned`` is set when DCP's planning reaches it."""

    def __init__(self, path: str, gate: threading.Event | None = None, fail: bool = False):
        super().__init__(path)
        self.gate, self.fail, self.written = gate, fail, False

    def write_data(self, plan, planner):
        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
        if self.fail:
            raise OSError("No space left on device (injected)")
        written = super().write_data(plan, planner)
        self.written = True
        return written


def test_a_plain_dcp_async_loop_saves_bitwise_with_the_export_uncopied_and_its_buffers_reused(tmp_path):
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    staged: list[dict] = []  # what DCP's writer reads, seen by the stager's check
    stager = AsyncSaveStager(opt, StagerOptions(check=staged.append))
    seen: list[set[int]] = []
    for save in range(3):
        train(model, opt, 2)
        expected = expected_tensors(model, opt)
        state = export_deferred(model, opt)
        buffers = _leased(opt, state)
        assert buffers, "the export holds no pooled buffer"
        response = stager.async_save(state, checkpoint_id=str(tmp_path / f"s{save}"))
        response.staging_completion.result()
        train(model, opt, 1)  # the next step may run once staged: the checkpoint holds the values before it
        response.upload_completion.result()
        stager.wait()
        written = [t for st in staged[-1]["optim"]["state"].values() for t in st.values()]
        assert {t.data_ptr() for t in written} == {t.data_ptr() for t in buffers}, "the export was copied"
        assert staged[-1]["model"]["0.weight"].data_ptr() != model[0].weight.data_ptr(), "the model was not"
        # what it held: the model's copies and the export's pooled buffers, each storage once
        assert stager.save_host_bytes == state_bytes(staged[-1]) > state_bytes(staged[-1]["optim"]), "host bytes"
        assert not _leased(opt, state), "the export's buffers were not given back once written"
        seen.append({t.data_ptr() for t in buffers})
        assert_checkpoint(tmp_path / f"s{save}", expected)
    assert seen[0] == seen[1] == seen[2], "the next export did not reuse the buffers the last save gave back"
    stager.close()


def test_a_changed_state_dict_is_planned_anew_beside_another_stager_s_saves(tmp_path):
    """Every save writes exactly its own state dict (keys and dtypes), when a key comes, changes dtype or goes
    between saves, and with another stager's saves of another state dict in between (DCP's plan cache, for one,
    compares no dtypes: a stager that planned with it would write the first dtype's metadata)."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager, other = AsyncSaveStager(opt), AsyncSaveStager()
    extras = [{}, {}, {"extra": torch.arange(5.0)}, {"extra": torch.arange(5.0).bfloat16()}, {}]
    for save, extra in enumerate(extras):
        train(model, opt, 1)
        expected = {**expected_tensors(model, opt), **extra}
        stager.async_save({**export_deferred(model, opt), **extra}, checkpoint_id=str(tmp_path / f"s{save}"))
        stager.wait()
        other.async_save({"x": torch.full((3,), float(save))}, checkpoint_id=str(tmp_path / f"o{save}"))
        other.wait()
        written = read_checkpoint(tmp_path / f"s{save}")
        assert ("extra" in written) == bool(extra), f"s{save}: keys {sorted(written)}"
        assert_checkpoint(tmp_path / f"s{save}", expected)
        assert_bitwise(read_checkpoint(tmp_path / f"o{save}")["x"], torch.full((3,), float(save)), "o")
    stager.close()
    other.close()


def test_any_other_optimizer_is_staged_as_dcp_stages_it(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stager = AsyncSaveStager(opt)
    train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    expected = {f"model.{k}": v.clone() for k, v in msd.items()}
    expected.update(
        {f"optim.state.{k}.{n}": v.clone() for k, st in osd["state"].items() for n, v in st.items() if n != "step"}
    )
    gate = threading.Event()  # the write waits until the live tensors have changed
    response = stager.async_save(
        {"model": msd, "optim": osd}, storage_writer=_HeldWriter(str(tmp_path / "adamw"), gate)
    )
    response.staging_completion.result()
    train(model, opt, 1)  # changes the live tensors in place: the checkpoint holds the staged copies
    gate.set()
    stager.wait()
    assert_checkpoint(tmp_path / "adamw", expected)
    assert stager.save_host_bytes == state_bytes({"model": msd, "optim": osd}), "a copy of every tensor is held"
    stager.close()


def _break_a_state(opt) -> tuple[torch.Tensor, int]:
    """Shrink one state's storage to nothing: the background export fails reading it (a real failure, no mock)."""
    state = next(iter(opt.state.values()))["exp_avg"]
    nbytes = state.untyped_storage().nbytes()
    state.untyped_storage().resize_(0)
    return state, nbytes


def _after_a_good_save(tmp_path: Path, **stager_options):
    """(model, optimizer, stager, the good checkpoint's expected tensors): one save written into ``good``."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(**stager_options))
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "good"))
    stager.wait()
    return model, opt, stager, expected


def test_a_failing_export_refuses_the_save_in_one_line_and_writes_nothing(tmp_path):
    model, opt, stager, expected = _after_a_good_save(tmp_path)
    state, nbytes = _break_a_state(opt)
    broken = export_deferred(model, opt)
    response = stager.async_save(broken, checkpoint_id=str(tmp_path / "bad"))
    response.staging_completion.result()  # the loop goes on: the refusal is the save's
    with pytest.raises(SaveRefused) as info:
        stager.wait()
    line = str(info.value)
    assert line.startswith("not saved, nothing was written: the optimizer's background export failed"), line
    assert "(rank 0)" in line and "\n" not in line
    assert not (tmp_path / "bad").exists()
    assert_checkpoint(tmp_path / "good", expected)
    state.untyped_storage().resize_(nbytes)
    train(model, opt, 1)  # the optimizer goes on once the cause is gone, and so do the saves
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "next"))
    stager.wait()
    assert (tmp_path / "next" / ".metadata").is_file()
    stager.close()


def test_a_failing_write_gives_the_buffers_back_and_leaves_the_previous_checkpoint(tmp_path):
    model, opt, stager, expected = _after_a_good_save(tmp_path)
    train(model, opt, 1)
    state = export_deferred(model, opt)
    stager.async_save(state, storage_writer=_HeldWriter(str(tmp_path / "bad"), fail=True))
    with pytest.raises(RuntimeError, match="^the async save failed: .*No space left on device") as info:
        stager.wait()
    assert "\n" not in str(info.value)
    assert not _leased(opt, state), "a failed write kept the export's buffers"
    assert not (tmp_path / "bad" / ".metadata").exists()
    assert_checkpoint(tmp_path / "good", expected)
    stager.close()


def test_a_save_started_while_the_previous_one_writes_waits_for_it(tmp_path):
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    gate = threading.Event()
    first_writer = _HeldWriter(str(tmp_path / "first"), gate)
    first_done: list[bool] = []  # at each staging: whether the first save's files were written
    stager = AsyncSaveStager(opt, StagerOptions(check=lambda staged: first_done.append(first_writer.written)))
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    first = stager.async_save(export_deferred(model, opt), storage_writer=first_writer)
    first.staging_completion.result()
    train(model, opt, 1)
    second_state = export_deferred(model, opt)  # the first save still holds its buffers: this export takes others
    second = threading.Thread(
        target=lambda: stager.async_save(second_state, checkpoint_id=str(tmp_path / "second")), daemon=True
    )
    second.start()
    gate.set()  # the second save can only stage once the first is written
    second.join(60)
    assert not second.is_alive(), "the second save never started"
    stager.wait()
    assert first_done == [False, True], "the second save staged while the first one still wrote"
    assert_checkpoint(tmp_path / "first", expected)
    assert (tmp_path / "second" / ".metadata").is_file()
    stager.close()


def test_close_with_a_save_in_flight_finishes_it_and_releases_everything(tmp_path):
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    state = export_deferred(model, opt)
    gate = threading.Event()
    response = stager.async_save(state, storage_writer=_HeldWriter(str(tmp_path / "ck"), gate))
    assert not response.upload_completion.done()  # the gate holds the write
    threading.Timer(0.05, gate.set).start()  # the write ends while close() waits for it
    stager.close()
    assert not _leased(opt, state) and stager.host_bytes == 0
    assert_checkpoint(tmp_path / "ck", expected)
    with pytest.raises(RuntimeError, match="^AsyncSaveStager: closed; build a new one for further saves$"):
        stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "after"))
    opt.wait_state_dict()


def test_an_export_that_never_fills_refuses_the_save_after_the_timeout(tmp_path, monkeypatch):
    gate = StuckExport(monkeypatch).gate
    model, opt, stager, expected = _after_a_good_save(tmp_path, export_timeout_s=0.2)
    gate.clear()
    train(model, opt, 1)
    stuck = export_deferred(model, opt)
    stager.async_save(stuck, checkpoint_id=str(tmp_path / "stuck"))
    with pytest.raises(SaveRefused, match="background export did not fill within 0.2 s") as info:
        stager.wait()
    assert "\n" not in str(info.value)
    assert not (tmp_path / "stuck").exists()
    assert _leased(opt, stuck), "buffers the stuck export still writes were given back"
    assert_checkpoint(tmp_path / "good", expected)
    gate.set()
    opt.wait_state_dict()  # the export finishes once unblocked; the optimizer goes on
    train(model, opt, 1)
    stager.close()


@pytest.mark.parametrize("waited", [False, True], ids=["async", "waited"])
def test_an_export_into_fresh_memory_that_never_fills_refuses_the_save_and_then_saves_again(
    tmp_path, monkeypatch, waited
):
    """Refused after the timeout (not held: its buffers stay with the export), then the next save works."""
    gate = StuckExport(monkeypatch).gate
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **{**OURS, "state_dict_offload_reuse_buffers": False})
    stager = AsyncSaveStager(opt, StagerOptions(export_timeout_s=0.2))
    train(model, opt, 1)
    gate.clear()
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    save = stager.save if waited else lambda *a, **k: stager.async_save(*a, **k).upload_completion.result()
    with pytest.raises(SaveRefused, match="background export did not fill within 0.2 s"):
        save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "stuck"))
    assert not (tmp_path / "stuck").exists()
    gate.set()
    opt.wait_state_dict()  # the export finishes once unblocked
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "next"))
    assert_checkpoint(tmp_path / "next", expected)
    stager.close()


def test_dcp_plans_while_the_export_fills_and_writes_once_it_is_filled(tmp_path, monkeypatch):
    """The save's DCP planning runs while the loop waits for the export (not beside the steps after it); its
    writer waits for the filled state, so the checkpoint holds the values of the save's moment."""
    stuck = StuckExport(monkeypatch)
    model, opt, stager, _ = _after_a_good_save(tmp_path)
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    stuck.gate.clear()
    writer = _HeldWriter(str(tmp_path / "ck"))
    try:  # the gate opens whatever happens: a held export would hold DCP's upload thread at exit
        response = stager.async_save(export_deferred(model, opt), storage_writer=writer)
        assert writer.planned.wait(30), "DCP did not plan before the export was filled"
        assert not response.staging_completion.done() and not response.upload_completion.done()
        assert not writer.written, "written before the export was filled"
    finally:
        stuck.gate.set()
    response.staging_completion.result()
    train(model, opt, 1)
    stager.wait()
    assert_checkpoint(tmp_path / "ck", expected)
    stager.close()


class _NoPlan(FileSystemWriter):
    """DCP's file writer whose planning fails (before the export is filled, now that DCP plans at once)."""

    def prepare_local_plan(self, plan):
        raise OSError("Permission denied (injected)")


def test_a_save_that_fails_in_planning_keeps_an_unfilled_export_s_buffers_and_ends(tmp_path, monkeypatch):
    """DCP's planning fails while the export is not filled: the save ends with DCP's failure once the export's
    timeout refuses it, and the buffers the export still writes stay with it (a give-back would wait for it)."""
    stuck = StuckExport(monkeypatch)
    model, opt, stager, _ = _after_a_good_save(tmp_path, export_timeout_s=0.2)
    train(model, opt, 1)
    stuck.gate.clear()
    try:
        state = export_deferred(model, opt)
        stager.async_save(state, storage_writer=_NoPlan(str(tmp_path / "bad")))
        waiter = threading.Thread(target=lambda: pytest.raises(RuntimeError, stager.wait), daemon=True)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "the failed save never ended"
        assert _leased(opt, state), "buffers the unfilled export still writes were given back"
    finally:
        stuck.gate.set()
    opt.wait_state_dict()
    stager.close()


def test_a_check_that_returns_no_line_is_named(tmp_path):
    """A ``check`` returning ``True`` refuses in a line naming what it returned."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(check=lambda staged: True))
    train(model, opt, 1)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "true"))
    with pytest.raises(SaveRefused, match=r"check returned True: a refusal line \(str\) or None saves \(rank 0\)$"):
        stager.wait()
    stager.close()


def test_a_refusal_leaves_a_directory_that_was_there_and_names_every_reason_pickled(tmp_path):
    """The directory a refused save was to write into is left as it was (one DCP's planning made is removed
    again: the tests above); DCP gathers a write's failure pickled, and the refusal keeps its reasons so."""
    model, opt, stager, _ = _after_a_good_save(tmp_path)
    (tmp_path / "there").mkdir()
    state, nbytes = _break_a_state(opt)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "there"))
    with pytest.raises(SaveRefused) as info:
        stager.wait()
    assert list((tmp_path / "there").iterdir()) == []
    assert pickle.loads(pickle.dumps(info.value)).reasons == info.value.reasons
    state.untyped_storage().resize_(nbytes)
    stager.close()


def one_rank_refuses(rank: int, world: int, tmp: str, built_first: bool) -> None:
    """Rank 1's export fails, rank 0's does not: both refuse the save in the same line, nothing is written. With
    ``built_first`` the stager is built before the ranks' process group exists (it makes its own at its first save)."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    if built_first:
        dist.destroy_process_group()
        stager = AsyncSaveStager(opt)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    else:
        stager = AsyncSaveStager(opt)  # its own gloo group for the agreement
    train(model, opt, 1)
    stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/good")
    stager.wait()
    assert stager.process_group is not None and stager.process_group != dist.group.WORLD
    if rank == 1:
        state, nbytes = _break_a_state(opt)
    response = stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/bad")
    response.staging_completion.result()
    if rank == 1:
        state.untyped_storage().resize_(nbytes)
    try:
        stager.wait()
    except SaveRefused as exc:
        assert "background export failed" in str(exc) and "(rank 1)" in str(exc) and "(rank 0)" not in str(exc)
    else:
        raise AssertionError(f"rank {rank}: saved although rank 1's export failed")
    dist.barrier()
    assert not Path(tmp, "bad").exists() and Path(tmp, "good", ".metadata").is_file()
    stager.close()


def close_ends_its_group(rank: int, world: int, tmp: str) -> None:
    """close() destroys the stager's own gloo group and lets it go: its threads end now, not in the interpreter's
    exit, where one still releasing a collective's tensors aborts the process ("terminate called without an active
    exception", one run in several of the docs loop under torchrun)."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt)
    for step in (1, 2):
        train(model, opt, 1)
        stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/step{step}")
    stager.wait()
    running = _gloo_threads()
    stager.close()
    for _ in range(1000):  # the group's destructor joins its threads
        if _gloo_threads() < running:
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError(f"rank {rank}: the stager's gloo group still runs after close()")
    assert stager.process_group is None


def _gloo_threads() -> int:
    """The live threads of this process's gloo groups (Linux: /proc names them)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return names.count("pt_gloo_runloop")


@pytest.mark.slow
def test_close_ends_the_stager_s_own_group_and_its_threads(tmp_path):
    spawn(close_ends_its_group, 2, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("built_first", [False, True], ids=["built-after-init", "built-before-init"])
def test_one_rank_s_failed_export_refuses_the_save_on_every_rank(tmp_path, built_first):
    spawn(one_rank_refuses, 2, str(tmp_path), built_first)


def test_the_docs_async_loop_runs_as_written(tmp_path, monkeypatch):
    """docs/export.md's plain DCP loop, on one process: both of its checkpoints are written."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    block = re.search(r"<!-- async-save-loop -->\n```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/export.md async-save-loop", "exec"), {"__name__": "__main__"})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    assert all((p / ".metadata").is_file() for p in (tmp_path / "checkpoints").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("options", ["StagerOptions()", "StagerOptions(write_in_process=True)"])
def test_the_docs_async_loop_runs_on_two_ranks_under_torchrun(tmp_path, options):
    """The loop under ``torchrun --nproc_per_node=2``, ended by the interpreter's exit as a user's is (ranks forked by
    ``script_ranks`` skip it; there a group left running aborted one run in several): DCP's collectives of each
    save run on the stager's gloo group, never beside the training's on the default group (there they mismatch: an
    abort or a hang). As written and with the options the docs name in its place (a writer process per rank, which
    imports the script again: its guard keeps the loop from running there)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    loop = re.search(r"<!-- async-save-loop -->\n```python\n(.*?)```", text, re.S).group(1)
    assert loop.count("StagerOptions()") == 1
    (tmp_path / "loop.py").write_text(loop.replace("StagerOptions()", options))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "loop.py"]
    # the loop as written runs on the CPU (gloo): on a GPU machine fully_shard would take a GPU per rank
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    assert all((p / ".metadata").is_file() for p in (tmp_path / "checkpoints").iterdir())


def test_a_stager_of_no_optimizer_or_a_save_to_nowhere_is_one_line_at_the_call(tmp_path):
    model = make_model()
    refused = r"^AsyncSaveStager\(optimizers=\.\.\.\): expected torch optimizers, got Linear$"
    for wrong in (model[0], [model[0]]):  # a module, alone or in a list
        with pytest.raises(TypeError, match=refused):
            AsyncSaveStager(wrong)
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    state = export_deferred(model, opt)
    for name in ("async_save", "save"):  # each refusal names the method called
        with pytest.raises(ValueError, match=rf"^AsyncSaveStager.{name}: give checkpoint_id= \(or storage_writer=\)"):
            getattr(stager, name)(state)
        with pytest.raises(
            TypeError,
            match=rf"^AsyncSaveStager.{name}\(pinned=...\): a StagerOptions field, not the save's; give it to the "
            r"stager: AsyncSaveStager\(optimizers, StagerOptions\(pinned=...\)\)$",
        ):
            getattr(stager, name)(state, checkpoint_id=str(tmp_path / "ck"), pinned=False)
    stager.async_save(state, checkpoint_id=str(tmp_path / "ck"))  # nothing was staged by the refused call
    stager.wait()
    assert (tmp_path / "ck" / ".metadata").is_file()
    stager.close()


def test_a_failure_giving_the_buffers_back_is_the_save_s_failure_not_a_hang(tmp_path, monkeypatch):
    """A save whose buffers cannot go back (here the filler's end raising) fails in one line at its wait and
    completion: the give-back runs in a done-callback, where an exception would only be logged and its waiters
    would wait forever. Broken on purpose (the give-back's failure left to the callback): ``wait()`` blocks."""
    model, opt, stager, _ = _after_a_good_save(tmp_path)

    def end():
        raise OSError("injected")

    monkeypatch.setattr(stager._filler, "end", end)
    train(model, opt, 1)
    response = stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "next"))
    done = threading.Event()
    failure: list[BaseException] = []

    def waits() -> None:
        try:
            stager.wait()
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)
        done.set()

    threading.Thread(target=waits, daemon=True).start()
    assert done.wait(60), "stager.wait() never returned"
    assert [str(f) for f in failure] == [
        "the async save failed: RuntimeError: giving the save's buffers back failed: OSError: injected"
    ]
    assert response.upload_completion.done()
    monkeypatch.undo()
    stager.close()


def test_an_export_into_fresh_host_memory_is_counted_in_the_host_bytes_a_save_held(tmp_path):
    """The export's fresh host tensors are copied again (they are not pooled buffers) and held until the write:
    ``save_host_bytes`` counts both, and not the training's own tensors. Broken on purpose (counting the copies
    only): the export's bytes are missing."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, state_dict_cpu_offload=True)
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    stager.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "fresh"))
    stager.wait()
    copies = state_bytes({"model": msd, "optim": osd})
    assert stager.save_host_bytes == copies + state_bytes(osd["state"]), (stager.save_host_bytes, copies)
    stager.close()


@pytest.mark.parametrize("reuse_buffers", [True, False], ids=["pooled", "fresh"])
def test_a_waited_save_copies_nothing_and_writes_what_the_async_save_writes(tmp_path, reuse_buffers):
    """``AsyncSaveStager.save``: DCP's writer reads the caller's tensors and the export's buffers as they are (no
    host copy is made or kept, the training's own tensors are not counted as held), and the files are the async
    save's, byte for byte; a background export, deferred by ``exporting()``, is filled before the write."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **{**OURS, "state_dict_offload_reuse_buffers": reuse_buffers})
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True))
    train(model, opt, 1)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    stager.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "waited"))
    assert stager.host_bytes == 0  # no copies kept
    assert stager.save_host_bytes == state_bytes(osd["state"]), stager.save_host_bytes  # the export's buffers only
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    stager.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "async"))
    stager.wait()
    assert (tmp_path / "waited" / "__0_0.distcp").read_bytes() == (tmp_path / "async" / "__0_0.distcp").read_bytes()
    stager.close()


def test_a_failed_background_export_into_fresh_memory_refuses_the_save_instead_of_raising_at_the_export(tmp_path):
    """``exporting()`` defers it too; the save call fills it before copying it, and its failure is the save's
    refusal, agreed by every rank (one rank raising at its export would leave the others in DCP's collectives)."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **{**OURS, "state_dict_offload_reuse_buffers": False})
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    state, nbytes = _break_a_state(opt)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)  # returns: the failure is not raised here
    response = stager.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "bad"))
    with pytest.raises(SaveRefused, match="^not saved, nothing was written: the optimizer's background export fail"):
        response.upload_completion.result()
    assert not (tmp_path / "bad").exists()
    state.untyped_storage().resize_(nbytes)
    train(model, opt, 1)  # nothing of the failure reaches step()
    stager.close()


def test_a_background_export_into_fresh_memory_is_filled_before_the_save_copies_it(tmp_path, monkeypatch):
    """Its export thread is held until just after ``exporting()`` returned: a copy made at once would be of
    unfilled memory."""
    gate = StuckExport(monkeypatch).gate
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **{**OURS, "state_dict_offload_reuse_buffers": False})
    stager = AsyncSaveStager(opt)
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    gate.clear()
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    threading.Timer(0.2, gate.set).start()
    stager.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "fresh"))
    stager.wait()
    assert_checkpoint(tmp_path / "fresh", expected)
    stager.close()


def test_discard_gives_an_unsaved_export_s_buffers_back_and_takes_its_failure(tmp_path):
    """An export that no save stages (its checkpointer failed before saving): its pooled buffers go back, and a
    failed background export's failure is taken (the next ``step()`` does not raise it)."""
    model, opt, stager, _ = _after_a_good_save(tmp_path)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    assert _leased(opt, {"optim": osd})
    stager.discard({"model": msd, "optim": osd})
    assert not _leased(opt, {"optim": osd})
    state, nbytes = _break_a_state(opt)
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)  # its export fails on the thread that fills it
    stager.discard({"model": msd, "optim": osd})
    state.untyped_storage().resize_(nbytes)
    train(model, opt, 1)  # the failure was taken: step() goes on
    stager.close()
