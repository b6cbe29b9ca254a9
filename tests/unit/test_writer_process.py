"""``StagerOptions(write_in_process=True)``: an ``AsyncSaveStager``'s async saves written by a writer process of the
rank's own (DCP's planning and writing outside the training process), started at the first save and kept, ended by
``close()``; the same files as the stager's thread; the staged tensors handed over in shared memory, uncopied; a
writer process killed inside a write fails that save in one line, the previous checkpoint intact, and the next save
starts a new one; on 2 gloo ranks (DTensor shards) the same files per rank, and one rank's refusal refuses the save
on every rank before anything is written."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import mmap
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, SaveRefused, StagerOptions, _writer_process
from optim_factory.optimizers.export import all_finite, give_pages_back, host_empty, shared_empty
from tests import forked
from tests.distributed.launch import PRELOAD, spawn
from tests.unit.saves import (
    OURS,
    GatedFileWriter,
    assert_checkpoint,
    data_files,
    expected_tensors,
    export_deferred,
    make_model,
    train,
)
from tests.unit.test_budget import CHUNK, STATE, _peak_added, _trained
from tests.unit.test_budget import train as _budget_train
from tests.unit.test_budget_async import save_plain


@pytest.fixture(autouse=True, scope="module")
def _forkserver_with_torch():
    """The writer processes fork from this process's forkserver: started with torch imported, each starts at once."""
    forked.start_forkserver(PRELOAD)


def _leased(opt, state: dict) -> list[torch.Tensor]:
    return [t for st in state["state"].values() for t in st.values() if opt.is_leased_export_buffer(t)]


def _saves(tmp: Path, in_process: bool, saves: int = 2, model=None) -> tuple[AsyncSaveStager, list[dict]]:
    """``saves`` async saves (one training step before each) of a fresh model and optimizer, into
    ``tmp/<thread|process><n>``; (the stager, left open, and what each save staged). With a writer process, the
    export's pooled buffers are in shared memory from the export on (never moved there by the hand-over)."""
    model = make_model() if model is None else model
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    staged: list[dict] = []
    stager = AsyncSaveStager(opt, StagerOptions(check=staged.append, write_in_process=in_process))
    for n in range(saves):
        train(model, opt, 1)
        expected = expected_tensors(model, opt)
        state = export_deferred(model, opt)
        exported = _leased(opt, state["optim"])
        assert exported and all(t.is_shared() == in_process for t in exported), "the export's memory"
        stager.async_save(state, checkpoint_id=str(tmp / f"{_mode(in_process)}{n}"))
        stager.wait()
        assert_checkpoint(tmp / f"{_mode(in_process)}{n}", expected)
    return stager, staged


@pytest.mark.parametrize("in_process", [False, True], ids=["thread", "writer-process"])
def test_a_save_leaves_no_reference_cycle_holding_what_it_held(in_process, tmp_path):
    """What a save held (its record and futures, its tensors, DCP's metadata) is freed by reference counts once it
    is over: in a reference cycle it would wait for a garbage collection, a long one, inside some later step."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    # a check that takes a moment: the staging completes after the write is set up (its callbacks are kept)
    stager = AsyncSaveStager(opt, StagerOptions(check=lambda _: time.sleep(0.05), write_in_process=in_process))
    train(model, opt, 1)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "first"))
    stager.wait()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection would free is kept in gc.garbage instead
    try:
        for n in range(2):
            train(model, opt, 1)
            stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / f"again{n}"))
            stager.wait()
        gc.collect()
        held = [
            o
            for o in gc.garbage
            if isinstance(o, (torch.Tensor, Future))
            or type(o).__module__.startswith(("optim_factory", "torch.distributed.checkpoint"))
        ]
        kinds = sorted({type(o).__name__ for o in held})
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
        stager.close()
    assert not kinds, kinds


def _mode(in_process: bool) -> str:
    return "process" if in_process else "thread"


def test_a_writer_process_writes_the_thread_s_files_from_shared_memory_and_close_ends_it(tmp_path, caplog):
    thread, _ = _saves(tmp_path, in_process=False)
    thread.close()
    with caplog.at_level(logging.INFO, logger="optim_factory.checkpoint"):
        stager, staged = _saves(tmp_path, in_process=True)
    pid = stager.writer_pid
    assert pid is not None and pid != os.getpid(), "no writer process of its own"
    # said once in the log, as it started (the recipe's train.log has it)
    started = [r.getMessage() for r in caplog.records if "writer process started" in r.getMessage()]
    assert started == [f"writer process started (pid {pid}): this rank's async saves are written there"], started
    for n in range(2):
        assert data_files(tmp_path / f"process{n}") == data_files(tmp_path / f"thread{n}"), f"save {n} differs"
    # handed over uncopied: every staged tensor in shared memory, the same storages from save to save
    for first, second in zip(staged[0]["model"].values(), staged[1]["model"].values()):
        assert first.is_shared() and first.data_ptr() == second.data_ptr()
    exported = [[t.data_ptr() for st in save["optim"]["state"].values() for t in st.values()] for save in staged]
    assert exported[0] == exported[1], "the export's pooled buffers were not reused"
    assert stager.writer_pid == pid, "a second writer process"
    stager.close()
    assert stager.writer_pid is None and not Path(f"/proc/{pid}").exists(), "close() left the writer process"


def test_an_export_leased_before_its_memory_is_made_shared_is_copied_and_let_go_never_moved(tmp_path):
    """An export the caller holds when the stager makes the export's memory shared: saved, its buffers are copied
    into shared memory, not moved there by the hand-over's pickling (on CUDA its pinned memory would be freed while
    still registered, and a later registration at that address refused); given back, they are let go, not reused."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    train(model, opt, 1)
    held = export_deferred(model, opt)  # held when the stager is made
    expected = expected_tensors(model, opt)
    before = _leased(opt, held["optim"])
    where = [t.data_ptr() for t in before]
    assert before and not any(t.is_shared() for t in before)
    stager = AsyncSaveStager(opt, StagerOptions(write_in_process=True))
    try:
        stager.async_save(held, checkpoint_id=str(tmp_path / "held"))
        stager.wait()
        assert_checkpoint(tmp_path / "held", expected)
        assert [t.data_ptr() for t in before] == where, "the hand-over moved a held buffer"
        assert not any(t.is_shared() for t in before), "the hand-over moved a held buffer into shared memory"
        train(model, opt, 1)
        expected = expected_tensors(model, opt)
        state = export_deferred(model, opt)
        exported = _leased(opt, state["optim"])
        assert exported and all(t.is_shared() for t in exported), "a buffer leased before was reused"
        stager.async_save(state, checkpoint_id=str(tmp_path / "ck"))
        stager.wait()
        assert_checkpoint(tmp_path / "ck", expected)
    finally:
        stager.close()


def test_the_host_s_finite_check_runs_in_the_writer_process_before_it_writes(tmp_path, monkeypatch):
    """A NaN in a host tensor: the training process reads no host tensor for it (this process's ``all_finite`` is
    watched; the writer process's is its own), the writer process refuses the save in one line naming the tensor,
    nothing written, and serves the next save."""
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True, write_in_process=True))
    read_here: list[int] = []
    watched = "optim_factory.checkpoint._finite_check.all_finite"  # what the check reads with, in this process
    monkeypatch.setattr(watched, lambda ts: read_here.append(1) or all_finite(ts))
    try:
        train(model, opt, 1)
        stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "first"))
        stager.wait()
        pid, weight = stager.writer_pid, next(model.parameters())
        with torch.no_grad():
            weight.view(-1)[0] = float("nan")
        response = stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "refused"))
        with pytest.raises(SaveRefused, match=r"non-finite values \(NaN/inf\): model\.\S+ \(rank 0\)$"):
            response.upload_completion.result()
        assert not (tmp_path / "refused").exists()
        with torch.no_grad():
            weight.view(-1)[0] = 0.0
        stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "after"))
        stager.wait()
        assert (tmp_path / "after" / ".metadata").exists() and stager.writer_pid == pid
        assert not read_here, "the training process checked host tensors"
    finally:
        stager.close()


class _ThreadsSeen(FileSystemWriter):
    """A writer that notes torch's thread count where it writes; ``take_written`` gives it back to the caller's."""

    threads: int | None = None

    def write_data(self, plan, planner):
        self.threads = torch.get_num_threads()
        return super().write_data(plan, planner)

    def take_written(self, copy: _ThreadsSeen) -> None:
        self.threads = copy.threads


def test_the_writer_process_runs_torch_on_the_threads_it_is_given(tmp_path, monkeypatch):
    """The writer process's torch work (the finite check's host part) runs on ``TORCH_THREADS`` threads, given to it
    as it starts: not on the count it would inherit (torch's default, or ``OMP_NUM_THREADS``: 1 in the suite's
    workers), so here a count neither gives."""
    monkeypatch.setattr(_writer_process, "TORCH_THREADS", 3)
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True, write_in_process=True))
    try:
        train(model, opt, 1)
        writer = _ThreadsSeen(str(tmp_path / "save"))
        stager.async_save(export_deferred(model, opt), storage_writer=writer)
        stager.wait()
        assert writer.threads == 3
    finally:
        stager.close()


def test_a_writer_process_killed_inside_a_write_fails_that_save_in_one_line_and_the_next_save_works(tmp_path):
    model = make_model()
    stager, _ = _saves(tmp_path, in_process=True, saves=1, model=model)
    opt = stager.optimizers[0]
    good, first = expected_tensors(model, opt), stager.writer_pid
    train(model, opt, 1)
    writer = GatedFileWriter(str(tmp_path / "killed"), gate=str(tmp_path / "never"))
    state = export_deferred(model, opt)
    stager.async_save(state, storage_writer=writer)
    for _ in range(2000):  # the writer process waits at the gate: planning is done, nothing is written yet
        if (tmp_path / "killed").is_dir():
            break
        time.sleep(0.01)
    os.kill(first, signal.SIGKILL)
    with pytest.raises(RuntimeError) as info:
        stager.wait()
    line = str(info.value)
    assert "\n" not in line and f"writer process (pid {first}) ended with exit code -9" in line, line
    assert not (tmp_path / "killed" / ".metadata").exists()
    assert_checkpoint(tmp_path / "process0", good)  # the previous checkpoint, intact
    leased = _leased(opt, state["optim"])
    assert not leased, "the failed save kept the export's buffers"
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "after"))
    stager.wait()
    assert_checkpoint(tmp_path / "after", expected)
    assert stager.writer_pid not in (None, first), "the next save did not start a new writer process"
    stager.close()


@pytest.mark.parametrize("room", [2, 0], ids=["room-for-two", "at-its-limit"])
def test_a_save_the_writer_process_cannot_receive_is_one_line_naming_its_limit_and_the_next_save_works(room, tmp_path):
    """The writer process's open-files limit below the storages a save sends (``room`` free descriptor numbers below
    it; with none it can open nothing to receive with): the save fails in the training process with the writer
    process's one line naming the limit, nothing written, the previous checkpoint intact."""
    model = make_model()
    stager, _ = _saves(tmp_path, in_process=True, saves=1, model=model)
    opt = stager.optimizers[0]
    good, pid = expected_tensors(model, opt), stager.writer_pid
    opened = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    # the limit bounds a new descriptor's number (the lowest free one): ``room`` free numbers below it
    limit = [n for n in range(max(opened) + room + 2) if n not in opened][room]
    hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))  # fewer than the save's storages
    train(model, opt, 1)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "cut"))
    with pytest.raises(RuntimeError) as info:
        stager.wait()
    line = str(info.value)
    assert "\n" not in line, line
    assert (
        "the async save failed: OSError: a save's shared-memory file descriptors did not all arrive (open-files "
        f"limit {limit}: raise it with ulimit -n)"
    ) in line, line
    assert not (tmp_path / "cut").exists()
    assert_checkpoint(tmp_path / "process0", good)
    train(model, opt, 1)
    expected = expected_tensors(model, opt)
    stager.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "after"))  # a new writer process
    stager.wait()
    assert_checkpoint(tmp_path / "after", expected)
    stager.close()


class UnpicklableWriter(FileSystemWriter):
    """DCP's file writer holding a lock: it cannot be pickled to a writer process."""

    def __init__(self, path: str):
        super().__init__(path)
        self.lock = threading.Lock()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie until its parent reaps it, or gone: reaped before its stat file
    was opened, or between the open and the read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _until(condition, seconds: float = 30) -> bool:
    """Whether ``condition()`` became true within ``seconds`` (asked every 10 ms)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _ended(pid: int) -> None:
    """Wait until process ``pid`` (this process's child) has exited: its sockets closed, a zombie until reaped."""
    assert _until(lambda: _gone(pid), 60), f"process {pid} did not end"


@contextlib.contextmanager
def _port_thief(stealing: bool) -> Iterator[list[int]]:
    """While inside: where ``stealing``, the port of every (address, port) the ranks are told over
    ``broadcast_object_list`` (the writers' store) is bound at once by this process, then let go; yields each try's
    errno (0: the port was free, so another process could have taken it)."""
    real, tried = dist.broadcast_object_list, []

    def broadcast_then_steal(*args, **kwargs):
        real(*args, **kwargs)
        told = (args[0] if args else kwargs["object_list"])[0]
        if stealing and isinstance(told, tuple) and len(told) == 2 and isinstance(told[1], int):
            with socket.socket() as thief:
                try:
                    thief.bind(("", told[1]))
                    tried.append(0)
                except OSError as exc:
                    tried.append(exc.errno)

    dist.broadcast_object_list = broadcast_then_steal
    try:
        yield tried
    finally:
        dist.broadcast_object_list = real


@contextlib.contextmanager
def _no_store_server(refusing: bool) -> Iterator[None]:
    """While inside: where ``refusing``, no ``TCPStore`` server starts in this process (its constructor raises)."""
    real = dist.TCPStore

    def no_server(*args, **kwargs):
        if kwargs.get("is_master"):
            raise RuntimeError("no server here (the test's)")
        return real(*args, **kwargs)

    dist.TCPStore = no_server if refusing else real
    try:
        yield
    finally:
        dist.TCPStore = real


def two_ranks(rank: int, world: int, tmp: str) -> None:
    """FSDP's DTensor shards on 2 gloo ranks: the writer processes (a gloo group of their own, on a store of theirs
    under torchrun's environment too) write each rank's file as the stager's thread does; a NaN on rank 1 refuses
    the next save on both ranks (the writer processes agree on it), nothing written; a save rank 1 cannot hand over
    is refused on both (none waits in DCP's collectives for it), and the next save works; rank 1's writer process
    killed between saves fails the next save on both, and the one after works. The writers' store is served by
    the time any rank learns its port: another process that tries to take it then (rank 1 here) cannot; a store
    that rank 0 cannot start refuses that save on both ranks, and the next save starts it."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as torchrun sets it: the writers' store is theirs still
    mesh = init_device_mesh("cpu", (world,))
    files = {}
    for in_process in (False, True):
        model = make_model()
        fully_shard(model, mesh=mesh)
        opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
        stager = AsyncSaveStager(opt, StagerOptions(refuse_non_finite=True, write_in_process=in_process))
        train(model, opt, 1)
        if in_process:
            with _no_store_server(rank == 0):
                stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/no_store")
                with pytest.raises(SaveRefused, match=r"the writer processes' store did not start: .*\(rank 1\)$"):
                    stager.wait()
            assert not Path(tmp, "no_store").exists()
        with _port_thief(rank == 1) as tried:
            stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/{_mode(in_process)}")
            stager.wait()
        assert tried == ([errno.EADDRINUSE] if in_process and rank == 1 else []), (rank, tried)
        dist.barrier()
        files[in_process] = data_files(Path(tmp, _mode(in_process)))
    assert files[True] == files[False] and len(files[True]) == world, sorted(files[True])
    pid, first = stager.writer_pid, next(iter(model.parameters())).to_local().view(-1)
    kept = first[0].item()
    if rank == 1:
        with torch.no_grad():
            first[0] = float("nan")
    stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/refused")
    with pytest.raises(SaveRefused, match=r"\(rank 1\)"):
        stager.wait()
    dist.barrier()
    assert not Path(tmp, "refused").exists()
    with torch.no_grad():
        first[0] = kept
    stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/after")
    stager.wait()
    assert stager.writer_pid == pid, "a refused save started the writer process again"
    # a save only rank 1 cannot hand over (its writer does not pickle): handed over by neither, refused on both
    writer = UnpicklableWriter(f"{tmp}/unpicklable") if rank == 1 else FileSystemWriter(f"{tmp}/unpicklable")
    open_files = len(os.listdir("/proc/self/fd"))
    stager.async_save(export_deferred(model, opt), storage_writer=writer)
    with pytest.raises(SaveRefused, match=r"not handed to the writer process: TypeError: .*\(rank 1\)$"):
        stager.wait()
    # rank 0 pickled its save, which is never sent: nothing of it stays open (its storages' descriptors are theirs,
    # sent beside the pickle only once it is sent)
    closed = _until(lambda: len(os.listdir("/proc/self/fd")) <= open_files)
    assert closed, (rank, open_files, os.listdir("/proc/self/fd"))
    stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/again")  # new writer processes
    stager.wait()
    # rank 1's writer process killed between saves: the next save fails on both ranks (a failure, not a refusal),
    # both start new writer processes, and the save after works
    if rank == 1:
        os.kill(stager.writer_pid, signal.SIGKILL)
        _ended(stager.writer_pid)
    dist.barrier()
    stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/peer")
    with pytest.raises(RuntimeError) as failed:
        stager.wait()
    assert not isinstance(failed.value, SaveRefused), failed.value
    stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/restarted")
    stager.wait()
    # another group than the stager's: refused before anything is staged
    mirrors = r"async_save\(process_group=\.\.\.\): the writer processes' group mirrors the stager's"
    with pytest.raises(ValueError, match=mirrors):
        stager.async_save(export_deferred(model, opt), checkpoint_id=f"{tmp}/other", process_group=dist.group.WORLD)
    assert not Path(tmp, "other").exists()
    stager.close()


@pytest.mark.slow
def test_two_ranks_write_the_thread_s_files_and_refuse_together(tmp_path):
    spawn(two_ranks, 2, str(tmp_path))


def test_dcp_s_own_async_save_with_a_writer_process_s_stager_is_one_line(tmp_path):
    model = make_model()
    opt = PortableFusedAdam(model.parameters(), lr=1e-3, **OURS)
    stager = AsyncSaveStager(opt, StagerOptions(write_in_process=True))
    train(model, opt, 1)
    with pytest.raises(RuntimeError, match=r"start its saves with stager.async_save"):
        dcp.async_save(export_deferred(model, opt), checkpoint_id=str(tmp_path / "s"), async_stager=stager)
    assert not (tmp_path / "s").exists() and stager.writer_pid is None
    stager.close()


def _shared_resident(pid: int | None = None) -> int:
    """Bytes of shared memory resident in this process (or process ``pid``): ``RssShmem``, the shared pages it has
    mapped and touched (gone once removed from the shared file), whatever other processes hold in /dev/shm."""
    for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssShmem")


def _budget_saves(tmp: Path, budget: int, in_process: bool) -> tuple[AsyncSaveStager, int]:
    """Three async saves within ``budget`` into ``tmp/<thread|process><n>``, the first two with a step at once (it
    waits for the fills), each with a trainer's tensor of 1 MiB (copied when the save starts); (the stager, left
    open, and the bytes the third save added to this process's peak: the step's own temporaries, a fresh process's
    first ones above all, are not the save's)."""
    model, opt = _trained(budget)
    stager = AsyncSaveStager(opt, StagerOptions(write_in_process=in_process))
    trainer = {"position": torch.arange(1 << 18, dtype=torch.float32)}

    def save(n: int, step: bool) -> None:
        with stager.exporting():
            msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "trainer": trainer}
        response = stager.async_save(state, checkpoint_id=str(tmp / f"{_mode(in_process)}{n}"), no_dist=True)
        if step:
            _budget_train(model, opt)
        response.upload_completion.result()

    save(0, step=True)
    save(1, step=True)
    return stager, _peak_added(lambda: save(2, step=False))


def budget_in_a_writer_process(rank: int, world: int, folder: str) -> None:
    """The writer process's saves within a budget against the thread's, measured in this forked process (the peak
    resident memory of a process that ran other tests depends on them: their threads, their freed memory)."""
    tmp_path, budget = Path(folder), 2 * STATE + (1 << 20)  # two states and the trainer's copy
    thread, _ = _budget_saves(tmp_path, budget, in_process=False)
    thread.close()
    shared = _shared_resident()
    stager, added = _budget_saves(tmp_path, budget, in_process=True)
    assert stager.writer_pid not in (None, os.getpid())
    for n in range(3):
        assert data_files(tmp_path / f"process{n}") == data_files(tmp_path / f"thread{n}"), f"save {n} differs"
    # the fills' staging ring, and DCP's, the threads' and Python's own beyond the budget: -0.02 to +0.1 MB measured
    # beyond the ring in a forked process (a writer process's later saves; the first starts it)
    assert added <= budget + 2 * CHUNK + (1 << 20), added
    assert 0 < stager.budget_peak_bytes <= budget and stager.host_bytes == 0
    assert _shared_resident() <= shared, "the fills' shared memory was not given back"
    # the writer process holds none of it between saves either (the trainer's copy, its planner's)
    assert _shared_resident(stager.writer_pid) < (1 << 20), "the writer process kept the save's shared memory"
    stager.close()
    whole = 3 * 12 * (1024 * 1024 + 1024) * 4  # the parameters and their two states, FP32
    kept, _ = _budget_saves(tmp_path / "whole", whole + (1 << 20), in_process=True)
    assert kept.host_bytes == whole and _shared_resident() >= shared + whole, "not kept in shared memory"
    for n in range(3):
        assert data_files(tmp_path / "whole" / f"process{n}") == data_files(tmp_path / f"thread{n}"), n
    kept.close()
    assert _shared_resident() <= shared, "close() kept the shared buffers"


@pytest.mark.slow  # a forked process: its resident memory holds nothing of the tests before it
def test_a_save_within_the_budget_is_filled_as_the_writer_process_asks_at_most_the_budget_held(tmp_path):
    """The writer process plans the save and asks for each tensor as its writer reaches it; this process fills it
    into shared memory and takes back the previous one: the thread's files, at most the budget (and the fills'
    staging ring) added to this process's peak (the shared memory it fills counts there), nothing of it left once
    written; a save that fits the budget whole fills shared buffers kept for the next."""
    spawn(budget_in_a_writer_process, 1, str(tmp_path))


def test_a_tensor_given_back_from_shared_memory_leaves_no_page_in_it_for_any_process():
    """A writer process still maps the tensor it wrote when this process gives it back (DCP's loop holds it until the
    next one is filled): its pages are removed from the shared file, as the budget counts them gone, not only
    unmapped here (``MADV_DONTNEED`` would leave them in /dev/shm, and read back, until every mapping goes)."""
    shared = shared_empty((1 << 20,), torch.float32).fill_(1)
    fd, size = shared.untyped_storage()._share_fd_cpu_()[:2]
    other = mmap.mmap(fd, size)  # a mapping of its own of the shared file, as the writer process's
    private = host_empty(torch.Size([1 << 20]), torch.float32).fill_(1)
    assert give_pages_back(shared) and give_pages_back(private)
    assert not shared.any() and other[:] == bytes(size) and not private.any()
    other.close()


class _HeldAtSecond:
    """A planner's ``resolve_data`` (what DCP's file writer asks its planner for) that waits, before the second
    tensor, until the file ``gate`` exists."""

    def __init__(self, planner, gate: str) -> None:
        self.planner, self.gate, self.tensors = planner, gate, 0

    def resolve_data(self, item):
        if item.type != WriteItemType.BYTE_IO:
            self.tensors += 1
            while self.tensors == 2 and not os.path.exists(self.gate):
                time.sleep(0.01)
        return self.planner.resolve_data(item)


class HeldAtSecondTensor(FileSystemWriter):
    """DCP's file writer (one thread, no copy-ahead: a budget's) held, in the writer process, after its first tensor
    until the file ``gate`` exists: the fills have started."""

    def __init__(self, path: str, gate: str) -> None:
        super().__init__(path, per_thread_copy_ahead=0)
        self.gate = gate

    def write_data(self, plan, planner):
        return super().write_data(plan, _HeldAtSecond(planner, self.gate))


def killed_inside_a_budgeted_save(rank: int, world: int, folder: str) -> None:
    """Killed -9 while the fills are held for it (its writer held after its first tensor): the save fails in one
    line, the shared memory they were filled into is given back, ``step()`` does not wait for fills that will never
    be asked for, and the next save (a new writer process) writes the thread's files. In a forked process: the
    shared memory resident here is this test's alone."""
    tmp_path = Path(folder)
    model, opt = _trained(2 * STATE)
    stager = AsyncSaveStager(opt, StagerOptions(write_in_process=True))
    shared = _shared_resident()
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    writer = HeldAtSecondTensor(str(tmp_path / "killed"), str(tmp_path / "never"))
    stager.async_save({"model": msd, "optim": osd}, storage_writer=writer, no_dist=True)
    # the fills hold what the budget lets them (the first 4 MiB weight, taken, and the bias after it), the writer
    # waiting
    assert _until(lambda: _shared_resident() >= shared + STATE), "the fills did not start"
    first = stager.writer_pid
    os.kill(first, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"writer process \(pid {first}\) ended with exit code -9"):
        stager.wait()
    assert _shared_resident() <= shared, "the killed save's fills were not given back"
    _budget_train(model, opt)  # waits for no fill
    save_plain(model, opt, tmp_path / "plain")
    with stager.exporting():
        msd, osd = get_state_dict(model, opt)
    stager.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "after"), no_dist=True)
    stager.wait()
    assert stager.writer_pid not in (None, first) and data_files(tmp_path / "after") == data_files(tmp_path / "plain")
    stager.close()


@pytest.mark.slow  # a forked process; kill -9
def test_a_writer_process_killed_inside_a_save_within_the_budget_gives_its_fills_back(tmp_path):
    spawn(killed_inside_a_budgeted_save, 1, str(tmp_path))


def test_a_shared_buffer_beyond_dev_shm_s_room_is_one_line_before_anything_is_allocated():
    """Touching shared memory beyond ``/dev/shm``'s room raises a bus error (a container's default room is 64 MiB):
    a buffer that cannot fit is refused in one line naming both sizes instead."""
    from optim_factory.optimizers.export import shared_empty

    room = os.statvfs("/dev/shm")
    needed = 2 * room.f_bavail * room.f_frsize + 1
    with pytest.raises(OSError, match=rf"^shared memory: /dev/shm has \d+ bytes free, a buffer needs {needed} \("):
        shared_empty((needed,), torch.uint8)


# the start of the training scripts below, each run as an interpreter of its own: a step, then a stager whose saves
# a writer process writes
TRAINER = """
import os
import sys
import time
import torch
from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, StagerOptions

if __name__ == "__main__":
    model = torch.nn.Linear(256, 256)
    opt = PortableFusedAdam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    stager = AsyncSaveStager(opt, StagerOptions(write_in_process=True))
"""

EXIT_WITHOUT_CLOSE = (
    TRAINER
    + """    response = stager.async_save({"model": model.state_dict()}, checkpoint_id=sys.argv[1])
    response.staging_completion.result()  # staged; the script ends without wait() or close()
"""
)


@pytest.mark.slow  # an interpreter of its own: its exit is what is tested
def test_an_interpreter_that_exits_without_close_writes_the_save_in_flight_first(tmp_path):
    """As DCP's writer thread is joined at the exit, the write in flight is waited for before multiprocessing's exit
    ends the (daemon) writer process. Broken on purpose (no wait at the exit): no checkpoint, exit code 0."""
    script = tmp_path / "loop.py"
    script.write_text(EXIT_WITHOUT_CLOSE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ck" / ".metadata").is_file(), done.stderr[-3000:]


KILLED_INSIDE_A_WRITE = (
    TRAINER
    + """    from tests.unit.saves import GatedFileWriter

    stager.async_save({"model": model.state_dict()}, storage_writer=GatedFileWriter(sys.argv[1], sys.argv[2]))
    while stager.writer_pid is None:
        time.sleep(0.01)
    child = os.fork()  # a child of the training process that outlives it (as a fork-started worker can, a while)
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(stager.writer_pid, child, flush=True)
    time.sleep(600)  # killed inside the write
"""
)


@pytest.mark.slow  # an interpreter of its own: killed -9 is what is tested
def test_a_training_process_killed_inside_a_write_takes_its_writer_process_with_it(tmp_path):
    """As DCP's writer thread ends with its process, a writer process ends with its training process, even while a
    child the training process forked lives on: a save in flight when the training process is killed is never
    completed afterwards (behind a relaunched job's back). Broken on purpose (no watch of the training process, or
    the forked child's copy of the watched pipe kept): the writer process writes the checkpoint once its gate
    opens."""
    script, ck, gate = tmp_path / "loop.py", tmp_path / "ck", tmp_path / "gate"
    script.write_text(KILLED_INSIDE_A_WRITE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    trainer = subprocess.Popen([sys.executable, str(script), str(ck), str(gate)], env=env, stdout=subprocess.PIPE)
    writer = child = None
    try:
        writer, child = (int(pid) for pid in trainer.stdout.readline().split())
        # the writer process waits at the gate: planning is done, nothing is written yet
        assert _until(ck.is_dir, 60), "the writer process did not reach its write"
        trainer.kill()
        trainer.wait()
        gone = _until(lambda: _gone(writer))
        gate.touch()  # a writer process still running writes the checkpoint now
        assert gone, "the writer process outlived its training process"
    finally:
        trainer.kill()
        trainer.wait()
        gate.touch()
        if child is not None:
            os.kill(child, signal.SIGKILL)
    assert not (ck / ".metadata").exists(), sorted(p.name for p in ck.iterdir())


def test_shared_buffers_beyond_the_open_files_limit_are_one_line_naming_it():
    """Each shared buffer keeps a file descriptor open in this process: past the limit, one line naming it (torch's
    own error is a multi-line traceback from inside its sharing)."""
    from optim_factory.optimizers.export import shared_empty

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 8
    kept = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with pytest.raises(OSError, match=rf"^shared memory: too many open files \(.*the limit is {limit}\): raise it"):
            for _ in range(64):
                kept.append(shared_empty((4,), torch.float32))
    finally:
        kept.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
