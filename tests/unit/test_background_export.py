"""``state_dict_offload_background``: ``state_dict()`` returns with the host tensors allocated and a background thread
fills them; ``step()``, ``load_state_dict()`` and ``wait_state_dict()`` wait for it; a failed export raises there
and is never saved (issue 17, item 3)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as dcp

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, deferred_export, defers_export, export_buffer_test, release_export
from optim_factory.optimizers.export import StateExporter, export_state
from recipes.checkpoint import CheckpointError, CheckpointManager, read_checkpoint
from recipes.config import CheckpointConfig
from tests.helpers import (
    LIFECYCLE_CONFIGS,
    LiveSnapshot,
    assert_bitwise,
    assert_state_dicts_bitwise,
    make_params,
    run_steps,
)

HP = dict(lr=1e-2, weight_decay=0.1)
BACKGROUND = dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=64, state_dict_offload_background=True)
# A state large enough that the background export is still running when the test's next call comes: 2M elements
# in 4 KiB chunks are ~2000 chunks per state (tens of ms on this machine). Nothing below depends on timing: the
# assertions hold whether or not the export had finished, but without the waits they fail while it runs.
BIG = [(2048, 1024)]
SLOW = dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=4096, state_dict_offload_background=True)


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reuse"])
@pytest.mark.parametrize("keep_bf16", [False, True], ids=["fp32", "keep-bf16"])
@pytest.mark.parametrize("name,dtype,kw", [c[:3] for c in LIFECYCLE_CONFIGS], ids=[c[0] for c in LIFECYCLE_CONFIGS])
def test_background_export_is_bitwise_the_synchronous_export(name, dtype, kw, reuse, keep_bf16):
    params = make_params(dtype)
    bf16 = torch.bfloat16 in (kw.get("exp_avg_dtype"), kw.get("exp_avg_sq_dtype"))
    # keep_bf16 without a BF16 moment: the option's own warning, expected (other warnings pass on)
    no_effect = pytest.warns(UserWarning, match="state_dict_keep_bf16=True has no effect")
    with no_effect if keep_bf16 and not bf16 else contextlib.nullcontext():
        opt = PortableFusedAdam(
            params, **HP, **kw, **BACKGROUND, state_dict_offload_reuse_buffers=reuse, state_dict_keep_bf16=keep_bf16
        )
    run_steps(opt, params, 0, 3)
    before = LiveSnapshot.take(opt)
    for round_ in range(2):
        sd = _deferred(opt)
        assert opt.state_dict_pending
        opt.wait_state_dict()
        assert not opt.state_dict_pending
        reference = export_state(opt, cpu_offload=True, keep_bf16=keep_bf16)  # per state, synchronous
        assert_state_dicts_bitwise(sd, reference, f"{name} reuse={reuse} keep_bf16={keep_bf16} round {round_}")
        opt.release_state_dict(sd)
    LiveSnapshot.take(opt).assert_same(before)


def _deferred(opt) -> dict:
    """``state_dict()`` as the recipe's manager calls it: inside ``deferred_state_dict()``, returning unfilled."""
    with opt.deferred_state_dict():
        return opt.state_dict()


def test_nested_deferred_blocks_are_re_entrant():
    """An inner ``deferred_state_dict()`` block (a stager's inside a caller's) that closes leaves the outer one
    deferring: an export inside the outer block still returns unfilled, and only outside both does it wait."""
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, **HP, **BACKGROUND)
    run_steps(opt, params, 0, 1)
    with opt.deferred_state_dict():
        with opt.deferred_state_dict():
            pass
        opt.state_dict()
        assert opt.state_dict_pending, "the outer block stopped deferring when the inner one closed"
        opt.wait_state_dict()
    opt.state_dict()
    assert not opt.state_dict_pending, "an export outside every block returned unfilled"


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reuse"])
def test_defers_export_only_into_buffers_nothing_else_writes(reuse):
    """``defers_export`` says yes only where every tensor of a deferred export is a pooled buffer that nothing
    writes until it is released (background into reused buffers: a stager passes those through uncopied once the
    export is waited for). Into fresh host memory it says no: a stager would copy those tensors at staging, before
    the export has filled them. Without a background export, or for another optimizer: no."""
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, **HP, **BACKGROUND, state_dict_offload_reuse_buffers=reuse)
    run_steps(opt, params, 0, 1)
    with deferred_export(opt):
        sd = opt.state_dict()
    leased = [export_buffer_test(opt)(t) for states in sd["state"].values() for t in states.values()]
    assert defers_export(opt) == reuse and leased == [reuse] * len(leased), (reuse, leased)
    opt.wait_state_dict()
    assert release_export(opt, sd) == (len(leased) if reuse else 0)
    synchronous = PortableFusedAdam(params, **HP, state_dict_cpu_offload=True, state_dict_offload_reuse_buffers=True)
    assert not defers_export(synchronous) and not defers_export(torch.optim.AdamW(params))


def _slow_optimizer(**extra):
    params = make_params(torch.float32, shapes=BIG)
    opt = PortableFusedAdam(params, **HP, exp_avg_dtype=torch.bfloat16, **SLOW, **extra)
    run_steps(opt, params, 0, 2)
    return params, opt


def test_step_waits_for_an_in_flight_export():
    params, opt = _slow_optimizer()
    reference = export_state(opt, cpu_offload=True)  # the states at this step boundary
    sd = _deferred(opt)  # returns at once; the background thread fills sd
    assert opt.state_dict_pending
    run_steps(opt, params, 2, 1)  # step() changes every state: it must wait for the export first
    assert not opt.state_dict_pending, "step() ran without waiting for the background export"
    assert_state_dicts_bitwise(sd, reference, "export overlapped by step()")


def test_load_state_dict_and_the_next_export_wait_too():
    params, opt = _slow_optimizer()
    reference = export_state(opt, cpu_offload=True)
    sd = _deferred(opt)
    opt.load_state_dict(reference)  # overwrites every state in place: must wait for the export first
    assert not opt.state_dict_pending
    assert_state_dicts_bitwise(sd, reference, "export overlapped by load_state_dict()")
    first = _deferred(opt)
    second = _deferred(opt)  # waits for the first one (one export in flight at most)
    opt.wait_state_dict()
    assert_state_dicts_bitwise(first, reference, "first of two exports")
    assert_state_dicts_bitwise(second, reference, "second of two exports")


def test_release_waits_for_the_export_that_writes_the_buffers():
    """``release_state_dict`` returns only once the background export that writes the buffers it gives back has
    finished (the next export may take them at once). The export still running is a Future the test finishes: a
    real one's end would race the test's check."""
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, **HP, **BACKGROUND, state_dict_offload_reuse_buffers=True)
    run_steps(opt, params, 0, 1)
    sd = _deferred(opt)
    opt.wait_state_dict()
    running: Future = Future()
    exporter = opt.state_exporter
    exporter._pending, exporter._pending_pid = running, os.getpid()  # the export, still writing sd's buffers
    released: list = []
    release = threading.Thread(target=lambda: released.append(opt.release_state_dict(sd)))
    release.start()
    while release.is_alive() and not running._condition._waiters:  # blocked on the export (CPython's internals)
        time.sleep(0.001)
    assert not released, "release_state_dict returned while the export still wrote the buffers it released"
    running.set_result(None)
    release.join()
    assert released == [sum(len(states) for states in sd["state"].values())]


def _break_a_state(opt) -> tuple[torch.Tensor, int]:
    """Shrink one state's storage to nothing: the background export fails reading it (a real failure, no mock)."""
    state = next(iter(opt.state.values()))["exp_avg"]
    nbytes = state.untyped_storage().nbytes()
    state.untyped_storage().resize_(0)
    return state, nbytes


def test_a_failed_background_export_raises_once_on_wait_or_step():
    params, opt = _slow_optimizer()
    state, nbytes = _break_a_state(opt)
    _deferred(opt)  # returns: the failure happens on the background thread
    with pytest.raises(RuntimeError, match="storage"):
        opt.wait_state_dict()
    opt.wait_state_dict()  # raised once; nothing pending any more
    _deferred(opt)
    with pytest.raises(RuntimeError, match="storage"):
        run_steps(opt, params, 2, 1)  # step() raises before it changes anything
    state.untyped_storage().resize_(nbytes)
    run_steps(opt, params, 2, 1)  # the optimizer goes on once the cause is gone


def test_a_failed_background_export_is_not_saved(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = PortableFusedAdam(model.parameters(), exp_avg_dtype=torch.bfloat16, **BACKGROUND)
    run_steps(opt, list(model.parameters()), 0, 1)
    cfg = CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=1, async_save=True)
    manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"))
    manager.saver.save(1, model, opt, {"step": 1})
    _break_a_state(opt)
    manager.saver.save(2, model, opt, {"step": 2})  # filled (and refused) before the call returns
    with pytest.raises(CheckpointError, match="not saving step 2: the optimizer's background export failed"):
        manager.saver.close()  # the async save's outcome, raised where it is waited for
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_00000001"]


def test_dcp_async_save_through_the_stager_gets_finished_tensors(tmp_path):
    params, opt = _slow_optimizer(state_dict_offload_reuse_buffers=True)
    reference = export_state(opt, cpu_offload=True)
    sd = _deferred(opt)  # still being filled when DCP's async save stages it
    dcp.async_save(
        {"optim": sd}, checkpoint_id=str(tmp_path / "ck"), async_stager=AsyncSaveStager(opt)
    ).upload_completion.result()
    opt.release_state_dict(sd)
    written = read_checkpoint(tmp_path / "ck")
    for k, st in reference["state"].items():
        for name, v in st.items():
            assert_bitwise(written[f"optim.state.{k}.{name}"], v, f"written {k}.{name}")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_recipe_saves_with_background_export_round_trip_flattened(tmp_path, async_save):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    kw = dict(exp_avg_dtype=torch.bfloat16, **BACKGROUND, state_dict_offload_reuse_buffers=True)
    opt = PortableFusedAdam(model.parameters(), **kw)
    params = list(model.parameters())
    cfg = CheckpointConfig(
        dir=str(tmp_path / "ck"), every_steps=1, async_save=async_save, flatten_optimizer_state_dict=True
    )
    manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"))
    expected = {}
    for step in (1, 2):
        run_steps(opt, params, step, 1)
        expected[step] = export_state(opt, cpu_offload=True)
        manager.saver.save(step, model, opt, {"step": step})
    manager.saver.close()
    names = {id(p): n for n, p in model.named_parameters()}
    for step, sd in expected.items():
        written = read_checkpoint(tmp_path / "ck" / f"step_{step:08d}")
        for k, st in sd["state"].items():
            fqn = names[id(params[k])]
            for name, v in st.items():
                assert_bitwise(written[f"optim.state.{fqn}.{name}"], v, f"step {step} {fqn}.{name}")
    # and it loads back: a fresh model and optimizer resume from the newest checkpoint, bitwise
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt2 = PortableFusedAdam(model2.parameters(), **kw)
    run_steps(opt2, list(model2.parameters()), 0, 1)
    loader = CheckpointManager(cfg, rank=0, device=torch.device("cpu"))
    loader.load(tmp_path / "ck" / "step_00000002", model2, opt2, {"step": 0})
    assert_state_dicts_bitwise(export_state(opt2, cpu_offload=True), expected[2], "loaded")


def test_a_plain_reader_never_gets_unfilled_tensors(tmp_path):
    """Outside ``deferred_state_dict()`` the export is waited for before ``state_dict()`` returns, so
    ``torch.save(opt.state_dict())`` and ``dcp.save(get_optimizer_state_dict(...))`` of a background export write
    the moments, not zeros. Broken on purpose (no wait): both read back zeros."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Linear(512, 512)
    opt = PortableFusedAdam(model.parameters(), **HP, exp_avg_dtype=torch.bfloat16, **SLOW)
    run_steps(opt, list(model.parameters()), 0, 2)
    reference = export_state(opt, cpu_offload=True)
    sd = opt.state_dict()
    assert not opt.state_dict_pending
    torch.save(sd, tmp_path / "opt.pt")
    assert_state_dicts_bitwise(torch.load(tmp_path / "opt.pt"), reference, "torch.save of state_dict()")
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "ck"))
    written = read_checkpoint(tmp_path / "ck")
    names = {id(p): n for n, p in model.named_parameters()}
    params = list(model.parameters())
    for k, st in reference["state"].items():
        for name, v in st.items():
            assert_bitwise(written[f"optim.state.{names[id(params[k])]}.{name}"], v, f"dcp.save {k}.{name}")


def test_every_thread_waiting_for_a_failed_export_gets_its_failure():
    """The stager's thread and the loop's step() may wait for one background export at the same time: both get its
    failure (one taking it must not make the other read unfilled buffers as a finished export); a wait that
    starts once it was taken returns."""
    exporter = StateExporter()
    pending: Future = Future()
    exporter._pending, exporter._pending_pid = pending, os.getpid()  # a background export, still running
    outcomes: list = []

    def waiter() -> None:
        try:
            exporter.wait()
            outcomes.append(None)
        except RuntimeError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    while len(pending._condition._waiters) < 2:  # both blocked on the export (CPython's Future internals)
        time.sleep(0.001)
    pending.set_exception(RuntimeError("export failed"))
    for t in threads:
        t.join()
    assert outcomes == ["export failed", "export failed"]
    exporter.wait()  # taken: nothing pending any more
    assert not exporter.pending
