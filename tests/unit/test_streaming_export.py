"""The chunked (streaming) export on CPU: bitwise equal to the per-state export, bounded chunks, buffer reuse
that never overwrites an export still read by an in-flight async DCP save."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager
from optim_factory.optimizers.export import (
    DEFAULT_CHUNK_BYTES,
    ExportPlan,
    HostBufferPool,
    Pinning,
    StateExporter,
    export_state,
    host_memory,
    plan_chunks,
)
from optim_factory.optimizers.export.host_memory import Slot
from recipes.checkpoint import CheckpointManager, read_checkpoint
from recipes.config import CheckpointConfig
from tests.helpers import (
    LIFECYCLE_CONFIGS,
    LiveSnapshot,
    assert_bitwise,
    assert_state_dicts_bitwise,
    clone_params,
    deep_clone,
    local,
    make_params,
    run_steps,
)

HP = dict(lr=1e-2, weight_decay=0.1)
# many chunks per state: the largest test state (33 elements, 132 bytes) spans 3 chunks of 64 bytes
BUDGETS = [64, 100, 1 << 20]
SHAPES = [(8, 5), (5,), (3, 4, 2), (33,), (0,), (200, 3)]


def _options(chunk: int | None, reuse: bool = False) -> dict:
    return dict(
        state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=chunk, state_dict_offload_reuse_buffers=reuse
    )


def _storages(sd: dict) -> set[int]:
    return {local(v).untyped_storage().data_ptr() for st in sd["state"].values() for v in st.values() if v.numel()}


def _pool_allocations(monkeypatch) -> list[torch.Tensor]:
    """The host buffers that pools allocate from now on, in order: a pool buffer not pinned by allocation is a
    ``host_empty`` of ``host_memory``."""
    allocated, fresh = [], host_memory.host_empty

    def recorded(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        allocated.append(fresh(shape, dtype))
        return allocated[-1]

    monkeypatch.setattr(host_memory, "host_empty", recorded)
    return allocated


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _live_storages(opt) -> set[int]:
    return {local(v).untyped_storage().data_ptr() for st in opt.state.values() for v in st.values() if v.numel()}


@pytest.mark.parametrize("name,dtype,kw", [c[:3] for c in LIFECYCLE_CONFIGS], ids=[c[0] for c in LIFECYCLE_CONFIGS])
def test_cpu_offload_alone_streams_in_64_mib_chunks(name, dtype, kw, monkeypatch):
    """``state_dict_cpu_offload=True`` with no other export option is the chunked export (64 MiB chunks),
    bitwise the per-state export; ``state_dict_offload_chunk_bytes=0`` is the per-state export itself."""
    streamed = []
    stream = StateExporter.stream
    monkeypatch.setattr(
        StateExporter, "stream", lambda self, items, chunk: streamed.append(chunk) or stream(self, items, chunk)
    )
    params = make_params(dtype, shapes=SHAPES)
    opt = PortableFusedAdam(params, **HP, state_dict_cpu_offload=True, **kw)
    run_steps(opt, params, 0, 3)
    assert opt.state_dict_offload_chunk_bytes == DEFAULT_CHUNK_BYTES == 64 << 20
    assert_state_dicts_bitwise(opt.state_dict(), export_state(opt, cpu_offload=True), name)
    assert streamed == [DEFAULT_CHUNK_BYTES]
    per_state = PortableFusedAdam(params, **HP, state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=0, **kw)
    per_state.load_state_dict(opt.state_dict())
    assert_state_dicts_bitwise(per_state.state_dict(), opt.state_dict(), name)
    assert streamed == [DEFAULT_CHUNK_BYTES] * 3  # opt's three exports; per_state streamed none


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reuse"])
@pytest.mark.parametrize("chunk", BUDGETS)
@pytest.mark.parametrize("name,dtype,kw", [c[:3] for c in LIFECYCLE_CONFIGS], ids=[c[0] for c in LIFECYCLE_CONFIGS])
def test_chunked_export_is_bitwise_the_per_state_export(name, dtype, kw, chunk, reuse):
    params = make_params(dtype, shapes=SHAPES)
    opt = PortableFusedAdam(params, **HP, **_options(chunk, reuse), **kw)
    run_steps(opt, params, 0, 3)
    before = LiveSnapshot.take(opt)
    for round_ in range(3):
        sd = opt.state_dict()
        reference = export_state(opt, cpu_offload=True)  # the per-state export
        LiveSnapshot.take(opt).assert_same(before)
        assert_state_dicts_bitwise(sd, reference, f"{name} chunk={chunk} round {round_}")
        for st, ref in zip(sd["state"].values(), reference["state"].values()):
            for state_name, v in st.items():
                assert v.device.type == "cpu" and v.is_contiguous() and v.stride() == ref[state_name].stride()
        assert not _storages(sd) & _live_storages(opt), "the export aliases live state"
        previous = _storages(sd)
        released = opt.release_state_dict(sd)
        assert released == (sum(len(st) for st in sd["state"].values()) if reuse else 0)
        run_steps(opt, params, 3 + round_, 1)
        before = LiveSnapshot.take(opt)
        if reuse:
            assert _storages(opt.state_dict()) == previous  # the released buffers came back

    # restore from a chunked export, continue: bitwise equal to the uninterrupted run
    exported = deep_clone(opt.state_dict())
    restored_params = clone_params(params)
    restored = PortableFusedAdam(restored_params, **HP, **_options(chunk, reuse), **kw)
    restored.load_state_dict(exported)
    run_steps(opt, params, 10, 3)
    run_steps(restored, restored_params, 10, 3)
    for a, b in zip(params, restored_params):
        assert_bitwise(a, b, f"{name} param after resume from a chunked export")


def test_plan_packs_pieces_within_the_budget_and_covers_every_element_once():
    params = make_params(torch.float32, shapes=[(1000,), (3,), (0,), (77, 3), (1,)])
    opt = PortableFusedAdam(params, exp_avg_dtype=torch.bfloat16, **_options(256))
    run_steps(opt, params, 0, 1)
    plan = ExportPlan(opt.export_options, opt.state_exporter)  # reuse_buffers=False
    items = [plan.item(opt, p, i, n) for i, p in enumerate(params) for n in opt.state[p]]
    for budget in (64, 256, 4000, 1 << 20):
        chunks = plan_chunks(items, budget)
        covered = {id(it): [] for it in items}
        for chunk in chunks:
            last = chunk[-1]
            assert last.offset + (last.stop - last.start) * last.item.dst.element_size() <= budget
            assert all(p.offset % 64 == 0 for p in chunk)
            for p in chunk:
                covered[id(p.item)].append((p.start, p.stop))
        for it in items:
            ranges = covered[id(it)]
            assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] if ranges else it.dst.numel() == 0
            assert (ranges[-1][1] if ranges else 0) == it.dst.numel()
    assert len(plan_chunks(items, 64)) >= 2 * 1000 * 4 // 64  # exp_avg and exp_avg_sq of the 1000-element state alone


def test_unreleased_exports_are_never_overwritten_and_memory_stays_flat(monkeypatch):
    params = make_params(torch.float32, shapes=SHAPES)
    opt = PortableFusedAdam(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16, **_options(64, True))
    allocated = _pool_allocations(monkeypatch)
    run_steps(opt, params, 0, 1)
    kept = opt.state_dict()
    frozen = deep_clone(kept)
    for step in range(10):  # export, step, export: the kept (unreleased) export never changes
        run_steps(opt, params, 1 + step, 1)
        other = opt.state_dict()
        assert not _storages(other) & _storages(kept)
        assert opt.release_state_dict(other) == sum(len(st) for st in other["state"].values())
        assert opt.release_state_dict(other) == 0  # released once only
        if step == 1:
            allocated_after_2 = _nbytes(allocated)
    assert allocated_after_2 > 0  # the pool allocates through host_empty (what the next line counts)
    assert _nbytes(allocated) == allocated_after_2  # one set of buffers, reused: no growth over 10 exports
    assert_state_dicts_bitwise(kept, frozen, "kept export")
    assert opt.release_state_dict({"state": {0: {"exp_avg": torch.zeros(3)}}}) == 0  # not ours: ignored
    assert all(opt.is_leased_export_buffer(v) for st in kept["state"].values() for v in st.values())
    assert opt.release_state_dict(kept) == sum(len(st) for st in kept["state"].values())
    assert not any(opt.is_leased_export_buffer(v) for st in kept["state"].values() for v in st.values())


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(state_dict_offload_chunk_bytes=1 << 20), "needs state_dict_cpu_offload=True"),
        (dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=8), "expected None"),
        (dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes="64 MB"), "chunk_bytes='64 MB': expected"),
        (
            dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=0, state_dict_offload_reuse_buffers=True),
            "needs state_dict_offload_chunk_bytes != 0",
        ),
        (dict(state_dict_cpu_offload="yes"), "expected True or False"),
    ],
)
def test_bad_export_options_are_one_line_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as info:
        PortableFusedAdam(make_params(torch.float32), **kwargs)
    assert "\n" not in str(info.value)


class _GatedWriter(FileSystemWriter):
    """A real filesystem writer whose ``write_data`` waits until the test opens the gate: the save is then
    certainly in flight while the test keeps training and exporting."""

    def __init__(self, path: str, gate: threading.Event):
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan, planner):
        assert self.gate.wait(60), "the test never opened the gate"
        return super().write_data(plan, planner)


def test_buffers_read_by_an_in_flight_async_save_are_never_overwritten(tmp_path):
    params = make_params(torch.float32, shapes=SHAPES)
    opt = PortableFusedAdam(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8, **_options(64, True))
    run_steps(opt, params, 0, 2)
    sd = opt.state_dict()
    expected = deep_clone(sd)
    gate = threading.Event()
    path = str(tmp_path / "in-flight")
    # the export buffers go to the writer un-copied (the CheckpointManager's stager), so DCP reads them late
    future = dcp.async_save({"optim": sd}, storage_writer=_GatedWriter(path, gate), async_stager=AsyncSaveStager(opt))
    try:
        for step in range(3):  # training and exporting go on while the save waits at the gate
            run_steps(opt, params, 2 + step, 1)
            other = opt.state_dict()
            assert not _storages(other) & _storages(sd), "an export reused a buffer of the in-flight save"
            opt.release_state_dict(other)
    finally:
        gate.set()
    future.upload_completion.result()
    written = read_checkpoint(tmp_path / "in-flight")
    for k, st in expected["state"].items():
        for state_name, v in st.items():
            assert_bitwise(written[f"optim.state.{k}.{state_name}"], v, f"checkpoint {k}.{state_name}")
    assert opt.release_state_dict(sd) > 0  # the save is over: now they may be reused
    assert _storages(opt.state_dict()) & _storages(expected) == set()


def test_checkpoint_manager_releases_export_buffers_only_after_the_save(tmp_path, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = PortableFusedAdam(model.parameters(), exp_avg_dtype=torch.bfloat16, **_options(64, True))
    allocated = _pool_allocations(monkeypatch)
    cfg = CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=1, async_save=True)
    manager = CheckpointManager(cfg, rank=0, device=torch.device("cpu"))
    expected = {}
    for step in (1, 2, 3):
        run_steps(opt, list(model.parameters()), step, 1)
        expected[step] = export_state(opt, cpu_offload=True)
        manager.saver.save(step, model, opt, {"step": step})
        assert allocated and all(opt.is_leased_export_buffer(t) for t in allocated), (
            "export buffers released while their async save may still read them"
        )
        if step == 1:
            manager.saver.wait()
            assert not all(opt.is_leased_export_buffer(t) for t in allocated)  # the save is over: back in the pool
    manager.saver.close()
    for step, sd in expected.items():
        written = read_checkpoint(tmp_path / "ck" / f"step_{step:08d}")
        names = {id(p): n for n, p in model.named_parameters()}
        for k, st in sd["state"].items():
            fqn = names[id(opt.param_groups[0]["params"][k])]
            for state_name, v in st.items():
                assert_bitwise(written[f"optim.state.{fqn}.{state_name}"], v, f"step {step} {fqn}.{state_name}")


def test_prepare_readies_the_buffers_of_the_next_export(monkeypatch):
    params = make_params(torch.float32, shapes=SHAPES)
    opt = PortableFusedAdam(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8, **_options(64, True))
    assert PortableFusedAdam(make_params(torch.float32), **_options(64)).prepare_state_dict() is None  # no reuse
    run_steps(opt, params, 0, 2)
    allocated = _pool_allocations(monkeypatch)
    opt.prepare_state_dict().result()
    prepared = _nbytes(allocated)
    states = sum(local(v).numel() * 4 for st in opt.state.values() for v in st.values())
    assert prepared == states  # one FP32 buffer per state
    opt.prepare_state_dict()  # a second prepare adds nothing, and the export waits for it
    sd = opt.state_dict()
    # the export took the prepared buffers (none left over, none allocated)
    assert all(opt.is_leased_export_buffer(t) for t in allocated) and _nbytes(allocated) == prepared
    assert opt.release_state_dict(sd) == sum(len(st) for st in sd["state"].values())
    assert not any(opt.is_leased_export_buffer(t) for t in allocated)  # all the prepared bytes are free again
    assert_state_dicts_bitwise(sd, export_state(opt, cpu_offload=True), "export into prepared buffers")


def test_a_pool_s_released_buffers_are_freed_on_its_own_thread():
    """``HostBufferPool.clear``: a released buffer is freed (a pinned one unpinned) on the pool's thread, which
    makes the pool's device current, not on the caller's (whose CUDA device may be GPU 0 of another rank)."""
    pool = HostBufferPool()
    slot = Slot("state", (4096,), torch.float32, Pinning.none)
    pool.prepare([slot]).result()  # the pool's thread started, the buffer allocated there
    freed_on = []
    buf = pool.take(slot)
    weakref.finalize(buf, lambda: freed_on.append(threading.current_thread().name))
    pool.release(buf)
    del buf
    assert pool.free_bytes() == 4096 * 4
    pool.clear()
    assert pool.free_bytes() == 0 and len(freed_on) == 1 and freed_on[0].startswith("export-pin"), freed_on


def test_waiting_for_pinning_keeps_a_failed_preparation_and_starts_no_thread(monkeypatch):
    """``prepare([])`` waits for the pinning of released buffers only: a failed ``prepare_state_dict()`` before it
    is still reported by the next export, and a pool that never pinned anything starts no thread for it."""
    before = set(threading.enumerate())
    assert HostBufferPool().prepare([]).done()  # nothing to pin: done at once
    assert not any(t.name.startswith("export-pin") for t in set(threading.enumerate()) - before)
    params = make_params(torch.float32, shapes=SHAPES)
    opt = PortableFusedAdam(params, exp_avg_dtype=torch.bfloat16, **_options(64, True))
    run_steps(opt, params, 0, 1)

    def refused(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        raise MemoryError("no host memory for the test")

    monkeypatch.setattr(host_memory, "host_empty", refused)
    assert isinstance(opt.prepare_state_dict().exception(), MemoryError)
    opt.state_exporter.pool.prepare([]).result()
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="preparing export buffers failed: MemoryError"):
        sd = opt.state_dict()
    assert_state_dicts_bitwise(sd, export_state(opt, cpu_offload=True), "export after a failed preparation")
